"""gpu-check part `syncs`: a whole Session epoch under ``torch.cuda.set_sync_debug_mode("error")``.

The loop is the user's and makes no synchronisation of its own (no ``.item()``, no printing of a
loss), so any error is gpukit's: the result names the first frame in gpukit that synchronised.
A first epoch runs normally (allocations, the FLOP count, the loader's first pinned buffers); the
second runs under "error". When it fails, a third runs under "warn" to count the synchronisations
per step. In a dry run the CPU has no CUDA synchronisation to catch: the epochs run, nothing is judged.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from _common import DRY, ROOT, device, emit, guarded, judged

STEPS, BATCH = (6, 8) if DRY else (200, 256)
GOAL = "0 synchronisations in gpukit's code in a steady epoch"


def _session_loop():
    import gpukit

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, 256), torch.randint(0, 10, (STEPS * BATCH,)))
    session = gpukit.Session(devices=device(), precision="32-true" if DRY else "bf16-mixed", verbose=False)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    model, opt = session.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = session.setup_dataloader(data, batch_size=BATCH, shuffle=True)

    def epoch() -> int:
        steps = 0
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step(opt)
            steps += 1
        return steps

    return session, epoch


def _gpukit_frame(exc: BaseException) -> str:
    """The innermost frame of this checkout's gpukit in the traceback: who synchronised."""
    src = str(ROOT / "src" / "gpukit")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(src)]
    if not frames:
        return "no gpukit frame (the user's loop or torch itself)"
    f = frames[-1]
    return f"{Path(f.filename).relative_to(ROOT / 'src')}:{f.lineno} in {f.name}: {f.line}"


def sync_debug_epoch() -> None:
    session, epoch = _session_loop()
    warm = epoch()
    set_mode = getattr(torch.cuda, "set_sync_debug_mode", None)
    if DRY:
        emit("syncs: a Session epoch", "info", epoch(), "steps",
             f"dry run: {warm} + the same steps ran on the CPU; no CUDA synchronisation to catch here", goal=GOAL)
        return
    if set_mode is None:
        emit("syncs: a Session epoch under sync debug", "skip", detail=f"torch {torch.__version__} has no "
             "torch.cuda.set_sync_debug_mode")
        return
    set_mode("error")
    try:
        steps = epoch()
    except RuntimeError as exc:
        set_mode("default")
        where = _gpukit_frame(exc)
        judged("syncs: a Session epoch under sync debug 'error'", None, None, GOAL, False,
               f"{str(exc).splitlines()[0][:160]} -- at {where}")
        _count_syncs(set_mode, epoch)
        return
    finally:
        set_mode("default")
    judged("syncs: a Session epoch under sync debug 'error'", steps, "steps", GOAL, True,
           f"{steps} steps, the loader's pinned copies, the optimizer and the epoch's end passed ({session.precision.name})")


def _count_syncs(set_mode, epoch) -> None:
    """Under "warn": how many synchronisations a steady epoch makes, per step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            steps = epoch()
        finally:
            set_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    emit("syncs: synchronisations per steady step (sync debug 'warn')", "info", len(syncs) / max(1, steps), "per step",
         f"{len(syncs)} in {steps} steps")


def main() -> None:
    guarded("syncs", sync_debug_epoch)


if __name__ == "__main__":
    main()
