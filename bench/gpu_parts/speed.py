"""gpu-check part `speed`: the GPU figures bench/RESULTS.md lacks, each measured side by side.

P6  host->device copies from pinned vs pageable memory, against the PCIe link's peak (NVML).
P1  per-step overhead of a Session over the plain loop, with a CUDA sync after every step
    (bench/overhead.py's interleaved loops, MLP and CNN), then a cProfile of Session steps: the
    top functions by own time, so an overhead has a name.
P5  the seed tutorials' plain loop (fp32, num_workers=0, no pinning, blocking copies) against
    the same model under Session(precision="auto") with a tuned loader, on a dataset whose items
    cost CPU work: samples/s for a fixed time each.
P7  model FLOPs utilisation of a GPT-2-small-sized training step (124 M parameters, 1024 tokens,
    bf16-mixed, AdamW), eager and torch.compile'd, against the data sheet's bf16 peak.
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import time

import torch
from torch import nn
from torch.nn import functional as F

from _common import DRY, device, emit, guarded, sync


def p6_copies() -> None:
    from gpukit.devices._health import gpu_health
    from gpukit.doctor._gpu_probe import measure_copies

    copies = measure_copies(device(), (4 if DRY else 256) * 2**20, reps=3 if DRY else 10)
    peak = None if DRY else gpu_health(0).link_peak_gbps()  # one GPU lent: NVML index 0 is cuda:0
    share = "" if peak is None else f", {copies['h2d_pinned_gbps'] / peak:.0%} of the link's {peak:.1f} GB/s"
    emit("P6 h2d pinned", "info", copies["h2d_pinned_gbps"], "GB/s", f"link peak {peak}" + share)
    emit("P6 h2d pageable", "info", copies["h2d_pageable_gbps"], "GB/s",
         f"pinned/pageable {copies['h2d_pinned_gbps'] / copies['h2d_pageable_gbps']:.2f}x")
    emit("P6 d2h pinned", "info", copies["d2h_pinned_gbps"], "GB/s")


def p1_overhead() -> None:
    import overhead

    dev = device()
    steps, warmup = (4, 1) if DRY else (400, 40)
    for name, build in (("mlp", overhead.mlp), ("cnn", overhead.cnn)):
        model, data, batch = build()
        plain = overhead.plain_stepper(copy.deepcopy(model), data, batch, dev)
        ours = overhead.session_stepper(copy.deepcopy(model), data, batch, dev)
        t_plain, t_ours = overhead.interleaved(plain, ours, steps, warmup, sync)
        emit(f"P1 {name} per-step overhead", "info", (t_ours - t_plain) * 1e6, "us",
             f"plain {t_plain * 1e3:.3f} ms, session {t_ours * 1e3:.3f} ms, ratio {t_ours / t_plain:.3f}")
        if name == "mlp":
            _profile("session", ours)
            _profile("plain", plain)
            _without_copy_events(overhead, model, data, batch, dev, steps, warmup)


def _without_copy_events(overhead, model, data, batch, dev, steps: int, warmup: int) -> None:
    """The same comparison with the Session's lazy copy timing off (no CUDA events): its share."""
    from gpukit.accelerators import CUDAAccelerator

    original = CUDAAccelerator.timing_event
    CUDAAccelerator.timing_event = lambda self: None  # type: ignore[method-assign]
    try:
        plain = overhead.plain_stepper(copy.deepcopy(model), data, batch, dev)
        ours = overhead.session_stepper(copy.deepcopy(model), data, batch, dev)
        t_plain, t_ours = overhead.interleaved(plain, ours, steps, warmup, sync)
    finally:
        CUDAAccelerator.timing_event = original  # type: ignore[method-assign]
    emit("P1 mlp per-step overhead, no copy events", "info", (t_ours - t_plain) * 1e6, "us",
         f"plain {t_plain * 1e3:.3f} ms, session {t_ours * 1e3:.3f} ms, ratio {t_ours / t_plain:.3f}")


PROFILED = 5 if DRY else 300


def _profile(label: str, step) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILED):
        step()
        sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(f"--- cProfile of {PROFILED} {label} steps (mlp), by own time ---\n{text.getvalue()}", flush=True)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:6]
    emit(f"P1 profile {label}", "info", detail="; ".join(
        f"{fn[2]} ({fn[0].rsplit('/', 2)[-1]}:{fn[1]}) {s[2] * 1e6 / PROFILED:.0f} us/step"
        for fn, s in top))


class Augmented(torch.utils.data.Dataset):
    """32x32 images with a random crop and flip made on the CPU per item, like a seed tutorial's transforms."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 40, 40), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        y, x = (i * 7) % 8, (i * 13) % 8
        img = self.images[i, :, y:y + 32, x:x + 32].float().div_(255)
        if i % 2:
            img = img.flip(-1)
        return (img - 0.5) / 0.25, self.labels[i]


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(256, 10))


def _samples_per_s(batches, step, seconds: float) -> float:
    done, start, warm = 0, None, 3
    while True:
        for i, (x, y) in enumerate(batches()):
            step(x, y)
            if i == warm and start is None:
                sync()
                start, done = time.perf_counter(), 0
            elif start is not None:
                done += len(x)
                if time.perf_counter() - start >= seconds:
                    sync()
                    return done / (time.perf_counter() - start)


def p5_plain_vs_session() -> None:
    import gpukit

    data = Augmented(2048 if DRY else 20000)
    seconds, batch = (0.2, 16) if DRY else (8.0, 256)
    dev = device()
    model = _cnn().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=0)

    def plain_step(x, y):
        x, y = x.to(dev), y.to(dev)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    plain = _samples_per_s(lambda: loader, plain_step, seconds)
    session = gpukit.Session(devices=dev, precision="auto", verbose=False)
    model2 = _cnn()
    model2, opt2 = session.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9))
    started = time.perf_counter()
    tuned = session.setup_dataloader(data, batch_size=batch, shuffle=True, num_workers="tune")
    tune_s = time.perf_counter() - started

    def session_step(x, y):
        session.run_step(lambda b: F.cross_entropy(model2(b[0]), b[1]), (x, y))
        session.step(opt2)

    ours = _samples_per_s(lambda: tuned, session_step, seconds)
    emit("P5 plain loop", "info", plain, "samples/s", "fp32, num_workers=0, no pinning")
    emit("P5 Session(auto) + tuned loader", "info", ours, "samples/s",
         f"{ours / plain:.2f}x the plain loop; precision {session.precision.name}, tuning {tune_s:.1f} s, "
         f"loader num_workers={tuned.loader.num_workers}, pin_memory={tuned.loader.pin_memory}, "
         f"prefetch_factor={tuned.loader.prefetch_factor}")


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

    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def p7_plain() -> None:
    """The same GPT step in plain torch (autocast bf16, AdamW): the row P7's Session figures sit beside."""
    layers, width, heads, vocab, context, batch = (2, 64, 4, 512, 32, 2) if DRY else (12, 768, 12, 50304, 1024, 8)
    torch.manual_seed(0)
    model = GPT(layers, width, heads, vocab, context).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, vocab, (batch, context + 1), generator=torch.Generator().manual_seed(0)).to(device())
    x, y = idx[:, :-1], idx[:, 1:]
    kind = "cpu" if DRY else "cuda"

    def step() -> None:
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _report_mfu("plain torch eager", model, step, layers, width, batch, context)


def _report_mfu(label: str, model: nn.Module, step, layers: int, width: int, batch: int, context: int) -> None:
    from gpukit.devices import dense_peak

    inner = getattr(model, "_orig_mod", model)
    n_params = sum(p.numel() for p in inner.parameters()) - inner.pos.weight.numel()
    started = time.perf_counter()
    for _ in range(2 if DRY else 3):  # warm-up (compiles here)
        step()
    sync()
    warm_s = time.perf_counter() - started
    reps = 3 if DRY else 15
    started = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    step_s = (time.perf_counter() - started) / reps
    # PaLM's count: 6 N per token for the weights, 12 L d T per token for attention scores/values
    flops = batch * context * (6 * n_params + 12 * layers * width * context)
    tflops = flops / step_s / 1e12
    found = None if DRY else dense_peak(torch.cuda.get_device_name(0), "bf16")
    peak = None if found is None else found.tflops
    emit(f"P7 MFU GPT-2 small {label}", "info", None if peak is None else 100 * tflops / peak, "% of peak",
         f"{tflops:.0f} TFLOP/s, {step_s * 1e3:.1f} ms/step ({batch}x{context} tokens, {n_params / 1e6:.0f} M params), "
         f"warm-up {warm_s:.1f} s, peak {peak}")


def p7_mfu(compiled: bool) -> None:
    import gpukit

    layers, width, heads, vocab, context, batch = (2, 64, 4, 512, 32, 2) if DRY else (12, 768, 12, 50304, 1024, 8)
    torch.manual_seed(0)
    model = GPT(layers, width, heads, vocab, context)
    session = gpukit.Session(devices=device(), precision="bf16-mixed", compile=compiled or None, verbose=False)
    model, opt = session.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, context + 1), generator=g).to(device())
    x, y = idx[:, :-1], idx[:, 1:]

    def step() -> None:
        session.run_step(lambda b: F.cross_entropy(model(b[0]).flatten(0, 1).float(), b[1].flatten()), (x, y))
        session.step(opt)

    _report_mfu("compiled" if compiled else "eager", model, step, layers, width, batch, context)


def main() -> None:
    guarded("P6 copies", p6_copies)
    guarded("P1 overhead", p1_overhead)
    guarded("P5 plain vs session", p5_plain_vs_session)
    guarded("P7 plain", p7_plain)
    guarded("P7 eager", p7_mfu, False)
    if DRY:
        emit("P7 compiled", "skip", detail="dry run: torch.compile on the CPU takes too long for the suite")
    else:
        guarded("P7 compiled", p7_mfu, True)


if __name__ == "__main__":
    main()
