"""Claims: OS file locks per GPU UUID, so two jobs never take the same GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gpukit.devices import GpuClaim, claim_gpus, claim_holders, default_claim_dir
from gpukit.errors import DeviceError, GpuSelectionError


def _indices(claim: GpuClaim) -> list[int]:
    return [g.index for g in claim.gpus]


def test_claim_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpukit.devices import _claim_dir

    assert default_claim_dir() == tmp_path / "claims"  # GPUKIT_CLAIM_DIR (set by the fixture)
    assert default_claim_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("GPUKIT_CLAIM_DIR")
    monkeypatch.setattr(_claim_dir, "SYSTEM_CLAIM_DIR", tmp_path / "system")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "no-home"))
    # no shared folder made by `gpukit claims setup`: this user's own
    assert default_claim_dir() == Path(tempfile.gettempdir()) / f"gpukit-claims-{os.geteuid()}"
    (tmp_path / "system").mkdir()
    assert default_claim_dir() == tmp_path / "system"


def test_claims_exclude_each_other_in_process(use_spec: Callable[[Any], Any], tmp_path: Path) -> None:
    use_spec("shared-4gpu")
    first = claim_gpus(2, share=True)
    assert _indices(first) == [2, 1] and first.visible_devices == "2,1"
    holders = claim_holders([g.uuid for g in first.gpus])
    assert set(holders.values()) == {os.getpid()}  # the owner is known, for messages
    second = claim_gpus(2, share=True)
    assert _indices(second) == [0, 3]  # the best GPUs are taken, so the next best
    with pytest.raises(GpuSelectionError) as info:
        claim_gpus(1, share=True)
    assert f"GPU 2 (NVIDIA TITAN X (Pascal)): claimed by pid {os.getpid()} (this process)" in str(info.value)
    first.release()
    first.release()  # twice is fine
    assert first.released and claim_holders([g.uuid for g in first.gpus]) == {}
    # owner notes of released claims are gone; those of held claims stay
    assert sorted(p.name for p in (tmp_path / "claims").glob("*.owner")) == sorted(
        f"{g.uuid}.{os.getpid()}.owner" for g in second.gpus)
    with claim_gpus(1) as third:
        assert _indices(third) == [2]
    assert third.released
    second.release()


def test_unreferenced_claim_is_kept_until_released(use_spec: Callable[[Any], Any]) -> None:
    import gc

    use_spec("shared-4gpu")
    uuid = claim_gpus(1).gpus[0].uuid  # the GpuClaim itself is dropped at once
    gc.collect()
    assert claim_holders([uuid]) == {uuid: os.getpid()}
    from gpukit.devices._claims import _LIVE

    for claim in list(_LIVE):
        claim.release()
    assert claim_holders([uuid]) == {}


def test_claim_specific_gpus(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    with claim_gpus(gpus=["GPU-8d2e", 0], share=True) as claim:
        assert _indices(claim) == [3, 0]
        with pytest.raises(GpuSelectionError, match=r"GPU 0 .*claimed by pid"):
            claim_gpus(gpus=[1, 0], share=True)
        assert claim_holders([claim.gpus[0].uuid, "GPU-none"]).keys() == {claim.gpus[0].uuid}
    with pytest.raises(DeviceError, match=r"Cannot claim 7: it is not a GPU on this machine. GPUs here: GPU 0"):
        claim_gpus(gpus=[7])
    with pytest.raises(DeviceError, match=r"matches several devices"):
        claim_gpus(gpus=["GPU-"])


def test_claim_mig_device(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    with claim_gpus(gpus=["MIG-bb22"]) as claim:
        assert claim.visible_devices == "MIG-bb22cc33-dd44-5e55-9f66-007788990011"


# One worker of the race test: claim 1 GPU (waiting), log when it holds it, hold it until told.
WORKER = r"""
import os, sys, time
from pathlib import Path
from gpukit.devices import claim_gpus

name, root = sys.argv[1], Path(sys.argv[2])
claim = claim_gpus(1, wait=True, timeout_s=120, poll_interval_s=0.05)
uuid = claim.gpus[0].uuid
with open(root / "events" / name, "a") as log:
    log.write(f"acquire {uuid} {time.monotonic()!r}\n")
(root / "ready" / f"{name}.tmp").write_text(uuid)
os.replace(root / "ready" / f"{name}.tmp", root / "ready" / name)
deadline = time.monotonic() + 120
while not (root / "release" / name).exists():  # released when the test says so, not after a sleep
    if time.monotonic() > deadline:
        sys.exit("never told to release")
    time.sleep(0.02)
with open(root / "events" / name, "a") as log:
    log.write(f"release {uuid} {time.monotonic()!r}\n")
claim.release()
"""


def _wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_real_processes_race_for_gpus(use_spec: Callable[[Any], Any], tmp_path: Path) -> None:
    """6 processes claim 1 GPU each from a 4-GPU fake at once: never two on one GPU, waiters get
    GPUs as holders exit, and a SIGKILLed holder's GPU becomes free."""
    use_spec("idle-8gpu")
    spec = tmp_path / "four.json"
    import json

    data = json.loads(Path(os.environ["GPUKIT_FAKE_GPUS"]).read_text())
    data["gpus"] = data["gpus"][:4]
    spec.write_text(json.dumps(data))
    for sub in ("events", "ready", "release"):
        (tmp_path / sub).mkdir()
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(spec)}
    names = [f"w{i}" for i in range(6)]
    procs = {n: subprocess.Popen([sys.executable, "-c", WORKER, n, str(tmp_path)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{n}.err", "w"))
             for n in names}
    try:
        def ready() -> dict[str, str]:
            return {p.name: p.read_text() for p in (tmp_path / "ready").iterdir() if not p.name.endswith(".tmp")}

        first = _wait_for(lambda: ready() if len(ready()) >= 4 else None, "4 holders")
        assert len(first) == 4 and len(set(first.values())) == 4  # four different GPUs
        waiters = [n for n in names if n not in first]
        for n in waiters:  # the other two wait, and say what for
            err_file = tmp_path / f"{n}.err"
            _wait_for(lambda f=err_file: "waiting for 1 GPU" in f.read_text(), f"{n} waiting message")
            assert procs[n].poll() is None
        assert len(ready()) == 4

        # a holder releases: one waiter gets exactly that GPU
        released = names[0] if names[0] in first else sorted(first)[0]
        (tmp_path / "release" / released).touch()
        assert procs[released].wait(timeout=60) == 0
        after_release = _wait_for(lambda: ready() if len(ready()) >= 5 else None, "a waiter to get the GPU")
        (fifth,) = set(after_release) - set(first)
        assert after_release[fifth] == first[released]

        # a holder is SIGKILLed: the OS drops its lock, the last waiter gets that GPU
        killed = sorted(set(first) - {released})[0]
        kill_time = time.monotonic()
        procs[killed].send_signal(signal.SIGKILL)
        assert procs[killed].wait(timeout=60) == -signal.SIGKILL
        after_kill = _wait_for(lambda: ready() if len(ready()) >= 6 else None, "the killed holder's GPU")
        (sixth,) = set(after_kill) - set(after_release)
        assert after_kill[sixth] == first[killed]
    finally:
        for n in names:
            (tmp_path / "release" / n).touch()
        codes = {n: p.wait(timeout=60) for n, p in procs.items()}
    assert all(code == 0 for n, code in codes.items() if n != killed), codes

    # No GPU was ever held by two processes: per GPU, hold intervals do not overlap.
    intervals: dict[str, list[tuple[float, float]]] = {}
    for n in names:
        events = [line.split() for line in (tmp_path / "events" / n).read_text().splitlines()]
        acquire = float(events[0][2])
        release = float(events[1][2]) if len(events) > 1 else kill_time
        intervals.setdefault(events[0][1], []).append((acquire, release))
    assert sum(len(v) for v in intervals.values()) == 6
    for uuid, spans in intervals.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"{uuid} held twice at once: {spans}"


def test_the_multi_user_tests_skip_saying_why_where_other_users_cannot_read_the_clone(monkeypatch) -> None:
    """Issue 41 item 24: a clone in a folder other users cannot enter (``mktemp -d``, root's home) made
    the 5 multi-user probes fail with "No module named 'rich._emoji_codes'" read as a gpukit traceback;
    now they skip, naming the folder and the fix."""
    import shutil

    import other_users

    base = other_users.shared_area()  # 0755, under the temp dir: others may enter
    try:
        closed = base / "closed"
        package = closed / "clone" / "src" / "gpukit"
        package.mkdir(parents=True)
        for folder in (closed, closed / "clone", closed / "clone" / "src", package):
            os.chmod(folder, 0o755)
        assert other_users.unreadable_for_others(package) is None
        os.chmod(closed, 0o700)  # as mktemp -d makes it
        why = other_users.unreadable_for_others(package)
        assert why is not None and str(closed) in why and "0700" in why and "enter" in why
        fake = type("Module", (), {"__file__": str(package / "__init__.py")})
        monkeypatch.setattr(other_users.importlib, "import_module", lambda name: fake)
        reason = other_users.environment_blocked()
        assert reason is not None and "could not import gpukit" in reason and "chmod o+x" in reason
        assert other_users.unprivileged_users() == reason or os.geteuid() != 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
