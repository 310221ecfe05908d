"""FSDP2 with 2 real processes (`gpukit run --cpu --nproc 2`, gloo): one launch, several checks.

The same small transformer trains under FSDP (Session) and DDP (by hand, same batches) (SGD with momentum, accumulation 2, clipping
that bites); both must match one process training on the union of the two ranks' batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_worker as worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.requires_cpu_fsdp]  # FSDP on gloo CPU processes: torch >= 2.7


def _train(out: Path, *where: str) -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", *where,
           str(Path(worker.__file__)), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fsdp = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"fsdp": fsdp, "ddp": [rec.pop("ddp") for rec in fsdp]}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return _train(tmp_path_factory.mktemp("fsdp"), "--cpu", "--nproc", "2")


def _reference(indices: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """One process on the full batch: the union of what the two ranks saw at each micro-step."""
    data = worker.make_data()
    torch.manual_seed(0)  # what Session(seed=0) did before the worker built its model
    model = worker.TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, (i0, i1) in enumerate(zip(*indices)):
        x, y, _ = data[torch.tensor(i0 + i1)]
        (nn.functional.mse_loss(model(x), y) / worker.ACCUM).backward()
        if (step + 1) % worker.ACCUM == 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP)
            assert norm > worker.CLIP  # the clipping changed the update
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def _check_equal(records: dict[str, list[dict]], tolerance: float) -> None:
    ddp, fsdp = records["ddp"], records["fsdp"]
    assert [r["strategy"] for r in fsdp] == ["fsdp", "fsdp"]
    reference = _reference([r["indices"] for r in fsdp])
    for rec in ddp + fsdp:
        assert rec["state"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(rec["state"][key], value, rtol=tolerance, atol=tolerance / 10, msg=key)


def test_fsdp_equals_ddp_and_one_process(records: dict[str, list[dict]]) -> None:
    _check_equal(records, 2e-5)


@pytest.mark.requires_gpus(2)
def test_fsdp_on_two_gpus_with_nccl(tmp_path: Path) -> None:
    _check_equal(_train(tmp_path, "--gpus", "2"), 1e-3)  # cuBLAS sums in other orders


def test_each_block_is_a_unit_and_state_is_sharded(records: dict[str, list[dict]]) -> None:
    fsdp, ddp = records["fsdp"], records["ddp"]
    assert fsdp[0]["units"] == ["layers.1", "layers.0"]  # innermost first; the root is last
    full = ddp[0]["local_param_numel"]
    for rec in fsdp:  # each rank holds about half of the parameters and of the momentum buffers
        assert abs(rec["local_param_numel"] - full / 2) <= full * 0.05
        assert abs(rec["local_optimizer_numel"] - ddp[0]["local_optimizer_numel"] / 2) <= full * 0.1


def test_no_gradient_reduction_before_the_accumulation_boundary(records: dict[str, list[dict]]) -> None:
    # with sync off FSDP keeps unsharded local gradients and leaves the sharded .grad unset
    expected = [(i + 1) % worker.ACCUM == 0 for i in range(len(records["fsdp"][0]["indices"]))]
    assert records["fsdp"][0]["grad_before_boundary"] == expected
