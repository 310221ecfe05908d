"""Issue 28's everyday features, side by side: gpukit, plain torch, Accelerate and Lightning Fabric.

    python bench/side_by_side.py            # starts itself under `gpukit run --cpu --nproc 2`

Every tool runs the same small job in the same 2 gloo processes (they share one process group), the
way its documentation writes it; rank 0 prints one row per item with each tool's number. A peer that
is not installed (`pip install 'gpukit[bench]'`: accelerate 1.15, lightning 2.6) shows "n/i"; a call
that fails shows the exception's type. What the numbers mean is in each row's "measure" column;
docs/switching.md has the feature table with the tests that back gpukit's column.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit

TOOLS = ("torch", "gpukit", "accelerate", "fabric")
_NAMES = {"accelerate": "accelerate", "fabric": "lightning"}


def _cell(fn: Callable[[], Any]) -> str:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a result too
        return f"error: {type(exc).__name__}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


class Peers:
    """The peers' objects, made once per process (they share gpukit's process group)."""

    def __init__(self) -> None:
        self.fabric = self.accelerator = None
        if importlib.util.find_spec("lightning"):
            from lightning.fabric import Fabric

            self.fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
            self.fabric.launch()
        if importlib.util.find_spec("accelerate"):
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=True)


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


# -- 1: gather over an uneven dataset ---------------------------------------------------------------
def gather(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    data = TensorDataset(torch.arange(11))

    def plain() -> str:
        loader = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, shuffle=False))
        out = []
        for (idx,) in loader:
            parts = [torch.empty_like(idx) for _ in range(2)]
            dist.all_gather(parts, idx)
            out.append(torch.cat(parts))
        return _count(torch.cat(out))

    def ours() -> str:
        loader = session.setup_dataloader(data, batch_size=3)
        return _count(torch.cat([session.gather_for_metrics(idx) for (idx,) in loader]))

    def accelerate() -> str:
        a = peers.accelerator
        loader = a.prepare(DataLoader(data, batch_size=3))
        return _count(torch.cat([a.gather_for_metrics(idx) for (idx,) in loader]))

    def fabric() -> str:
        f = peers.fabric
        loader = f.setup_dataloaders(DataLoader(data, batch_size=3))
        return _count(torch.cat([f.all_gather(idx).reshape(-1) for (idx,) in loader]))

    return {"torch": _cell(plain), "gpukit": _cell(ours), "accelerate": _cell(accelerate), "fabric": _cell(fabric)}


def _count(values: torch.Tensor) -> str:
    exact = values.tolist() == list(range(11))
    return f"{values.numel()}{' (= dataset)' if exact else ''}"


# -- 3: accumulation at the loader's end -------------------------------------------------------------
class Ones(nn.Module):
    """A loss whose gradient is 1 per micro-batch whatever the data: the step's gradient then says
    what the micro-batches were divided by (1.0: their mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w.sum() + 0 * x.sum()


def accumulation(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    data = TensorDataset(torch.zeros(20, 1))  # 10 micro-batches per rank

    def run(loop: Callable[[list[float]], None]) -> str:
        grads: list[float] = []  # the gradient at each optimizer step
        loop(grads)
        return f"{len(grads)} steps, last {grads[-1]:.2f}"

    def plain(grads: list[float]) -> None:
        model = nn.parallel.DistributedDataParallel(Ones())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for i, (x,) in enumerate(DataLoader(data, batch_size=1, sampler=DistributedSampler(data, shuffle=False))):
            (model(x) / 4).backward()
            if (i + 1) % 4 == 0:
                grads.append(float(next(model.parameters()).grad))
                opt.step()
                opt.zero_grad()

    def ours(grads: list[float]) -> None:
        model = Ones()
        model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
        hook = opt.register_step_pre_hook(lambda *_: grads.append(float(next(model.parameters()).grad)))
        session.accumulate_grad_batches = 4
        for (x,) in session.setup_dataloader(data, batch_size=1):
            with session.accumulate(model):
                session.backward(model(x))
            session.step(opt)
        session.accumulate_grad_batches = 1
        hook.remove()

    def accelerate(grads: list[float]) -> None:
        from accelerate import Accelerator

        a = Accelerator(cpu=True, gradient_accumulation_steps=4)
        model = Ones()
        model, opt, loader = a.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                       DataLoader(data, batch_size=1))
        for (x,) in loader:
            with a.accumulate(model):
                a.backward(model(x))
                if a.sync_gradients:
                    grads.append(float(next(model.parameters()).grad))
                opt.step()
                opt.zero_grad()

    def fabric(grads: list[float]) -> None:
        f = peers.fabric
        model = Ones()
        model, opt = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
        for i, (x,) in enumerate(f.setup_dataloaders(DataLoader(data, batch_size=1))):
            accumulating = (i + 1) % 4 != 0  # Fabric's documented pattern
            with f.no_backward_sync(model, enabled=accumulating):
                f.backward(model(x) / 4)
            if not accumulating:
                grads.append(float(next(model.parameters()).grad))
                opt.step()
                opt.zero_grad()

    return {"torch": _cell(lambda: run(plain)), "gpukit": _cell(lambda: run(ours)),
            "accelerate": _cell(lambda: run(accelerate)), "fabric": _cell(lambda: run(fabric))}


# -- 2: gradient norm under DDP ---------------------------------------------------------------------
def grad_norm(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    g = torch.Generator().manual_seed(session.rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)

    def plain() -> float:
        model = nn.parallel.DistributedDataParallel(_linear())
        nn.functional.mse_loss(model(x), y).backward()
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))

    def ours() -> float:
        model = _linear()
        model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(opt, clip_grad_norm=0.05)
        return float(session.grad_norm)

    def accelerate() -> float:
        a = peers.accelerator
        model = _linear()
        model, opt = a.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        a.backward(nn.functional.mse_loss(model(x), y))
        return float(a.clip_grad_norm_(model.parameters(), 0.05))

    def fabric() -> float:
        f = peers.fabric
        model = _linear()
        model, opt = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        f.backward(nn.functional.mse_loss(model(x), y))
        return float(f.clip_gradients(model, opt, max_norm=0.05))

    return {"torch": _cell(plain), "gpukit": _cell(ours), "accelerate": _cell(accelerate), "fabric": _cell(fabric)}


# -- 4: schedulers ----------------------------------------------------------------------------------
def scheduler(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    """Optimizer steps the schedule counted after 10 optimizer steps (StepLR halving each step)."""
    def counted(optimizer: torch.optim.Optimizer) -> float:
        return round(-math.log2(optimizer.param_groups[0]["lr"]))

    def plain() -> float:
        opt = torch.optim.SGD(_linear().parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        for _ in range(10):
            opt.step()
            sched.step()
        return counted(opt)

    def ours() -> float:
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = session.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
        model, opt = session.setup(model, opt)
        session.accumulate_grad_batches = 2
        for _ in range(20):  # 20 micro-batches, 10 optimizer steps
            session.backward(model(torch.ones(1, 6)).sum() * 0)
            session.step(opt)
            sched.step()
        session.accumulate_grad_batches = 1
        return counted(opt)

    def accelerate() -> float:
        a = peers.accelerator
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, sched = a.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
        for _ in range(10):
            a.backward(model(torch.ones(1, 6)).sum() * 0)
            opt.step()
            sched.step()
            opt.zero_grad()
        return counted(opt)

    def fabric() -> float:
        f = peers.fabric
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt = f.setup(model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer if hasattr(opt, "optimizer") else opt, 1, 0.5)
        for _ in range(10):
            f.backward(model(torch.ones(1, 6)).sum() * 0)
            opt.step()
            sched.step()
        return counted(opt)

    return {"torch": _cell(plain), "gpukit": _cell(ours), "accelerate": _cell(accelerate), "fabric": _cell(fabric)}


# -- 5: per-rank random streams ---------------------------------------------------------------------
def streams(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    def differ(seed: Callable[[], None]) -> str:
        seed()
        drawn = torch.randint(0, 10**9, (2,))
        both = [torch.empty_like(drawn) for _ in range(2)]
        dist.all_gather(both, drawn)
        return "distinct" if not torch.equal(both[0], both[1]) else "same on every rank"

    def ours() -> None:
        s = gpukit.Session(accelerator="cpu", seed=7, seed_per_rank=True, verbose=False)
        s.setup(nn.Linear(1, 1))

    def accelerate() -> None:
        from accelerate.utils import set_seed

        set_seed(7, device_specific=True)

    return {"torch": _cell(lambda: differ(lambda: torch.manual_seed(7))), "gpukit": _cell(lambda: differ(ours)),
            "accelerate": _cell(lambda: differ(accelerate)),
            "fabric": _cell(lambda: differ(lambda: peers.fabric.seed_everything(7, verbose=False)))}


# -- 6: resume gives back the extras ----------------------------------------------------------------
def extras(session: gpukit.Session, peers: Peers, directory: Path) -> dict[str, str]:
    def ours() -> str:
        model = _linear()
        saving = gpukit.Session(accelerator="cpu", verbose=False)
        saving.save_checkpoint(directory / "gpukit", 1, extra={"best_val_loss": 0.125}, model=model)
        quiet = gpukit.Session(accelerator="cpu", verbose=False)
        quiet.resume(directory / "gpukit", model=model)
        return str(quiet.resumed.extra.get("best_val_loss"))

    def accelerate() -> str:
        a = peers.accelerator
        a.prepare(_linear())  # registered with the accelerator: save_state saves it
        a.save_state(str(directory / "accelerate"))
        return str(a.load_state(str(directory / "accelerate")))  # returns nothing; extras need an object

    def fabric() -> str:
        f = peers.fabric
        model = f.setup(_linear())
        f.save(directory / "fabric.ckpt", {"model": model, "best_val_loss": 0.125})
        rest = f.load(directory / "fabric.ckpt", {"model": model})
        return str(rest.get("best_val_loss"))

    return {"torch": "-", "gpukit": _cell(ours), "accelerate": _cell(accelerate), "fabric": _cell(fabric)}


# -- 9 and 10: Hugging Face under bf16-true, meta-device models --------------------------------------
def hf_true(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    if importlib.util.find_spec("transformers") is None:
        return dict.fromkeys(TOOLS, "n/i")
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def loss(model: nn.Module) -> str:
        return f"{float(model(input_ids=ids, labels=ids).loss):.4f}"

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    def ours() -> str:
        s = gpukit.Session(accelerator="cpu", precision="bf16-true", verbose=False)
        return loss(s.setup(llama()))

    def fabric() -> str:
        from lightning.fabric import Fabric

        f = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="bf16-true")
        f.launch()
        return loss(f.setup(llama()))

    return {"torch": _cell(lambda: loss(llama().to(torch.bfloat16))),
            "gpukit": _cell(ours), "accelerate": "-", "fabric": _cell(fabric)}


def meta(session: gpukit.Session, peers: Peers) -> dict[str, str]:
    def built() -> nn.Module:
        with torch.device("meta"):
            return _linear()

    def trains(model: nn.Module, backward: Callable[[torch.Tensor], None]) -> str:
        backward(model(torch.ones(2, 6)).pow(2).mean())
        params = list(model.parameters())
        return "trains" if all(torch.isfinite(p.grad).all() for p in params) else "not finite"

    return {"torch": _cell(lambda: trains(nn.parallel.DistributedDataParallel(built()), lambda l: l.backward())),
            "gpukit": _cell(lambda: trains(session.setup(built()), session.backward)),
            "accelerate": _cell(lambda: trains(peers.accelerator.prepare(built()), peers.accelerator.backward)),
            "fabric": _cell(lambda: trains(peers.fabric.setup(built()), peers.fabric.backward))}


ROWS = [  # accumulation last: Accelerate's gradient state is one per process, its k stays set
    ("1 gather_for_metrics", "samples back from 11 over 2 ranks (batch 3)", gather),
    ("2 gradient norm", "total norm, DDP, 2 ranks", grad_norm),
    ("4 scheduler", "steps counted by StepLR after 10 optimizer steps", scheduler),
    ("5 per-rank streams", "torch.randint after seeding with 7", streams),
    ("6 resume extras", "best_val_loss given back by the resume", None),
    ("9 HF bf16-true", "model(**batch).loss of a tiny Llama", hf_true),
    ("10 meta-device model", "set up from torch.device('meta')", meta),
    ("3 accumulation", "10 micro-batches, k=4: steps, last step's gradient (1.00 = mean)", accumulation),
]


def worker(directory: Path) -> None:
    warnings.filterwarnings("ignore")
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False)
    peers = Peers()
    rows = []
    for name, measure, fn in ROWS:
        cells = extras(session, peers, directory) if fn is None else fn(session, peers)
        for tool, module in _NAMES.items():
            if importlib.util.find_spec(module) is None:
                cells[tool] = "n/i"
        rows.append((name, measure, cells))
    if session.is_main:
        widths = [22, 62, *[max(10, *(len(r[2][t]) for r in rows)) for t in TOOLS]]
        head = ["item", "measure", *TOOLS]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for name, measure, cells in rows:
            print("  ".join(c.ljust(w) for c, w in zip([name, measure, *(cells[t] for t in TOOLS)], widths)))
    session.close()


def main() -> None:
    if "--worker" in sys.argv:
        worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
        return
    with tempfile.TemporaryDirectory() as directory:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", __file__, "--worker", directory]
        raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
