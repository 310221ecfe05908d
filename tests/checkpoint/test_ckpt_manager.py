"""CheckpointManager: layout, latest, resume, rotation, incomplete checkpoints, failures."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import SmallNet
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from gpukit.checkpoint._formats import MARKER_NAME
from gpukit.errors import CheckpointError, ConfigurationError


class Position:
    """A minimal resumable loader position (iterable, so kept per rank)."""

    def __init__(self) -> None:
        self.epoch, self.batches_consumed = 0, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(())

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches_consumed = state["epoch"], state["batches_consumed"]


def _objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model, opt, sched


def test_save_layout_and_resume_restores_everything(tmp_path: Path) -> None:
    model, opt, sched = _objects(0)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    sched.step()
    pos = Position()
    pos.epoch, pos.batches_consumed = 2, 5
    manager = CheckpointManager(tmp_path / "ckpts")
    assert manager.resume(model=model) is None and manager.latest() is None
    path = manager.save(12, model=nn.DataParallel(model), optimizer=opt, scheduler=sched, loader=pos,
                        extra={"best_loss": 0.25})
    assert path.name == "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == [MARKER_NAME, "rank_00000.pt", "state.pt"]
    assert not any(k.startswith("module.") for k in gpukit.load(path / "state.pt")["objects"]["model"])
    expected_random = (random.random(), np.random.rand(), torch.rand(1))

    model2, opt2, sched2 = _objects(1)
    pos2 = Position()
    resumed = CheckpointManager(tmp_path / "ckpts")
    assert resumed.resume(model=torch.compile(model2), optimizer=opt2, scheduler=sched2, loader=pos2) == 12
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], opt2.state_dict()["state"][0]["momentum_buffer"])
    assert sched2.last_epoch == 1 and (pos2.epoch, pos2.batches_consumed) == (2, 5)
    assert resumed.extra == {"best_loss": 0.25}
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_random  # RNG streams resumed


def test_rotation_keeps_last_n_complete_and_ignores_incomplete(tmp_path: Path) -> None:
    model, opt, _ = _objects(0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        manager.save(step, model=model)
    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000004"]
    # a newer but incomplete checkpoint (killed before its marker) is never chosen
    incomplete = tmp_path / "step_00000009"
    incomplete.mkdir()
    (incomplete / "state.pt").write_bytes(b"torn")
    assert manager.latest() == tmp_path / "step_00000004"
    # a marker whose recorded sizes do not match (file truncated afterwards) is not complete either
    state = tmp_path / "step_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert manager.latest() == tmp_path / "step_00000003"
    with pytest.raises(CheckpointError, match="not a complete gpukit checkpoint: its complete.json is missing"):
        manager.resume(tmp_path / "step_00000009", model=model)
    # resuming from the latest passes over the damaged steps, but says so, naming file and fallback
    with pytest.warns(UserWarning) as caught:
        assert manager.resume(model=model) == 3
    messages = [str(w.message) for w in caught]
    assert any("step_00000004 is damaged: state.pt has 100 bytes where complete.json says" in m
               and "resuming from step_00000003 instead" in m for m in messages), messages
    assert any("step_00000009 is damaged: its complete.json is missing" in m for m in messages), messages
    assert all(w.filename == __file__ for w in caught)  # attributed to the caller's line


def test_debris_of_killed_saves_is_cleaned_on_next_save(tmp_path: Path) -> None:
    model, _, _ = _objects(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model=model)
    (tmp_path / ".step_00000002.partial").mkdir()
    (tmp_path / ".step_00000002.partial" / "state.pt").write_bytes(b"half")
    (tmp_path / ".step_00000001.old-0badc0de").mkdir()
    (tmp_path / ".state.pt.tmp-999999999-abcdef12").write_bytes(b"x")
    manager.save(2, model=model)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]


def test_saving_same_step_again_replaces_it(tmp_path: Path) -> None:
    model, _, _ = _objects(0)
    manager = CheckpointManager(tmp_path)
    manager.save(5, model=model, extra={"n": 1})
    manager.save(5, model=model, extra={"n": 2})
    assert manager.resume(model=model) == 5 and manager.extra == {"n": 2}
    assert sorted(os.listdir(tmp_path)) == ["step_00000005"]


def test_disk_full_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _objects(0)
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, model=model, optimizer=opt)
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync_fills_disk(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second file of the new checkpoint hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_fills_disk)
    with pytest.raises(CheckpointError, match="step 2 .* not saved.*Disk full") as info:
        manager.save(2, model=model, optimizer=opt)
    assert str(tmp_path) in str(info.value)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["step_00000001"]  # old one kept, partial one removed
    assert manager.resume(model=model, optimizer=opt) == 1


def test_bad_arguments_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ConfigurationError, match="epoch=int.*extra="):
        manager.save(1, epoch=3)
    manager.save(1, model=SmallNet())
    with pytest.raises(CheckpointError, match="no state for 'optimizer'.*holds: model"):
        manager.resume(model=SmallNet(), optimizer=torch.optim.SGD(SmallNet().parameters(), lr=1))
    marker = json.loads((tmp_path / "step_00000001" / MARKER_NAME).read_text())
    assert marker["torch_version"] == torch.__version__ and marker["world_size"] == 1


def test_rng_capture_restore_round_trip() -> None:
    state = capture_rng_state()
    first = (random.random(), np.random.normal(), torch.randn(3))
    restore_rng_state(state)
    assert (random.random(), np.random.normal()) == first[:2]
    assert torch.equal(torch.randn(3), first[2])
    assert set(state) >= {"python", "numpy", "torch"}
    assert "cuda" not in state or torch.cuda.is_initialized()  # never initialises CUDA itself


def test_a_mid_epoch_gpukit_loader_saved_by_2_processes_resumes_in_1(tmp_path: Path) -> None:
    from gpukit.accelerators import CPUAccelerator
    from gpukit.data import LoaderPlace, LoaderRequest, build_loader

    def make(world: int, rank: int = 0):  # type: ignore[no-untyped-def]
        place = LoaderPlace(torch.device("cpu"), CPUAccelerator(), rank=rank, world_size=world, local_world_size=world,
                            seed=3)
        return build_loader(list(range(16)), place, LoaderRequest(batch_size=2, shuffle=True, num_workers=0))

    first, second = make(2), make(2, rank=1)  # both ranks of a 2-process job, stopped mid-epoch
    seen = [int(i) for loader in (first, second) for i in next(iter(loader))]
    manager = CheckpointManager(tmp_path / "ckpts")
    manager.save(1, loader=first)
    resumed = make(1)
    CheckpointManager(tmp_path / "ckpts").resume(loader=resumed)
    assert resumed.state_dict()["samples_consumed"] == 4
    assert sorted(seen + [int(i) for batch in resumed for i in batch]) == list(range(16))


def _resume_as_rank_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpukit.checkpoint import _manager
    from gpukit.checkpoint._dist import DistContext

    monkeypatch.setattr(_manager, "current_dist", lambda: DistContext(rank=1, world_size=2))
    # no process group here: the other rank's answer to "can you open this step?" is the same
    monkeypatch.setattr(DistContext, "gather_all", lambda self, obj: [obj] * self.world_size)


def test_another_world_size_resumes_from_an_epoch_boundary_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _objects(0)
    boundary, mid = Position(), Position()
    boundary.epoch, mid.epoch, mid.batches_consumed = 3, 2, 5
    CheckpointManager(tmp_path / "boundary").save(7, model=model, optimizer=opt, loader=boundary)
    CheckpointManager(tmp_path / "mid").save(5, model=model, optimizer=opt, loader=mid)
    CheckpointManager(tmp_path / "own").save(5, model=model, optimizer=opt, per_rank=["optimizer"])
    _resume_as_rank_1_of_2(monkeypatch)  # this run has 2 processes; the checkpoints were saved by 1

    fresh, fresh_opt, _ = _objects(1)
    position = Position()
    with pytest.warns(UserWarning, match="saved by 1 process.*resuming with 2: models, optimizers"):
        assert CheckpointManager(tmp_path / "boundary").resume(model=fresh, optimizer=fresh_opt, loader=position) == 7
    assert position.epoch == 3 and torch.equal(fresh.fc1.weight, model.fc1.weight)

    for name, why in (("mid", "'loader' holds a data position saved mid-epoch (5 batches into epoch 2)"),
                      ("own", "'optimizer' holds per-process state")):
        untouched, untouched_opt, _ = _objects(2)
        before = untouched.fc1.weight.clone()
        with pytest.raises(CheckpointError) as info:
            CheckpointManager(tmp_path / name).resume(model=untouched, optimizer=untouched_opt, loader=Position())
        message = str(info.value)
        assert why in message and "was saved by 1 process(es) and this run has 2" in message
        assert "Resume with 1 process(es) (e.g. gpukit run --nproc 1 ...)" in message
        assert "start from another checkpoint directory" in message
        assert torch.equal(untouched.fc1.weight, before)  # refused before anything was restored


def test_streams_rederived_for_another_world_size_are_distinct_per_rank_and_repeatable() -> None:
    from gpukit.checkpoint._rng import rederive_rng_state

    saved = capture_rng_state()
    draws = {}
    for rank, world in ((0, 3), (1, 3), (2, 3), (0, 2)):
        rederive_rng_state(saved, rank, world)
        draws[rank, world] = (random.random(), float(np.random.normal()), torch.randn(2))
    rederive_rng_state(saved, 1, 3)
    assert (random.random(), float(np.random.normal())) == draws[1, 3][:2] and torch.equal(torch.randn(2), draws[1, 3][2])
    firsts = {key: value[0] for key, value in draws.items()}
    assert len(set(firsts.values())) == 4  # every (rank, world) its own stream
