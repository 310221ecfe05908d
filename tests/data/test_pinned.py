"""The pinned pool: a buffer goes back to the free list only after the device passed a fence event."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gpukit.accelerators import SYNC_COUNTS, FakeCUDAAccelerator
from gpukit.data._pinned import PinnedMover, PinnedPool
from gpukit.placement import device_mover

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slow_device import SlowDevice  # noqa: E402


def test_a_buffer_is_reused_only_after_its_fence_is_passed() -> None:
    accelerator = SlowDevice()
    pool = PinnedPool(accelerator)
    syncs = SYNC_COUNTS.syncs
    a = pool.pin(torch.arange(4.0))
    assert accelerator.is_pinned(a) and torch.equal(a, torch.arange(4.0))
    fence = accelerator.timing_event()
    pool.fence(fence)  # recorded after a's copy; the device has not passed it
    b = pool.pin(torch.ones(4))
    assert b.data_ptr() != a.data_ptr() and torch.equal(a, torch.arange(4.0))  # a is still being read
    assert (pool.allocated, pool.reused, pool.in_flight) == (2, 0, 2)
    fence.passed = True
    pool.fence(accelerator.timing_event())  # the next fence covers b; the first one is passed now
    c = pool.pin(torch.full((4,), 7.0))
    assert c.data_ptr() == a.data_ptr() and torch.equal(c, torch.full((4,), 7.0))
    assert (pool.allocated, pool.reused) == (2, 1)
    assert pool.pin(torch.zeros(3)).shape == (3,)  # another shape: its own buffer
    assert SYNC_COUNTS.syncs == syncs  # never a wait


def test_a_full_pool_pins_outside_it_and_keeps_its_size() -> None:
    accelerator = SlowDevice()
    pool = PinnedPool(accelerator, max_bytes=2 * 4 * 4)  # two buffers of 4 floats
    for _ in range(5):
        buffer = pool.pin(torch.ones(4))
        assert accelerator.is_pinned(buffer) and torch.equal(buffer, torch.ones(4))
    assert (pool.allocated, pool.outside, pool.held_bytes) == (2, 3, 32)


def test_the_mover_keeps_the_batch_structure_and_other_leaves() -> None:
    accelerator = FakeCUDAAccelerator()
    device = torch.device("cpu")
    mover = PinnedMover(device, accelerator, device_mover(device))
    batch = {"x": torch.randn(2, 3), "ids": [torch.arange(2), "name"], "n": 3, "scalar": torch.tensor(1.0)}
    moved = mover(batch)
    assert set(moved) == set(batch) and moved["n"] == 3 and moved["ids"][1] == "name"
    assert torch.equal(moved["x"], batch["x"]) and moved["x"].data_ptr() != batch["x"].data_ptr()
    assert torch.equal(moved["ids"][0], batch["ids"][0]) and torch.equal(moved["scalar"], batch["scalar"])
    assert mover.pool.allocated == 2  # the two batch tensors; a 0-dim one is moved as it is
