"""Reading what anyone may have planted in a checkpoint: DCP's shard index, special files, sizes.

One real sharded checkpoint (an FSDP session of world size 1, gloo on CPU) is written per
module; the tests damage copies of it. The process-level battery (every reader, one fresh
process per input) is tests/hostile/test_hostile_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager
from gpukit.checkpoint._inspect import inspect_checkpoint
from gpukit.checkpoint._shard_index import read_shard_index
from gpukit.errors import CheckpointError, StateDictMismatchError, UnsafeCheckpointError

pytestmark = pytest.mark.requires_cpu_fsdp  # FSDP on gloo CPU processes: torch >= 2.7

STEP = "step_00000001"


def _model(width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded") / "ckpt"
    session = gpukit.Session(strategy="fsdp", accelerator="cpu", verbose=False)
    try:
        model, optimizer = session.setup(*_model())
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        session.save_checkpoint(root, 1, model=model, optimizer=optimizer)
    finally:
        session.close()
    return root


def _copy(sharded: Path, tmp_path: Path) -> Path:
    shutil.copytree(sharded, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _plant_index(step: Path, payload: bytes) -> None:
    (step / ".metadata").write_bytes(payload)
    marker = json.loads((step / "complete.json").read_text())
    marker["files"][".metadata"] = len(payload)  # the size check passes: the content must be refused
    (step / "complete.json").write_text(json.dumps(marker))


def _canary_payload(canary: Path) -> bytes:
    class Plant:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {canary}",))

    return pickle.dumps(Plant())


def test_real_fsdp_index_reads_as_dcp_reads_it(sharded: Path) -> None:
    step = sharded / STEP
    ours = read_shard_index(step)
    theirs = pickle.loads((step / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert "model.0.weight" in ours.state_dict_metadata


def test_planted_index_runs_nothing_and_names_the_file(sharded: Path, tmp_path: Path) -> None:
    step = _copy(sharded, tmp_path) / STEP
    canary = tmp_path / "canary"
    _plant_index(step, _canary_payload(canary))
    for read in (lambda: read_shard_index(step), lambda: inspect_checkpoint(step),
                 lambda: CheckpointManager(step.parent).resume(step, model=_model()[0])):
        with pytest.raises(UnsafeCheckpointError) as info:
            read()
        message = str(info.value)
        assert str(step / ".metadata") in message and "posix.system" in message and "\n" not in message
    assert not canary.exists()


def test_build_on_an_admitted_class_is_refused_and_undone(sharded: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    step = _copy(sharded, tmp_path) / STEP
    # GLOBAL Metadata; BUILD (None, {"evil": 1}): setattr on the class itself, not an instance
    payload = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
               b"N}X\x04\x00\x00\x00evilK\x01s\x86b.")
    _plant_index(step, payload)
    with pytest.raises(UnsafeCheckpointError, match="new attributes for Metadata"):
        read_shard_index(step)
    assert not hasattr(Metadata, "evil")


def test_trust_keeps_the_old_behaviour(sharded: Path, tmp_path: Path) -> None:
    step = _copy(sharded, tmp_path) / STEP
    canary = tmp_path / "canary"
    _plant_index(step, _canary_payload(canary))
    cmd = [sys.executable, "-m", "gpukit", "ckpt", "inspect", str(step)]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith("gpukit: error: Refused to read the shard index")
    assert not canary.exists()
    trusted = subprocess.run([*cmd, "--trust"], capture_output=True, text=True, timeout=120)
    assert canary.exists()  # full unpickling, as DCP does: the user said the file is trusted
    assert trusted.returncode == 2 and "not DCP metadata" in trusted.stderr  # and still checked after


def test_index_naming_a_shard_outside_the_step_is_refused(sharded: Path, tmp_path: Path) -> None:
    step = _copy(sharded, tmp_path) / STEP
    metadata = pickle.loads((step / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/hostname"
    _plant_index(step, pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="shards are files in the step directory itself"):
        read_shard_index(step)


def test_sharded_resume_into_another_model_lists_every_difference_before_loading(sharded: Path) -> None:
    other = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2), nn.Linear(2, 2))
    before = other[0].weight.detach().clone()
    with pytest.raises(StateDictMismatchError) as info:
        CheckpointManager(sharded).resume(model=other)
    message = str(info.value)
    assert "Cannot resume 'model' from the shards in" in message
    assert "Missing from the state dict (the model has them):" in message and "3.{weight,bias}" in message
    assert "Shape mismatch (state dict vs model):" in message and "[8, 4] vs [16, 4]" in message
    assert "Traceback" not in message and "CheckpointException" not in message and len(message.splitlines()) < 15
    assert torch.equal(other[0].weight, before)  # refused before DCP loaded anything


def test_inspect_counts_sharded_tensors_and_explains_shard_files(sharded: Path) -> None:
    info = inspect_checkpoint(sharded)
    sharded_objects = info["sharded"]["objects"]
    assert info["tensors"]["count"] == sum(o["tensors"] for o in sharded_objects.values()) > 0
    assert info["tensors"]["devices"]["sharded"] == info["tensors"]["count"]
    for name in ("__0_0.distcp", ".metadata"):
        with pytest.raises(CheckpointError, match=f"not a checkpoint by itself.*gpukit ckpt inspect {sharded / STEP}"):
            inspect_checkpoint(sharded / STEP / name)


def test_special_files_are_refused_before_they_are_opened(sharded: Path, tmp_path: Path) -> None:
    root = _copy(sharded, tmp_path)
    (root / STEP / ".metadata").unlink()
    os.mkfifo(root / STEP / ".metadata")  # nobody writes it: open() for reading would block forever
    with pytest.raises(CheckpointError, match=r"\.metadata is a FIFO \(named pipe\), not a regular file"):
        read_shard_index(root / STEP)
    loop = tmp_path / "loop.pt"
    os.symlink(loop, loop)
    with pytest.raises(CheckpointError, match="is a symlink loop"):
        gpukit.load(loop)
    dangling = tmp_path / "dangling.pt"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(CheckpointError, match="a symlink to a missing file"):
        gpukit.load(dangling)


def test_one_byte_pickle_and_overlapping_safetensors_are_clean_errors(tmp_path: Path) -> None:
    (tmp_path / "one.pt").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        gpukit.load(tmp_path / "one.pt")
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    (tmp_path / "o.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    with pytest.raises(CheckpointError, match="tensors 'a' and 'b' overlap"):
        inspect_checkpoint(tmp_path / "o.safetensors")


def test_resume_passes_over_a_damaged_newest_step(tmp_path: Path) -> None:
    model, optimizer = _model()
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, model=model, optimizer=optimizer)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    newest = manager.save(2, model=model, optimizer=optimizer)
    (newest / "state.pt").write_bytes(b"\x80" + bytes((newest / "state.pt").stat().st_size - 1))  # same size
    fresh, fresh_optimizer = _model()
    with torch.no_grad():
        fresh[0].weight.zero_()  # resuming step 1 must bring back its weights
    with pytest.warns(UserWarning, match=f"Checkpoint {newest} is damaged: .*resuming from step_00000001 instead"):
        assert manager.resume(model=fresh, optimizer=fresh_optimizer) == 1
    assert torch.equal(fresh[0].weight, _model()[0][0].weight)
    (manager.step_directory(1) / "rank_00000.pt").write_bytes(b"\x80" * 3)
    marker = json.loads((manager.step_directory(1) / "complete.json").read_text())
    marker["files"]["rank_00000.pt"] = 3
    (manager.step_directory(1) / "complete.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="No checkpoint in .* can be resumed: step_00000002: .*step_00000001: "):
        manager.resume(model=fresh, optimizer=fresh_optimizer)
