"""``gpukit demo``: train the built-in example and show what gpukit measured."""

from __future__ import annotations

import click

from gpukit._util.units import format_bytes
from gpukit.cli._common import MAX_BATCH, MAX_SEED

__all__ = ["demo"]


@click.command(short_help="Train the built-in example (digits CNN) and show what was measured.")
@click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True, help="Training epochs.")
@click.option("--batch-size", type=click.IntRange(1, MAX_BATCH), default=64, show_default=True, help="Batch size per process.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes: more than 1 runs DDP through gpukit run's launcher.")
@click.option("--cpu", is_flag=True, help="Train on the CPU (gloo for DDP) even if GPUs are present.")
@click.option("--precision", default="auto", show_default=True,
              help="32-true, bf16-mixed, 16-mixed, bf16-true, 16-true or auto.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True)
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="Where the checkpoint, run record and report go (default: a new folder per run, "
                   "gpukit-demo-USER-XXXX in the temp dir). A folder used before gets this run added to its record.")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Record the run in OUT_DIR/record and write its HTML report.")
def demo(epochs: int, batch_size: int, nproc: int, cpu: bool, precision: str, seed: int,
         out_dir: str | None, record: bool) -> None:
    """Train a small CNN on scikit-learn's 8x8 digits, save it, reload it into a plain model."""
    from rich.console import Console
    from rich.table import Table

    from gpukit.demo import DemoConfig, run_demo

    options = dict(epochs=epochs, batch_size=batch_size, precision=precision, seed=seed, record=record)
    config = DemoConfig(**options, out_dir=out_dir)
    result = run_demo(config, nproc=nproc, cpu=cpu)

    table = Table(title="gpukit demo: digits CNN", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    throughput = "n/a" if result.samples_per_s is None else f"{result.samples_per_s:,.0f} samples/s"
    processes = "1 process" if result.world_size == 1 else f"{result.world_size} processes"
    epochs = "1 epoch" if result.epochs == 1 else f"{result.epochs} epochs"
    rows = [
        ("device", f"{result.device} x {processes}, strategy {result.strategy}"),
        ("precision", result.precision),
        ("training", f"{epochs} over {result.train_samples:,} samples in {result.train_time_s:.1f} s"),
        ("throughput", throughput),
        ("peak memory" + (" (rank 0)" if result.world_size > 1 else ""),
         f"{format_bytes(result.peak_memory_bytes)}, {result.peak_memory_kind}"),
        ("test accuracy", f"{result.test_accuracy:.2%}"),
        ("checkpoint", result.checkpoint_path),
        ("reloaded into a plain model", f"test accuracy {result.reloaded_accuracy:.2%}"
         + (" (identical)" if result.reloaded_accuracy == result.test_accuracy else " (DIFFERS)")),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    if result.record_dir is not None:
        from gpukit.report import write_report

        click.echo(f"report: {write_report(result.record_dir)} (from the run record in {result.record_dir})")
