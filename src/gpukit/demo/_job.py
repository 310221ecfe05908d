"""The demo job: train, evaluate, save, reload into a plain model, report."""

from __future__ import annotations

import getpass
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.demo._data import load_digits_split
from gpukit.demo._model import DigitsCNN
from gpukit.errors import ConfigurationError

__all__ = ["DemoConfig", "DemoResult", "fresh_out_dir", "run_demo", "train_worker"]


def fresh_out_dir() -> str:
    """A new directory for one demo run: ``<tmp>/gpukit-demo-<user>-<random>``, mode 0700.

    Per user and per run, so two demos -- of one user or of several on a shared machine --
    never write into, or clean up, each other's files.
    """
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no name for this uid (containers): the uid will do
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    user = re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:32] or "user"
    return tempfile.mkdtemp(prefix=f"gpukit-demo-{user}-")


def _with_out_dir(config: DemoConfig) -> DemoConfig:
    return config if config.out_dir is not None else replace(config, out_dir=fresh_out_dir())


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run (all picklable: they travel to worker processes)."""

    epochs: int = 5
    batch_size: int = 64
    learning_rate: float = 2e-3
    seed: int = 0
    precision: str = "auto"
    accelerator: str = "auto"
    out_dir: str | None = None  # None: a new private directory per run (see fresh_out_dir)
    record: bool = True  # write a run record in <out_dir>/record (for `gpukit report`)

    @property
    def record_dir(self) -> str | None:
        if self.out_dir is None:
            raise ConfigurationError("DemoConfig.out_dir is not chosen yet: run_demo makes a fresh one.")
        return os.path.join(self.out_dir, "record") if self.record else None

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"demo {name} must be a positive integer, got {value!r}.")
        if not self.learning_rate > 0:
            raise ConfigurationError(f"demo learning_rate must be > 0, got {self.learning_rate!r}.")


@dataclass(frozen=True)
class DemoResult:
    """What one demo run measured (rank 0's view; accuracy is over the whole test set)."""

    device: str
    strategy: str
    precision: str
    world_size: int
    epochs: int
    train_samples: int
    test_accuracy: float
    reloaded_accuracy: float
    samples_per_s: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    train_time_s: float
    checkpoint_path: str
    record_dir: str | None = None


@torch.no_grad()
def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    predictions = model(images.to(device)).argmax(dim=1).cpu()
    model.train(was_training)
    return float((predictions == labels).float().mean())


def _peak_memory(session: Any) -> tuple[int | None, str]:
    stats = session.accelerator.memory_stats(session.device)
    if stats.get("peak_allocated_bytes") is not None:
        return stats["peak_allocated_bytes"], "peak allocated by torch on the GPU"
    return stats.get("process_rss_bytes"), "process resident memory (CPU run)"


def train_worker(config: DemoConfig) -> DemoResult:
    """Train the digits CNN in this process; under a launcher, as one DDP rank."""
    import gpukit

    config = _with_out_dir(config)
    from gpukit.monitor import Throughput

    session = gpukit.Session(precision=config.precision, seed=config.seed, accelerator=config.accelerator,
                             record=config.record_dir)
    train_set, test_set = load_digits_split(seed=config.seed)
    test_images, test_labels = test_set.tensors

    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(train_set, batch_size=config.batch_size, shuffle=True)
    loss_fn = nn.CrossEntropyLoss()
    # The first epoch's first steps pay one-off costs (allocator, autotuning, workers).
    meter = Throughput(warmup_steps=min(3, len(loader) - 1))

    session.accelerator.reset_peak_memory_stats(session.device)
    start_s = time.perf_counter()
    for epoch in range(config.epochs):
        running_loss = torch.zeros((), device=session.device)
        for images, labels in session.progress(loader, description=f"epoch {epoch + 1}/{config.epochs}"):
            with session.accumulate(model):
                with session.autocast():
                    loss = loss_fn(model(images), labels)
                session.backward(loss)
            session.step(optimizer)
            running_loss += loss.detach()  # detached: keeps no graph alive between steps
            session.log(loss=loss)  # into the run record, converted off the loop (no GPU sync)
            meter.update(len(labels) * session.world_size)
        mean_loss = float(session.all_reduce(running_loss / len(loader), op="mean"))
        accuracy = _accuracy(gpukit.unwrap_model(model), test_images, test_labels)
        session.print(f"epoch {epoch + 1}: train loss {mean_loss:.4f}, test accuracy {accuracy:.2%}")
    session.accelerator.synchronize(session.device)
    train_time_s = time.perf_counter() - start_s

    accuracy = _accuracy(gpukit.unwrap_model(model), test_images, test_labels)
    peak_bytes, peak_kind = _peak_memory(session)

    # Portable checkpoint: saved unwrapped (no "module." prefix), loaded on the CPU into a
    # plain model built from scratch, as a user on another machine would.
    path = Path(config.out_dir) / "digits-cnn.pt"
    gpukit.save({"model": model, "test_accuracy": accuracy, "config": asdict(config)}, path)
    session.log_event("checkpoint", path=str(path), epochs=config.epochs)  # gpukit.save does not record
    session.barrier()
    restored = gpukit.load(path, map_location="cpu")
    plain = DigitsCNN()
    gpukit.load_state_dict(plain, restored["model"])
    reloaded_accuracy = _accuracy(plain, test_images, test_labels)

    result = DemoResult(
        device=str(session.device),
        strategy=session.strategy.name,
        precision=session.precision.name,
        world_size=session.world_size,
        epochs=config.epochs,
        train_samples=len(train_set),
        test_accuracy=accuracy,
        reloaded_accuracy=reloaded_accuracy,
        samples_per_s=meter.samples_per_s,
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        train_time_s=train_time_s,
        checkpoint_path=str(path),
        record_dir=config.record_dir,
    )
    session.close()
    return result


def run_demo(config: DemoConfig, *, nproc: int = 1, cpu: bool = False) -> DemoResult:
    """Run the demo in this process (``nproc == 1``) or as ``nproc`` DDP workers.

    Writes to ``config.out_dir``, or to a new private directory (:func:`fresh_out_dir`).

    Returns:
        Rank 0's result.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigurationError(f"--nproc must be a positive integer, got {nproc!r}.")
    if cpu:
        config = replace(config, accelerator="cpu")
    config = _with_out_dir(config)  # chosen here, once, so that every worker writes to the same one
    # Nothing is deleted: an --out-dir used before gets this run appended to its record (the
    # report shows each run on its own), and its checkpoint replaced atomically.
    if nproc == 1:
        return train_worker(config)
    from gpukit.launch import LaunchSpec, launch_function

    results = launch_function(train_worker, (config,), LaunchSpec(nproc=nproc, cpu=cpu))
    return results[0]
