"""``gpukit run``: start a script on the best free GPUs (or the CPU), one process or many."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpukit._units import parse_size

__all__ = ["run"]

# Options that take a value: their value is never the script.
_VALUE_OPTIONS = {
    "--gpus", "--min-free", "--max-util", "--nproc", "--max-restarts", "--grace", "--nnodes",
    "--node-rank", "--master-addr", "--master-port", "--local-addr", "--rdzv-timeout", "-m", "--module",
}
_WAIT_FOREVER = "forever"


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


class _RunCommand(click.Command):
    """``--wait`` takes an optional TIMEOUT; a bare ``--wait`` must not swallow the script name."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--wait" and not (i + 1 < len(args) and _is_number(args[i + 1])):
                out.append(f"--wait={_WAIT_FOREVER}")
            elif (token in _VALUE_OPTIONS or token == "--wait") and i + 1 < len(args):
                out.extend(args[i : i + 2])
                i += 1
            elif not token.startswith("-") or token == "--":
                out.extend(args[i:])  # the script and its own arguments: not ours
                break
            else:
                out.append(token)
            i += 1
        return super().parse_args(ctx, out)


def _wait_timeout(value: str | None) -> tuple[bool, float | None]:
    if value is None:
        return False, None
    if value == _WAIT_FOREVER:
        return True, None
    try:
        seconds = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number of seconds.", param_hint="--wait") from None
    if seconds < 0:
        raise click.BadParameter(f"{value!r}: a timeout cannot be negative.", param_hint="--wait")
    return True, seconds


@click.command(
    cls=_RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--gpus", metavar="N|all|LIST", help="How many GPUs (best free first), 'all', or which: 1,3 (one by index: 3,).")
@click.option("--min-free", "min_free", metavar="SIZE", help="Only GPUs with this much free memory, e.g. 8GiB.")
@click.option("--max-util", "max_util", type=float, metavar="PCT", help="Only GPUs at most this busy (%).")
@click.option("--wait", "wait", metavar="[TIMEOUT]", help="Wait (up to TIMEOUT seconds) for GPUs to become free.")
@click.option("--nproc", type=int, help="Worker processes on this node [default: number of GPUs, or 1].")
@click.option("--cpu", is_flag=True, help="Run on the CPU with gloo (how DDP is tried without GPUs).")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="Restart the workers after a failure.")
@click.option("--grace", type=float, default=10.0, show_default=True, metavar="SECONDS", help="Seconds from SIGTERM to SIGKILL when stopping.")
@click.option("--nnodes", type=int, default=1, show_default=True, help="Machines taking part.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This machine's number; node 0 hosts the rendezvous.")
@click.option("--master-addr", metavar="ADDR", help="Address of node 0 (several machines).")
@click.option("--master-port", type=int, default=29500, show_default=True, help="Rendezvous port on node 0 (several machines).")
@click.option("--local-addr", metavar="ADDR", help="This node's address as others reach it [default: the route to the master].")
@click.option("--rdzv-timeout", type=float, default=300.0, show_default=True, metavar="SECONDS", help="Wait this long for the master and the other nodes.")
@click.option("-m", "--module", metavar="MODULE", help="Run a module (python -m MODULE) instead of a script.")
@click.option("-v", "--verbose", is_flag=True, help="Show torch elastic's own log lines.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def run(
    gpus: str | None,
    min_free: str | None,
    max_util: float | None,
    wait: str | None,
    nproc: int | None,
    cpu: bool,
    max_restarts: int,
    grace: float,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int,
    local_addr: str | None,
    rdzv_timeout: float,
    module: str | None,
    verbose: bool,
    command: tuple[str, ...],
) -> None:
    """Run SCRIPT [ARGS]... (or -m MODULE [ARGS]...) in worker processes, as torchrun would.

    \b
    Workers get RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port) and
    CUDA_VISIBLE_DEVICES of the claimed GPUs. Ctrl-C/SIGTERM: SIGTERM to every worker,
    SIGKILL after --grace. Exit code: 0; the failed worker's code; 75 when preempted
    (stopped by SIGTERM and every worker exited cleanly); 128+N when killed by signal N.
    """
    from gpukit.launch import RunInterruptedError, Topology, WorkerFailedError, launch_script, parse_gpu_request

    args = list(command)
    if args and args[0] == "--":
        args = args[1:]
    if module:
        target, script_args = module, args
    elif args:
        target, script_args = args[0], args[1:]
    else:
        raise click.UsageError("Give the script to run (gpukit run [OPTIONS] SCRIPT [ARGS]...) or -m MODULE.")
    waiting, wait_timeout_s = _wait_timeout(wait)
    options: dict[str, Any] = {
        "module": module is not None,
        "nproc": nproc,
        "cpu": cpu,
        "gpus": parse_gpu_request(gpus) if gpus is not None else None,
        "max_restarts": max_restarts,
        "grace_s": grace,
        "topology": Topology(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                             master_port=master_port, local_addr=local_addr, rdzv_timeout_s=rdzv_timeout),
        "min_free_memory": parse_size(min_free) if min_free is not None else None,
        "max_utilization": max_util,
        "wait": waiting,
        "wait_timeout_s": wait_timeout_s,
        "verbose": verbose,
        "echo": lambda line: click.echo(line, err=True),
    }
    try:
        launch_script(target, script_args, **options)
    except WorkerFailedError as exc:
        click.echo(f"gpukit: {exc}", err=True)
        sys.exit(exc.exit_code)
    except RunInterruptedError as exc:
        click.echo(f"gpukit: {exc}", err=True)
        sys.exit(exc.exit_code)
