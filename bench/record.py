"""Run-record overhead: median step time of a Session loop recording vs the same loop not recording.

Both loops are gpukit Sessions training their own copy of the same model on the same data;
the recording one has ``record=DIR`` and logs its loss with ``session.log(loss=loss)``
(per-step timings, the loss, system samples every second on a background thread, TensorBoard
forwarding when installed); the other is bench/overhead.py's Session loop as it is. Steps are interleaved one by
one, alternating which goes first, so machine noise hits both alike. Also prints the record's
size per step.

    python bench/record.py [--steps 600] [--warmup 30]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from overhead import cnn, interleaved, mlp, session_stepper  # noqa: E402  (the Session bench's models and loop)

from gpukit.accelerators import get_accelerator  # noqa: E402
from gpukit.monitor import tensorboard_available  # noqa: E402


def compare(name: str, build, device: torch.device, steps: int, warmup: int, directory: Path) -> None:
    accelerator = get_accelerator(device)
    model, data, batch = build()
    plain = session_stepper(copy.deepcopy(model), data, batch, device)
    rec = session_stepper(copy.deepcopy(model), data, batch, device, record=str(directory / name))
    m_plain, m_rec = interleaved(plain, rec, steps, warmup, lambda: accelerator.synchronize(device))
    plain.session.close()
    rec.session.close()
    size = (directory / name / "rank0.jsonl").stat().st_size
    print(f"{name:<4} {str(device):<7} not recording {m_plain * 1e3:8.3f} ms  recording {m_rec * 1e3:8.3f} ms"
          f"  ratio {m_rec / m_plain:6.3f}  (overhead {100 * (m_rec / m_plain - 1):+.2f}%)"
          f"  record {size / (steps + warmup):.0f} B/step", flush=True)


def per_step_cpu(steps: int, per_flush: int) -> None:
    """CPU time per step of the recorder itself, from thread CPU clocks (robust on a busy machine):
    what the loop pays (``session.log`` + the step listener) and what the writer thread pays."""
    from gpukit.data._timing import StepTiming
    from gpukit.monitor import Recorder

    timings = [StepTiming(step=i, epoch=0, rank=0, samples=64, step_time_s=0.003, data_wait_s=0.0002,
                          h2d_s=None, compute_s=0.0028, exact=True) for i in range(steps)]
    losses = [torch.tensor(float(i)) for i in range(steps)]
    for tensorboard in ([None, "auto"] if tensorboard_available() else [None]):
        with tempfile.TemporaryDirectory() as tmp:
            recorder = Recorder(tmp, sample_interval_s=3600.0, tensorboard=tensorboard)
            loop_s = writer_s = 0.0
            for start in range(0, steps, per_flush):
                t0 = time.thread_time()
                for i in range(start, min(steps, start + per_flush)):
                    recorder.log(loss=losses[i])
                    recorder.on_step(timings[i])
                t1 = time.thread_time()
                recorder.flush()  # what the sampler thread does once per interval
                t2 = time.thread_time()
                loop_s, writer_s = loop_s + t1 - t0, writer_s + t2 - t1
            recorder.close()
        print(f"recorder CPU per step{' (with TensorBoard)' if tensorboard else ''}: in the loop "
              f"{loop_s / steps * 1e6:.1f} us, writer thread {writer_s / steps * 1e6:.1f} us "
              f"({steps} steps, flushed every {per_flush})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--cpu-only", action="store_true", help="only the per-step CPU cost, not the loops")
    args = parser.parse_args()
    torch.manual_seed(0)
    per_step_cpu(20_000, per_flush=300)  # ~300 steps per one-second flush: a 3 ms step
    if args.cpu_only:
        return
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {args.steps} interleaved steps "
          f"per loop (median); TensorBoard forwarding {'on' if tensorboard_available() else 'off (not installed)'}")
    with tempfile.TemporaryDirectory() as tmp:
        for device in devices:
            for name, build in (("mlp", mlp), ("cnn", cnn)):
                compare(name, build, device, args.steps, args.warmup, Path(tmp) / str(device).replace(":", ""))


if __name__ == "__main__":
    main()
