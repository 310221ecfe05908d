"""Background saves: the call returns after a host copy; write, commit and rotation follow in a thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager, _atomic, capture_rng_state, last_save_timings, wait_for_saves
from gpukit.checkpoint._background import background_saves
from gpukit.checkpoint._snapshot import HostBuffers, snapshot
from gpukit.errors import CheckpointError


@pytest.fixture(autouse=True)
def _no_save_left_behind():
    yield
    try:
        wait_for_saves()
    except CheckpointError:
        pass


def _filled(model: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_training_after_the_call_does_not_reach_the_checkpoint(tmp_path: Path) -> None:
    model = _filled(nn.Linear(64, 64), 1.0)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(tmp_path, keep_last=2)
    final = manager.save(1, model=model, optimizer=optimizer, background=True)
    _filled(model, 7.0)  # the loop goes on while the save writes
    optimizer.state.clear()
    wait_for_saves()
    fresh = nn.Linear(64, 64)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    assert manager.resume(model=fresh, optimizer=fresh_optimizer, restore_rng=False) == 1
    assert manager.latest() == final
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert len(fresh_optimizer.state) == 2  # the Adam state as it was at the call


def test_snapshot_reuses_its_buffers_and_keeps_shared_storage() -> None:
    weight = torch.randn(8, 8)
    state = {"a": weight, "tied": weight, "view": weight[2:], "n": [1, (2.0, "x")], "e": torch.empty(0)}
    buffers = HostBuffers()
    first, nbytes = snapshot(state, buffers)
    pointers = [s.data_ptr() for s in buffers._pool]
    weight.add_(1)
    second, _ = snapshot(state, buffers)
    assert [s.data_ptr() for s in buffers._pool] == pointers  # no new memory for the second save
    assert nbytes == weight.numel() * 4 and buffers.nbytes == nbytes  # one copy of the storage
    assert second["tied"].untyped_storage().data_ptr() == second["a"].untyped_storage().data_ptr()
    assert torch.equal(second["view"], weight[2:]) and second["n"] == [1, (2.0, "x")]
    assert second["a"].data_ptr() != weight.data_ptr()


def test_one_save_in_flight_the_next_waits_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, order = threading.Event(), []
    real = CheckpointManager._finalise

    def held_finalise(self, dist, staging, final, step):  # noqa: ANN001, ANN202
        if step == 1:
            release.wait(60)
        order.append(step)
        return real(self, dist, staging, final, step)

    monkeypatch.setattr(CheckpointManager, "_finalise", held_finalise)
    manager = CheckpointManager(tmp_path, keep_last=3)
    model = nn.Linear(4, 4)
    manager.save(1, model=model, background=True)
    second = threading.Thread(target=lambda: manager.save(2, model=model, background=True))
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == []  # the second save waits for the first one's commit
    release.set()
    second.join(60)
    wait_for_saves()
    assert order == [1, 2]
    timings = last_save_timings()
    assert timings is not None and timings.what.startswith("step 2") and timings.waited_s >= 0.4
    assert timings.blocked_s >= timings.waited_s and timings.total_s >= timings.blocked_s


def test_a_failed_background_save_is_raised_by_the_next_call_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    model = nn.Linear(4, 4)
    manager.save(1, model=model)

    def deny(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_atomic, "_open_temp_file", deny)
    manager.save(2, model=model, background=True)  # returns: the failure comes later
    with pytest.raises(CheckpointError, match=r"background save of step 2 in .* failed: .*Permission denied"):
        manager.save(3, model=model, background=True)  # waits for save 2, raises before writing
    monkeypatch.undo()
    assert manager.latest() == manager.step_directory(1)  # the failed one left nothing behind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    manager.save(3, model=model, background=True)  # said once: the next save goes ahead
    wait_for_saves()
    assert manager.latest() == manager.step_directory(3)


def test_resume_and_session_close_wait_for_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False)
    model = session.setup(nn.Linear(4, 4))
    session.save_checkpoint(tmp_path, 1, model=model)
    monkeypatch.setattr(_atomic, "_open_temp_file", lambda path: (_ for _ in ()).throw(OSError(5, "I/O error")))
    session.save_checkpoint(tmp_path, 2, model=model, background=True)
    with pytest.raises(CheckpointError, match="background save of step 2.*I/O error"):
        session.close()
    monkeypatch.undo()
    session.save_checkpoint(tmp_path, 3, model=model, background=True)
    assert session.resume(tmp_path, model=model) == 3  # resume waited for it


def test_gpukit_save_in_the_background(tmp_path: Path) -> None:
    weights = {"w": torch.arange(1000.0)}
    target = gpukit.save(weights, tmp_path / "w.safetensors", background=True)
    weights["w"].zero_()
    wait_for_saves()
    assert torch.equal(gpukit.load(target)["w"], torch.arange(1000.0))
    assert last_save_timings().host_bytes == 4000


_SLOW_EXIT = """
import os, sys, torch
from torch import nn
from gpukit.checkpoint import CheckpointManager, _atomic

real = _atomic._GuardedFile.pwrite
def slow(self, data, offset):  # a slow disk: the save is still writing when the script ends
    import time; time.sleep(0.05)
    return real(self, data, offset)
_atomic._GuardedFile.pwrite = slow
manager = CheckpointManager(sys.argv[1])
final = manager.save(1, model=nn.Linear(512, 512), background=True)
print("returned before commit:", not final.exists(), flush=True)
if len(sys.argv) > 2:
    from gpukit.checkpoint import wait_for_saves
    wait_for_saves()
    _atomic._GuardedFile.pwrite = lambda self, data, offset: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    final = manager.save(2, model=nn.Linear(512, 512), background=True)
"""


def test_exit_waits_for_the_save_and_prints_an_unreported_failure(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(_SLOW_EXIT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "a")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "returned before commit: True" in done.stdout
    assert CheckpointManager(tmp_path / "a").latest() == tmp_path / "a" / "step_00000001"
    failed = subprocess.run([sys.executable, str(script), str(tmp_path / "b"), "fail"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert "gpukit: The background save of step 2" in failed.stderr and "Disk full" in failed.stderr
    assert CheckpointManager(tmp_path / "b").latest() == tmp_path / "b" / "step_00000001"


def test_background_saves_keep_one_copy_of_host_memory(tmp_path: Path) -> None:
    model = nn.Linear(256, 256)
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        manager.save(step, model=model, background=True)
    wait_for_saves()
    weights = sum(t.numel() * 4 for t in model.state_dict().values())
    rng = snapshot(capture_rng_state(), HostBuffers())[1]  # the rank file's generator states
    assert background_saves().buffers.nbytes == weights + rng


@pytest.mark.requires_gpu
def test_gpu_state_goes_through_pinned_buffers_reused_across_saves(tmp_path: Path) -> None:
    model = nn.Linear(1024, 1024).cuda()
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, model=model, background=True)
    buffers = background_saves().buffers
    pinned = [s for s in buffers._pool if s.is_pinned()]
    assert pinned and sum(s.nbytes() for s in pinned) == sum(t.numel() * 4 for t in model.state_dict().values())
    pointers = sorted(s.data_ptr() for s in pinned)
    with torch.no_grad():
        model.weight.fill_(3.0)
    manager.save(2, model=model, background=True)
    with torch.no_grad():
        model.weight.fill_(5.0)  # after the call: not in checkpoint 2
    wait_for_saves()
    assert sorted(s.data_ptr() for s in buffers._pool if s.is_pinned()) == pointers
    restored = nn.Linear(1024, 1024)
    assert CheckpointManager(tmp_path).resume(model=restored, restore_rng=False) == 2
    assert torch.equal(restored.weight, torch.full_like(restored.weight, 3.0))


def test_pipeline_session_saves_in_the_background(tmp_path: Path) -> None:
    from gpukit.strategies import PipelineStrategy

    def build(seed: int):  # noqa: ANN202
        torch.manual_seed(seed)
        session = gpukit.Session(strategy=PipelineStrategy(["cpu", "cpu"], chunks=2, verbose=False), verbose=False)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return (session, *session.setup(model, optimizer))

    session, model, optimizer = build(0)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    session.backward(nn.functional.cross_entropy(model(x), y))
    session.step(optimizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    session.save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, background=True)
    session.backward(nn.functional.cross_entropy(model(x), y))  # the next step, while it writes
    session.step(optimizer)
    session.close()
    other, resumed, resumed_optimizer = build(5)
    assert other.resume(tmp_path, model=resumed, optimizer=resumed_optimizer) == 1
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_plain_save_after_a_background_one_has_its_own_timings(tmp_path: Path) -> None:
    # issue 41.21: the synchronous branch never recorded its timings, so the previous save's were returned
    gpukit.save({"w": torch.zeros(1000)}, tmp_path / "first.pt", background=True)
    wait_for_saves()
    gpukit.save({"w": torch.ones(10)}, tmp_path / "second.pt")
    timings = last_save_timings()
    assert timings is not None and timings.what == str(tmp_path / "second.pt") and not timings.background
    assert timings.total_s is not None and timings.total_s >= timings.blocked_s > 0
