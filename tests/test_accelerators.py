"""The accelerators' count of host synchronisations and device events, and the CUDA-like fake."""

from __future__ import annotations

import pytest
import torch

from gpukit.accelerators import SYNC_COUNTS, CPUAccelerator, CUDAAccelerator, FakeCUDAAccelerator


def _counts() -> tuple[int, int]:
    return SYNC_COUNTS.syncs, SYNC_COUNTS.events


def test_the_host_counts_nothing_it_has_nothing_to_wait_for() -> None:
    cpu = CPUAccelerator()
    before = _counts()
    cpu.synchronize()
    assert cpu.timing_event() is None and not cpu.has_timing_events
    assert cpu.read_scalar(torch.tensor(2.5)) == 2.5
    host, event = cpu.to_host_async(torch.tensor([1.0, 2.0]))
    assert event is None and host.tolist() == [1.0, 2.0]
    assert _counts() == before


def test_the_fake_counts_what_cuda_would() -> None:
    fake = FakeCUDAAccelerator()
    assert fake.benefits_from_pinned_memory and not fake.is_host and fake.device(3) == torch.device("cpu")
    syncs, events = _counts()
    fake.synchronize()
    assert fake.read_scalar(torch.tensor(1.5)) == 1.5  # a device value read on the host: a sync
    start = fake.timing_event()
    end = fake.timing_event()
    assert fake.event_done(end) and fake.elapsed_s(start, end) >= 0
    host, event = fake.to_host_async(torch.tensor([3.0]))
    assert fake.event_done(event) and host.tolist() == [3.0]
    fake.wait_event(event)
    assert _counts() == (syncs + 3, events + 2 + 1 + 1 + 1)
    assert repr(SYNC_COUNTS).startswith("SyncCounts(syncs=")


def test_fake_pinned_buffers_are_known_and_copies_are_new_tensors() -> None:
    fake = FakeCUDAAccelerator()
    buffer = fake.pinned_empty((2, 3), torch.float16)
    assert buffer.shape == (2, 3) and buffer.dtype == torch.float16 and fake.is_pinned(buffer)
    assert not fake.is_pinned(torch.empty(2))
    copy = fake.copy_to_device(buffer.fill_(1), fake.device())
    assert torch.equal(copy, buffer) and copy.data_ptr() != buffer.data_ptr()


@pytest.mark.requires_gpu
def test_cuda_counts_its_syncs_and_events_and_reads_without_waiting() -> None:
    cuda = CUDAAccelerator()
    syncs, events = _counts()
    cuda.synchronize()
    value = torch.arange(4.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        host, event = cuda.to_host_async(value)  # no sync: the debug mode would raise
        start = cuda.timing_event()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cuda.wait_event(event)
    assert host.is_pinned() and host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cuda.event_done(start)
    assert _counts() == (syncs + 2, events + 3)
