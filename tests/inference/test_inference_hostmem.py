"""Resident host weights in huge pages: exactly their bytes resident, aligned, and usable as tensors."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from gpukit.inference._hostmem import HUGE_PAGE_BYTES, host_weights_buffer


def _mappings_rss_bytes(buffer: torch.Tensor) -> int:
    """Rss of the mappings over ``buffer``'s bytes (from /proc/self/smaps; madvise splits one mapping in several)."""
    first, last = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    rss, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start < last and end > first
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages and /proc/self/smaps are Linux's")
def test_a_large_buffer_is_aligned_and_holds_only_its_own_bytes() -> None:
    nbytes = 3 * HUGE_PAGE_BYTES + 12_345  # whole huge pages and a tail that is not one
    buffer = host_weights_buffer(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    before = _mappings_rss_bytes(buffer)  # (a neighbouring mapping the kernel merged it with counts too)
    buffer.fill_(7)
    grown = _mappings_rss_bytes(buffer) - before
    # its bytes, rounded up to a page at the tail: the plan's figure, not one huge page more
    assert nbytes <= grown <= nbytes + mmap.PAGESIZE
    plain = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    weights = buffer[:HUGE_PAGE_BYTES].view(torch.float32).view(512, 1024)
    weights.copy_(plain)
    x = torch.randn(3, 1024)
    assert torch.equal(x @ weights.T, x @ plain.T)  # the same kernel, the same bits


def test_a_small_buffer_is_plain_memory() -> None:
    buffer = host_weights_buffer(1000)
    assert buffer.numel() == 1000 and buffer.device.type == "cpu"
