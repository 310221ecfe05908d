"""gpukit claims in `gpukit doctor`: held claims, a folder that cannot be used, the queue, the notice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpukit.devices import _claim_dir, claim_gpus
from gpukit.devices._claim_dir import open_claim_folder
from gpukit.devices._queue import Ticket, request_of
from gpukit.devices._criteria import Criteria
from gpukit.doctor._claims import check_claims

_SPEC = {"driver_version": "550.54.15", "gpus": [
    {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaaaaaa-1111-4222-8333-44444444444" + str(i),
     "memory_total_mib": 40960, "memory_used_mib": 0} for i in range(2)]}


def test_held_claims_and_the_queue(use_spec, make_ctx) -> None:
    use_spec(_SPEC)
    [finding] = check_claims(make_ctx())
    assert finding.status == "ok" and "no gpukit claim is held" in finding.message
    with claim_gpus(2) as claim:
        claim.label("gpukit-3f2a9c", [0, 1])
        findings = check_claims(make_ctx())
        assert [f.status for f in findings] == ["info", "info"]
        assert f"is claimed by pid {os.getpid()}" in findings[0].message and "run gpukit-3f2a9c rank 0" in \
            findings[0].message
        with open_claim_folder() as folder, Ticket(folder, request_of(1, None, Criteria(), "index", 1.0)):
            waiting = [f for f in check_claims(make_ctx()) if "wait for GPUs" in f.message]
            assert len(waiting) == 1 and "wants 1 GPU" in waiting[0].message


def test_a_claim_folder_that_is_a_file_fails_as_gpukit_run_would(tmp_path: Path, make_ctx, use_spec) -> None:
    from gpukit.errors import DeviceError

    use_spec(_SPEC)
    path = tmp_path / "claims-file"
    path.write_text("not a directory")
    [finding] = check_claims(make_ctx({"GPUKIT_CLAIM_DIR": str(path)}))
    assert finding.status == "fail" and "GPUKIT_CLAIM_DIR" in finding.message and "not a directory" in finding.message
    with pytest.raises(DeviceError, match="not a directory"):  # what the finding promises
        open_claim_folder(path)


def test_a_relative_claim_folder_fails(make_ctx, use_spec) -> None:
    use_spec(_SPEC)
    [finding] = check_claims(make_ctx({"GPUKIT_CLAIM_DIR": "-1"}))
    assert finding.status == "fail" and "'-1' is a relative path" in finding.message


def test_the_per_user_folder_is_told(make_ctx, use_spec, monkeypatch, tmp_path: Path) -> None:
    use_spec(_SPEC)
    monkeypatch.delenv("GPUKIT_CLAIM_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(_claim_dir, "SYSTEM_CLAIM_DIR", tmp_path / "system")
    [finding] = check_claims(make_ctx())
    assert finding.status == "info" and "which only your own jobs use" in finding.message
    assert finding.fix == "an administrator can make a shared claim folder once: sudo gpukit claims setup"
