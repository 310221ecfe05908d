"""Host memory for the weights the CPU computes on: one private anonymous mapping, its whole 2 MiB
blocks in transparent huge pages where the kernel offers them.

Why: a forward at batch 1 reads every weight once per token, and on the machine gpukit is measured
on (a VM, transparent huge pages in ``madvise`` mode) a model held in ordinary 4 KiB-page memory
took about twice the CPU time per token of the same model computed on the page cache's pages (large
folios): bench/RESULTS.md, issue 40. ``MADV_HUGEPAGE`` on the weights' own memory gives them the
same large pages. Only whole 2 MiB blocks are advised, so the resident bytes stay the tensors'
bytes (the tail stays in small pages: the plan's figures hold). Where the platform has no private
anonymous mapping or no ``madvise`` (Windows, macOS), or the buffer is small, it is plain
``torch.empty`` memory: the same bytes, only without the large pages.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["HUGE_PAGE_BYTES", "host_weights_buffer"]

HUGE_PAGE_BYTES = 2 * 2**20  # x86-64 and arm64 (4 KiB base pages): the PMD size


def host_weights_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``nbytes`` for weights, 2 MiB-aligned and advised into huge pages.

    Args:
        nbytes: its size in bytes.

    Returns:
        A tensor over a private anonymous mapping (it keeps the mapping alive), or a plain ``torch.empty``
        tensor where the platform cannot map one or ``nbytes`` is under one huge page.
    """
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes < HUGE_PAGE_BYTES or None in flags or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:  # 2 MiB more address space (never touched, so never resident) to start on a 2 MiB boundary
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags[0] | flags[1])  # type: ignore[operator]
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    skip = -raw.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:  # THP compiled out or disabled: small pages, the same bytes
        pass
    return raw[skip:skip + nbytes]
