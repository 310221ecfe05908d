"""``gpukit report DIR``: the HTML report of a run record, and its replay into TensorBoard."""

from __future__ import annotations

import click

__all__ = ["report"]


@click.command(short_help="Write the HTML report of a run record (and replay it into TensorBoard).")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="The HTML file to write [default: DIR/report.html].")
@click.option("--tensorboard", "tensorboard", type=click.Path(file_okay=False), default=None, metavar="OUT",
              help="Also replay the record into TensorBoard event files under OUT (needs `tensorboard`).")
def report(directory: str, out: str | None, tensorboard: str | None) -> None:
    """Write one self-contained HTML file (no network needed) with the run's summary and plots:
    loss and logged scalars, step time split into data / copy / compute, throughput, GPU
    utilization and memory, per rank, with a straggler rank named. DIR is what
    Session(record=DIR) or `gpukit run --record DIR` wrote; a run still in progress works.
    """
    from gpukit.report import replay_to_tensorboard, write_report

    path = write_report(directory, out)
    click.echo(f"report: {path}")
    if tensorboard is not None:
        written = replay_to_tensorboard(directory, tensorboard)
        click.echo(f"tensorboard: {len(written)} rank(s) under {tensorboard} (tensorboard --logdir {tensorboard})")
