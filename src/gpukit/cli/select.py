"""``gpukit select``: print the best GPUs for a job, in a form the shell can use.

``select`` only selects (skipping GPUs that other processes have claimed, GPUs reserved for jobs
waiting in the queue, and GPUs other users' processes use unless ``--share``); it does not claim,
because a claim held by this short-lived command would end the moment it exits. To hold GPUs
for a job's lifetime, use ``gpukit run`` or ``gpukit.devices.claim_gpus`` in the job itself.
"""

from __future__ import annotations

import math

import click

from gpukit.cli._common import MAX_NPROC, WAIT_NO_LIMIT, FiniteFloatRange, parse_size_option, parse_wait_seconds

__all__ = ["select"]

_FORMATS = ("indices", "uuids", "env")


@click.command("select")
@click.option("-n", "--count", type=click.IntRange(1, MAX_NPROC), default=1, show_default=True, help="How many GPUs.")
@click.option("--min-free", metavar="SIZE", default=None,
              help="Least free memory per GPU: 8GiB, 8000MiB, 8G, or bytes.")
@click.option("--max-util", metavar="PCT", type=FiniteFloatRange(0, 100, unit="percent"), default=None,
              help="Highest GPU utilization in percent.")
@click.option("--max-procs", metavar="N", type=click.IntRange(0, 1 << 20), default=None,
              help="Most processes already on a GPU (0: idle GPUs only).")
@click.option("--exclude", metavar="LIST", default="", help="Comma-separated GPU indices or UUID prefixes to skip.")
@click.option("--order", type=click.Choice(["free-memory", "utilization", "index"]), default="free-memory",
              show_default=True, help="Ranking; ties go to lower utilization, fewer processes, lower index.")
@click.option("--wait", "wait", metavar="[TIMEOUT]", is_flag=False, flag_value=WAIT_NO_LIMIT, default=None,
              help="Wait until enough GPUs qualify; TIMEOUT in seconds (no value: no limit).")
@click.option("--share", is_flag=True,
              help="Also choose GPUs other users' processes are using (by default such a GPU is busy).")
@click.option("--format", "fmt", type=click.Choice(_FORMATS), default="indices", show_default=True,
              help="indices: 3,0   uuids: GPU-…,GPU-…   env: CUDA_VISIBLE_DEVICES=3,0")
def select(count: int, min_free: str | None, max_util: float | None, max_procs: int | None, exclude: str,
           order: str, wait: str | None, share: bool, fmt: str) -> None:
    """Choose GPUs for a job and print them, best first.

    Indices are nvidia-smi's (PCI bus order). Only the choice goes to stdout, so it composes:

        CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$(gpukit select -n 2 --min-free 8GiB) python train.py

    Exits with status 2 and a message naming each GPU and the criterion it failed when the
    request cannot be met.
    """
    from gpukit.devices import select_gpus, silence_notice

    silence_notice()  # the selection error says "no GPU" itself
    timeout = None if wait is None else parse_wait_seconds(wait)
    chosen = select_gpus(
        count,
        min_free_memory=parse_size_option("--min-free", min_free),
        max_utilization=max_util,
        max_processes=max_procs,
        exclude=[item.strip() for item in exclude.split(",") if item.strip()],
        order=order,
        share=share,
        wait=wait is not None,
        timeout_s=None if timeout is None or math.isinf(timeout) else timeout,
    )
    from gpukit._util.text import printable  # a UUID comes from the driver (or a fake spec): never an escape

    if fmt == "uuids":
        click.echo(printable(",".join(g.uuid or "" for g in chosen)))
        return
    # MIG devices have no index of their own: CUDA_VISIBLE_DEVICES names them by MIG UUID.
    ids = printable(",".join(g.uuid or "" if g.is_mig else str(g.index) for g in chosen))
    click.echo(f"CUDA_VISIBLE_DEVICES={ids}" if fmt == "env" else ids)
