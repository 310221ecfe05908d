"""gpu-check part `tensor`: what one GPU can run of tensor parallelism (nothing here needs two GPUs).

1. **A tensor rank's memory.** The planner plans a rank of a tensor group of 2 as its shard of the model
   (``gpukit.memory.FitPlanner.exact(..., tensor=2)``: every split layer narrowed to half, attention's head
   counts halved). That shard model, made real on the GPU, runs two Adam steps
   (``torch.cuda.max_memory_allocated``): the estimate / measured ratio, goal within 15% as the `memory`
   part's. The collectives' buffers are not in it (one GPU has no peer); the CPU suite measures those on
   gloo processes (tests/strategies/test_tensor_parallel_multiprocess.py).
2. **The split on CUDA.** The automatic plan applied by ``parallelize_module`` over a one-rank ("dp", "tp")
   mesh (NCCL, one process): the DTensor path a real tensor group runs -- placements, redistribution,
   the collectives of one rank -- and the forward and gradients equal the plain model's.

In a dry run: the CPU with gloo, tiny sizes; the estimate is made for "cuda" and nothing is measured.
"""

from __future__ import annotations

import copy
import os
import sys

from _common import DRY, ROOT, device, emit, guarded, judged

sys.path.insert(0, str(ROOT / "tests" / "memory"))
PRECISIONS = ("32-true", "bf16-mixed")
DEGREE = 2


def _shard_on(planner: object, model: object, dev: object) -> object:
    """The planner's shard model, allocated on ``dev``: weights drawn, buffers copied from ``model``."""
    import torch

    local = planner.split(DEGREE)[1].to_empty(device=dev)  # type: ignore[attr-defined]
    with torch.no_grad():
        for param in local.parameters():
            param.normal_(0.0, 0.02)
        for name, buffer in model.named_buffers():  # type: ignore[attr-defined]
            local.get_buffer(name).copy_(buffer)  # rotary frequencies and the like: computed, not drawn
    return local


def rank_memory(name: str, precision: str) -> None:
    import torch

    from gpukit.memory import FitPlanner, measure_peak_memory
    from planner_models import BATCHES, MODELS

    factory, batch_of = MODELS[name]
    torch.manual_seed(0)
    model, batch = factory(), batch_of(2 if DRY else BATCHES[name])
    planner = FitPlanner(model, batch, "adam", "cuda")
    estimate = planner.exact(precision, "none", batch.shape[0], DEGREE)
    check = f"tensor x{DEGREE} rank {name} {precision}"
    if DRY:
        emit(check, "skip", estimate.peak_bytes / 2**20, "MiB est.", "dry run: nothing to measure")
        return
    local = _shard_on(planner, model, device())
    # the shard's embeddings hold 1/T of the rows: ids beyond them would index out of bounds on the GPU (the
    # real split masks them); the same shapes, so the same memory
    rows = min((m.num_embeddings for m in local.modules() if isinstance(m, torch.nn.Embedding)), default=None)
    if rows is not None and not batch.is_floating_point():
        batch = batch % rows
    measured = measure_peak_memory(local, batch, precision=precision)
    ratio = estimate.peak_bytes / measured
    judged(check, ratio, "est/measured", "within 15%", abs(ratio - 1) <= 0.15,
           f"{estimate.peak_bytes / 2**20:.1f} / {measured / 2**20:.1f} MiB (the shard model's step; no collectives)")
    torch.cuda.empty_cache()


def split_on_one_rank() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from gpukit.strategies._tp_plan import auto_plan
    from planner_models import Transformer

    dev = device()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group("gloo" if DRY else "nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = Transformer(width=32 if DRY else 256, depth=2).to(dev)
        split = copy.deepcopy(plain)
        mesh = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("dp", "tp"))
        plan = auto_plan(split, 1)
        parallelize_module(split, mesh["tp"], plan.styles)
        ids = torch.randint(0, 1000, (4, 64), device=dev)
        outputs = []
        for model in (plain, split):
            out = model(ids)
            out = out.full_tensor() if isinstance(out, DTensor) else out
            out.float().square().mean().backward()
            outputs.append(out.detach())
        grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in split.parameters()]
        worst = max(float((a - b.grad).abs().max()) for a, b in zip(grads, plain.parameters()))
        worst = max(worst, float((outputs[0] - outputs[1]).abs().max()))
        dtensors = sum(isinstance(p, DTensor) for p in split.parameters())
        judged("split over a 1-rank mesh", worst, "max abs diff", "<= 1e-5 (same forward and gradients)", worst <= 1e-5,
               f"{len(plan.styles)} layers split, {dtensors} DTensor parameters on {dev}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    from planner_models import MODELS

    for name in ("transformer",) if DRY else ("transformer", "llama"):
        try:
            MODELS[name][0]()
        except ImportError as exc:
            emit(name, "skip", detail=f"{exc}")
            continue
        for precision in PRECISIONS[:1] if DRY else PRECISIONS:
            guarded(f"tensor x{DEGREE} rank {name} {precision}", rank_memory, name, precision)
    guarded("split over a 1-rank mesh", split_on_one_rank)


if __name__ == "__main__":
    main()
