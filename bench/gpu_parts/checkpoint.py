"""gpu-check part `checkpoint`: checkpoints of CUDA tensors, resumed on the GPU and loaded without one.

1. A Session on cuda:0 trains two Adam steps and saves; a fresh Session resumes: weights and
   optimizer state bit-identical. 2. `gpukit.save` of a CUDA model, then in a process where CUDA
   is hidden (CUDA_VISIBLE_DEVICES=""): plain `torch.load` raises the classic "Attempting to
   deserialize object on a CUDA device" (the trap), `gpukit.load` returns CPU tensors equal to
   the saved ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from _common import DRY, ROOT, device, emit, guarded

CHILD = """
import json, sys, torch, gpukit
path = sys.argv[1]
out = {"cuda": torch.cuda.is_available()}
try:
    torch.load(path, weights_only=True)
    out["torch_load"] = "loaded"
except Exception as exc:
    out["torch_load"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:160]
state = gpukit.load(path)
out["gpukit_devices"] = sorted({str(t.device) for t in state.values()})
out["sum"] = float(sum(t.double().sum() for t in state.values()))
print(json.dumps(out))
"""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(session, model, optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 32, device=device())
        session.run_step(lambda b: model(b).float().pow(2).mean(), x)
        session.step(optimizer)


def resume_on_gpu(folder: Path) -> None:
    import gpukit

    session = gpukit.Session(devices=device(), precision="32-true", verbose=False)
    model = _model()
    model, optimizer = session.setup(model, torch.optim.Adam(model.parameters()))
    _train(session, model, optimizer, 2)
    session.save_checkpoint(folder, step=2, model=model, optimizer=optimizer)
    fresh = gpukit.Session(devices=device(), precision="32-true", verbose=False)
    model2 = _model()
    optimizer2 = torch.optim.Adam(model2.parameters())
    model2, optimizer2 = fresh.setup(model2, optimizer2)
    step = fresh.resume(folder, model=model2, optimizer=optimizer2)
    same_w = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    s1, s2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    same_o = all(torch.equal(s1[k][n], s2[k][n]) for k in s1 for n in ("exp_avg", "exp_avg_sq"))
    where = {str(p.device) for p in model2.parameters()}
    emit("resume on the GPU", "ok" if step == 2 and same_w and same_o else "fail",
         detail=f"step {step}, weights equal {same_w}, Adam state equal {same_o}, on {sorted(where)}")


def load_without_cuda(folder: Path) -> None:
    import gpukit

    model = _model().to(device())
    path = gpukit.save(model, folder / "model.pt")
    expected = float(sum(t.double().sum() for t in model.state_dict().values()))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env, timeout=120)
    print(proc.stdout, proc.stderr[-2000:], flush=True)
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    trap = "deserialize object on a CUDA device" in said["torch_load"]
    emit("plain torch.load without CUDA", "ok" if DRY or trap else "fail", detail=said["torch_load"])
    good = said["gpukit_devices"] == ["cpu"] and abs(said["sum"] - expected) < 1e-9
    emit("gpukit.load without CUDA", "ok" if good else "fail", detail=f"devices {said['gpukit_devices']}, "
         f"sum {said['sum']:.6f} vs {expected:.6f}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-ckpt-") as tmp:
        guarded("resume on the GPU", resume_on_gpu, Path(tmp) / "ckpt")
        guarded("load without CUDA", load_without_cuda, Path(tmp))


if __name__ == "__main__":
    main()
