"""OOM post-mortem: allocator snapshot on CUDA, largest tensors on the CPU."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from gpukit.memory import largest_allocations, oom_postmortem, record_memory_history, write_oom_snapshot

SNAPSHOT = {
    "segments": [
        {
            "blocks": [
                {"state": "active_allocated", "size": 1024, "requested_size": 1000,
                 "frames": [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
                            {"filename": "train.py", "line": 42, "name": "step"}]},
                {"state": "inactive", "size": 10**9, "frames": []},
                {"state": "active_allocated", "size": 4096, "requested_size": 4000, "frames": []},
                # recorded with C++ stacks (torch's default "all"), as an H100 with torch 2.11 gave them
                {"state": "active_allocated", "size": 512, "requested_size": 500,
                 "frames": [{"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"},
                            {"filename": "/pytorch/torch/csrc/cuda/memory_snapshot.cpp", "line": 0,
                             "name": "torch::cuda::(anonymous namespace)::gather_with_cpp()"},
                            {"filename": "/x/site-packages/torch/cuda/memory.py", "line": 9, "name": "empty"},
                            {"filename": "/home/u/train.py", "line": 7, "name": "main"}]},
            ]
        }
    ]
}


def test_largest_allocations_skip_free_blocks_and_point_at_user_lines() -> None:
    top = largest_allocations(SNAPSHOT, top=5)
    assert [a.size_bytes for a in top] == [4000, 1000, 500]
    assert top[0].source is None and top[1].source == "train.py:42 in step"
    assert top[2].source == "/home/u/train.py:7 in main"  # not the C++ frame before it


def test_cpu_post_mortem_says_what_is_available(capsys: pytest.CaptureFixture[str]) -> None:
    big = torch.zeros(123, 4567)
    out = io.StringIO()
    assert write_oom_snapshot(device="cpu", file=out) is None
    text = out.getvalue()
    assert "no allocator snapshot on cpu" in text and "[123, 4567] float32" in text
    assert record_memory_history(device="cpu") is False
    with pytest.raises(torch.OutOfMemoryError), oom_postmortem(device="cpu"):
        raise torch.OutOfMemoryError("injected")
    assert "largest live CPU tensors" in capsys.readouterr().err
    del big


@pytest.mark.requires_gpu
def test_cuda_post_mortem_writes_a_snapshot_with_source_lines(tmp_path: Path) -> None:
    assert record_memory_history(device="cuda")
    try:
        keep = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
        out = io.StringIO()
        path = write_oom_snapshot(tmp_path / "oom.pickle", device="cuda", file=out)
    finally:
        record_memory_history(False, device="cuda")
    assert path is not None and "memory_viz" in out.getvalue()
    snapshot = pickle.loads(path.read_bytes())
    assert largest_allocations(snapshot, 1)[0].size_bytes >= keep.numel()
    assert "test_memory_postmortem.py" in out.getvalue()
