"""gpu-check part `mfu`: P7, model FLOPs utilisation of GPT-2 small, with a plain-torch row beside it.

GPT-2 small's shape (124 M parameters, 12 x 768, 12 heads, vocab 50304), 8 x 1024 tokens a step,
bf16 autocast, AdamW -- the setting llm.c reaches ~40% MFU with on an H100. Rows:

* plain torch, eager: the loop a user writes by hand (the row the Session is judged against);
* gpukit eager, the same settings through a Session: goal within 2% of plain (blocks of steps
  interleaved with the plain loop's, so a drifting clock hits both);
* gpukit with the automatic settings (``precision="auto"``, ``compile=True``): goal >= 40% MFU on
  H100/H200; plain torch compiled beside it tells gpukit's share of what is left;
* the FLOPs gpukit counted on its second step (``session.flops_per_step``) against PaLM's formula
  (6 N per token for the weights + 12 L d T per token for attention), which the MFU figures use.

MFU divides by the dense bf16 peak of ``gpukit.devices.dense_peak`` (989.4 TFLOP/s on H100/H200 SXM).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from _common import DRY, device, emit, guarded, judged, sync

LAYERS, WIDTH, HEADS, VOCAB, CONTEXT, BATCH = (2, 64, 4, 512, 32, 2) if DRY else (12, 768, 12, 50304, 1024, 8)
# warm-up: the first step compiles, the second is the one gpukit counts FLOPs in (slowed): both left out
WARMUP, BLOCK, BLOCKS = (2, 2, 2) if DRY else (3, 10, 3)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 small's shape (12 x 768, 12 heads, vocab 50304, 1024 positions), weights tied."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0)).to(device())
    return idx[:, :-1], idx[:, 1:]


def formula_flops(model: GPT) -> int:
    """PaLM's count per step: 6 N per token (N without the position table) + 12 L d T per token for attention."""
    n_params = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    return BATCH * CONTEXT * (6 * n_params + 12 * LAYERS * WIDTH * CONTEXT)


def plain_step(compiled: bool) -> tuple[Callable[[], None], GPT]:
    """The hand-written loop: autocast bf16 around forward and loss, AdamW."""
    model = _model().to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    run = torch.compile(model) if compiled else model
    x, y = _batch()
    kind = device().type

    def step() -> None:
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def session_step(**options: object) -> tuple[Callable[[], None], GPT, object]:
    """The same step through a Session (``options``: its precision, compile ...)."""
    import gpukit

    model = _model()
    session = gpukit.Session(devices=device(), verbose=False, **options)
    run, opt = session.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    x, y = _batch()

    def step() -> None:
        session.run_step(lambda b: F.cross_entropy(run(b[0]).flatten(0, 1).float(), b[1].flatten()), (x, y))
        session.step(opt)

    return step, model, session


def _warm(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    for _ in range(WARMUP):
        step()
    sync()
    return time.perf_counter() - started


def _block_s(step: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    for _ in range(BLOCK):
        step()
    sync()
    return (time.perf_counter() - started) / BLOCK


def _interleaved(*steps: Callable[[], None]) -> list[float]:
    """Median seconds per step of each, over BLOCKS blocks taken in turn."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(BLOCKS):
        for i, step in enumerate(steps):
            times[i].append(_block_s(step))
    return [statistics.median(t) for t in times]


def _peak() -> tuple[float | None, str, bool]:
    """The dense bf16 peak, where it comes from, and whether the 40% goal applies (H100/H200)."""
    from gpukit.devices import dense_peak

    found = None if DRY else dense_peak(torch.cuda.get_device_name(0), "bf16")
    if found is None:
        return None, "no peak (dry run or a GPU not in the table)", False
    return found.tflops, found.source, found.model.startswith(("H100", "H200"))


def _mfu_row(label: str, flops: int, step_s: float, warm_s: float, peak: float | None, source: str) -> float | None:
    tflops = flops / step_s / 1e12
    mfu = None if peak is None else tflops / peak
    emit(f"P7 {label}", "info", None if mfu is None else 100 * mfu, "% MFU",
         f"{tflops:.0f} TFLOP/s, {step_s * 1e3:.1f} ms/step ({BATCH}x{CONTEXT} tokens), warm-up {warm_s:.1f} s; "
         f"peak {peak} ({source})")
    return mfu


def p7_eager() -> None:
    """Plain torch and gpukit, eager, interleaved: gpukit's own share of the step."""
    peak, source, _ = _peak()
    plain, model = plain_step(compiled=False)
    ours, _, session = session_step(precision="bf16-mixed")
    warm_plain, warm_ours = _warm(plain), _warm(ours)
    t_plain, t_ours = _interleaved(plain, ours)
    flops = formula_flops(model)
    _mfu_row("plain torch eager", flops, t_plain, warm_plain, peak, source)
    _mfu_row("gpukit eager", flops, t_ours, warm_ours, peak, source)
    judged("P7 gpukit eager / plain torch eager", t_ours / t_plain, "x", "<= 1.02x plain (within 2%)",
           t_ours / t_plain <= 1.02, f"{t_ours * 1e3:.2f} against {t_plain * 1e3:.2f} ms/step, "
           f"{BLOCKS} interleaved blocks of {BLOCK} steps")
    counted = session.flops_per_step  # type: ignore[attr-defined]
    emit("P7 FLOPs gpukit counted / PaLM's formula", "info", None if counted is None else counted / flops, "x",
         f"counted on gpukit's second step {counted}, formula {flops} (the counter counts causal attention "
         "in full, and the embedding lookups and the loss as 0)")


def p7_auto() -> None:
    """The automatic settings (precision auto, compile) against plain torch compiled: the 40% goal."""
    peak, source, goal_applies = _peak()
    ours, model, session = session_step(precision="auto", compile=True)
    warm_ours = _warm(ours)
    plain, _ = plain_step(compiled=True)
    warm_plain = _warm(plain)
    t_plain, t_ours = _interleaved(plain, ours)
    flops = formula_flops(model)
    _mfu_row("plain torch compiled", flops, t_plain, warm_plain, peak, source)
    mfu = _mfu_row("gpukit automatic settings", flops, t_ours, warm_ours, peak, source)
    judged("P7 gpukit automatic settings, MFU", None if mfu is None else 100 * mfu, "% MFU", ">= 40% MFU on H100/H200",
           None if mfu is None or not goal_applies else mfu >= 0.40,
           f"precision {session.precision.name}; {t_ours / t_plain:.3f}x plain torch compiled's step time")  # type: ignore[attr-defined]


def main() -> None:
    guarded("P7 eager", p7_eager)
    if DRY:
        emit("P7 automatic settings", "skip", detail="dry run: torch.compile on the CPU takes too long for the suite")
    else:
        guarded("P7 automatic settings", p7_auto)


if __name__ == "__main__":
    main()
