"""gpu-check part `speed`: the GPU figures bench/RESULTS.md lacks, each measured side by side.

P6  host->device copies from pinned vs pageable memory, against the PCIe link's peak (NVML).
P1  per-step overhead of a Session over the plain loop (goal: <= 1.01x), with a CUDA sync after every step
    (bench/overhead.py's interleaved loops, MLP and CNN), then a cProfile of Session steps: the
    top functions by own time, so an overhead has a name.
P5  the seed tutorials' plain loop (fp32, num_workers=0, no pinning, blocking copies) against
    the same model under the automatic settings (Session(precision="auto") and whatever it turns
    on by itself, num_workers="tune"; goal: >= 3x), on a dataset whose items
    cost CPU work: samples/s for a fixed time each.
(P7, MFU of GPT-2 small, is the part `mfu`.)
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

from _common import DRY, device, emit, guarded, judged, sync


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
        ratio = t_ours / t_plain
        judged(f"P1 {name} per-step time, Session / plain", ratio, "x", "<= 1.01x plain torch", ratio <= 1.01,
               f"+{(t_ours - t_plain) * 1e6:.0f} us per step: plain {t_plain * 1e3:.3f} ms, session "
               f"{t_ours * 1e3:.3f} ms ({steps} interleaved steps each, a sync after every step)")
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
    emit("P5 plain loop", "info", plain, "samples/s", "the tutorial loop: fp32, num_workers=0, no pinning")
    emit("P5 Session(auto) + tuned loader", "info", ours, "samples/s",
         f"precision {session.precision.name}, tuning {tune_s:.1f} s, "
         f"loader num_workers={tuned.loader.num_workers}, pin_memory={tuned.loader.pin_memory}, "
         f"prefetch_factor={tuned.loader.prefetch_factor}")
    judged("P5 automatic settings / tutorial loop", ours / plain, "x", ">= 3x the tutorial loop", ours / plain >= 3.0,
           f"{ours:,.0f} against {plain:,.0f} samples/s, {seconds:g} s each")


def main() -> None:
    guarded("P6 copies", p6_copies)
    guarded("P1 overhead", p1_overhead)
    guarded("P5 plain vs session", p5_plain_vs_session)


if __name__ == "__main__":
    main()
