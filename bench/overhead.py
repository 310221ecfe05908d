"""Session overhead: median step time of gpukit.Session vs a plain PyTorch loop.

Both loops train their own copy of the same model on the same batches; their steps are
interleaved one by one (plain, session, plain, ...) so machine noise hits both alike. A step
is: fetch the batch (and put it on the device), forward, loss, backward, optimizer step, zero
grad. Run on the CPU (an MLP and a small CNN) and on the first GPU when there is one.

    python bench/overhead.py [--steps 300] [--warmup 30]
    python bench/overhead.py --peers [--steps 2000] [--epochs 10] [--wall]   # vs Fabric and Accelerate

``--peers`` (bench/_peers.py) reports microseconds per step and per batch for gpukit, Lightning
Fabric and Accelerate side by side (``pip install 'gpukit[bench]'`` installs the peers).

Peak memory: on a GPU, the peak allocated bytes of each loop measured in separate windows
(accelerator.memory_stats); on the CPU torch does not account allocations per loop, so
none is reported there (RSS is process-wide and shared by both loops).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpukit
from gpukit._util.units import format_bytes
from gpukit.accelerators import get_accelerator


def mlp() -> tuple[nn.Module, TensorDataset, int]:
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    return model, TensorDataset(torch.randn(4096, 784), torch.randint(0, 10, (4096,))), 64


def cnn() -> tuple[nn.Module, TensorDataset, int]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )
    return model, TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,))), 32


def forever(make_iter: Callable[[], Iterator]) -> Iterator:
    while True:
        yield from make_iter()


def plain_stepper(model: nn.Module, data: TensorDataset, batch: int, device: torch.device):
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pin = device.type == "cuda"
    batches = forever(lambda: iter(DataLoader(data, batch_size=batch, shuffle=True, pin_memory=pin)))

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def session_stepper(model: nn.Module, data: TensorDataset, batch: int, device: torch.device,
                    record: str | None = None):
    """A Session step; with ``record`` (bench/record.py) it records the run and logs the loss."""
    session = gpukit.Session(devices=device, precision="32-true", verbose=False, record=record)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(data, batch_size=batch, shuffle=True, num_workers=0)
    batches = forever(lambda: iter(loader))

    def step() -> None:
        x, y = next(batches)
        with session.accumulate(model):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        session.step(optimizer)
        if record is not None:
            session.log(loss=loss.detach())

    step.session = session  # type: ignore[attr-defined]  # bench/record.py closes it
    return step


def timed(step: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def interleaved(a: Callable[[], None], b: Callable[[], None], steps: int, warmup: int,
                sync: Callable[[], None]) -> tuple[float, float]:
    """Median step times of ``a`` and ``b``, run one step each in turn (alternating which first)."""
    for _ in range(warmup):
        a()
        b()
    t_a, t_b = [], []
    for i in range(steps):
        if i % 2:
            t_a.append(timed(a, sync))
            t_b.append(timed(b, sync))
        else:
            t_b.append(timed(b, sync))
            t_a.append(timed(a, sync))
    return statistics.median(t_a), statistics.median(t_b)


def compare(name: str, build, device: torch.device, steps: int, warmup: int) -> None:
    accelerator = get_accelerator(device)
    model, data, batch = build()
    plain = plain_stepper(copy.deepcopy(model), data, batch, device)
    ours = session_stepper(copy.deepcopy(model), data, batch, device)
    sync = lambda: accelerator.synchronize(device)  # noqa: E731
    m_plain, m_ours = interleaved(plain, ours, steps, warmup, sync)
    line = (f"{name:<4} {str(device):<7} plain {m_plain * 1e3:8.3f} ms  session {m_ours * 1e3:8.3f} ms"
            f"  ratio {m_ours / m_plain:6.3f}  (overhead {100 * (m_ours / m_plain - 1):+.2f}%)")
    peaks = []
    for step in (plain, ours):
        accelerator.reset_peak_memory_stats(device)
        for _ in range(10):
            step()
        peaks.append(accelerator.memory_stats(device)["peak_allocated_bytes"])
    if peaks[0] is not None:
        line += (f"  peak plain {format_bytes(peaks[0])} session {format_bytes(peaks[1])}"
                 f" ratio {peaks[1] / max(peaks[0], 1):.3f}")
    else:
        line += "  peak memory: n/a on cpu"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--peers", action="store_true", help="per step and per batch vs Fabric and Accelerate")
    parser.add_argument("--epochs", type=int, default=10, help="--peers: epochs per loader")
    parser.add_argument("--wall", action="store_true", help="--peers: wall time instead of thread CPU time")
    args = parser.parse_args()
    if args.peers:
        import _peers

        _peers.main(args.steps if args.steps != 300 else 2000, args.epochs, args.wall)
        return
    torch.manual_seed(0)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", 0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"{args.steps} interleaved steps per loop (median)")
    for device in devices:
        for name, build in (("mlp", mlp), ("cnn", cnn)):
            compare(name, build, device, args.steps, args.warmup)


if __name__ == "__main__":
    main()
