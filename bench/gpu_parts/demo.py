"""gpu-check part `demo`: `gpukit demo` on the GPU through its own API, then the CLI once.

Expected on a GPU with bf16: precision bf16-mixed chosen by itself, test accuracy >= 95% after 5
epochs, the reloaded plain model identical.
"""

from __future__ import annotations

import tempfile

from _common import DRY, emit, gpukit_cli, guarded


def api() -> None:
    import torch

    from gpukit.demo import DemoConfig, run_demo

    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as out:
        sizes = {"epochs": 1, "batch_size": 256} if DRY else {"epochs": 5}  # dry: one epoch in 6 steps
        result = run_demo(DemoConfig(**sizes, out_dir=out, record=True), cpu=DRY)
    bf16 = not DRY and torch.cuda.is_bf16_supported()
    expected = "bf16-mixed" if bf16 else None
    emit("device", "ok" if DRY or result.device.startswith("cuda") else "fail", detail=f"{result.device}, {result.strategy}")
    emit("precision chosen", "ok" if expected in (None, result.precision) else "fail", detail=result.precision)
    emit("test accuracy", "ok" if DRY or result.test_accuracy >= 0.95 else "fail", 100 * result.test_accuracy, "%")
    emit("reloaded identical", "ok" if result.reloaded_accuracy == result.test_accuracy else "fail",
         100 * result.reloaded_accuracy, "%")
    emit("throughput", "info", result.samples_per_s, "samples/s", f"{result.train_time_s:.1f} s of training")
    emit("peak memory", "info", (result.peak_memory_bytes or 0) / 2**20, "MiB", result.peak_memory_kind)


def cli() -> None:
    if DRY:  # the suite runs `gpukit demo --cpu` in its own tests
        emit("gpukit demo (CLI)", "skip", detail="dry run")
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-demo-") as out:
        proc = gpukit_cli("demo", "--out-dir", out, "--epochs", "1", timeout_s=120)
    emit("gpukit demo (CLI)", "ok" if proc.returncode == 0 and "test accuracy" in proc.stdout else "fail",
         detail=f"exit {proc.returncode}")


def main() -> None:
    guarded("demo API", api)
    guarded("demo CLI", cli)


if __name__ == "__main__":
    main()
