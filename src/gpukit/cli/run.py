"""``gpukit run``: start a script on the best free GPUs (or the CPU), one process or many."""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

import click

from gpukit.cli._common import (
    MAX_NPROC,
    WAIT_NO_LIMIT,
    FiniteFloatRange,
    HostName,
    Name,
    NonEmptyPath,
    parse_size_option,
    parse_wait_seconds,
)
from gpukit.cluster import MAX_HOSTS
from gpukit.errors import ConfigurationError

__all__ = ["run"]

#: how long `gpukit run` waits for the master address to resolve before calling it unknown
RESOLVE_TIMEOUT_S = 5.0
_DURATION = re.compile(r"^\d+(\.\d+)?\s*[a-zA-Z]+$")  # 10m, 2h, 30s: what --wait is often given


class NodeCount(click.ParamType):
    """``--nnodes``: ``N`` nodes, or ``MIN:MAX`` (elastic: the job goes on with as few as MIN); gives ``(min, max)``."""

    name = "N|MIN:MAX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        low, sep, high = text.partition(":")
        try:
            most = int(high if sep else low)
            fewest = int(low) if sep else most
        except ValueError:
            self.fail(f"{text[:40]!r}: give a number of nodes (2) or a range MIN:MAX (1:2).", param, ctx)
        if not 1 <= fewest <= most <= MAX_HOSTS:
            self.fail(f"{text[:40]!r}: give 1 <= MIN <= MAX <= {MAX_HOSTS} (e.g. 1:2).", param, ctx)
        return fewest, most


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


class _RunCommand(click.Command):
    """Our options come first; the script (or ``-m MODULE``) and everything after it are the job's.

    ``--wait`` takes an optional TIMEOUT, so a bare ``--wait`` must not swallow the script name.
    An unknown option before the script is an error, not a script called ``--bogus``.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        options = {name: param for param in self.get_params(ctx) if isinstance(param, click.Option)
                   for name in (*param.opts, *param.secondary_opts)}
        out: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            name, has_value, _ = token.partition("=")
            if token == "--" or not token.startswith("-") or token == "-":
                out.extend(["--", *args[i + (token == "--"):]])  # the script and its own arguments
                break
            if name == "--wait" and not has_value:
                following = args[i + 1] if i + 1 < len(args) else None
                if following is not None and _is_number(following):
                    out.extend(args[i : i + 2])
                    i += 2
                    continue
                if following is not None and _DURATION.match(following) and not os.path.exists(following):
                    raise click.BadParameter(
                        f"{following!r} is not a number of seconds: give --wait 600 for 10 minutes, "
                        "or --wait alone to wait without limit.", ctx=ctx, param_hint="'--wait'")
                out.append(f"--wait={WAIT_NO_LIMIT}")
                i += 1
                continue
            param = options.get(name)
            if param is None:
                raise click.NoSuchOption(name, possibilities=sorted(n for n in options if n.startswith("--")),
                                         ctx=ctx)
            takes_value = not param.is_flag and not has_value
            out.extend(args[i : i + 1 + takes_value])
            i += 1 + takes_value
            if param.name == "module":  # -m MODULE: the rest are the module's arguments
                out.extend(["--", *args[i:]])
                break
        return super().parse_args(ctx, out)


def _wait_timeout(value: str | None) -> tuple[bool, float | None]:
    if value is None:
        return False, None
    seconds = parse_wait_seconds(value)
    return True, None if math.isinf(seconds) else seconds


def _check_master_resolves(topology: Any, given: str | None) -> None:
    """A master address that does not resolve is an error now, not a rendezvous timeout later."""
    from gpukit.cluster import resolve_host

    if topology.single_machine or not topology.master_addr:
        return
    if resolve_host(str(topology.master_addr), RESOLVE_TIMEOUT_S) is None:
        source = "--master-addr" if given else "the master address (MASTER_ADDR or the scheduler's first node)"
        raise ConfigurationError(
            f"{source} {topology.master_addr!r} does not resolve to an address (looked up for at most "
            f"{RESOLVE_TIMEOUT_S:g} s): give node 0's IP address or a host name every node resolves "
            "(check /etc/hosts and DNS).")


@click.command(
    cls=_RunCommand,
    short_help="Run a script on the best free GPUs (or the CPU), like torchrun.",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--gpus", metavar="N|all|LIST", help="How many GPUs (best free first), 'all', or which: 1,3 (one by index: 3,; by UUID: GPU-1a2b...).")
@click.option("--min-free", "min_free", metavar="SIZE", help="Only GPUs with this much free memory, e.g. 8GiB.")
@click.option("--max-util", "max_util", type=FiniteFloatRange(0, 100, unit="percent"), metavar="PCT", help="Only GPUs at most this busy (%).")
@click.option("--wait", "wait", metavar="[TIMEOUT]", help="Wait in the fair queue (up to TIMEOUT seconds) for GPUs to become free.")
@click.option("--share", is_flag=True, help="Also take GPUs other users' processes are using (by default such a GPU is busy).")
@click.option("--nproc", type=click.IntRange(1, MAX_NPROC), help="Worker processes on this node [default: number of GPUs, or 1].")
@click.option("--cpu", is_flag=True, help="Run on the CPU with gloo (how DDP is tried without GPUs).")
@click.option("--max-restarts", type=click.IntRange(0, 10_000), default=0, show_default=True, help="Restart the workers after a failure.")
@click.option("--grace", type=FiniteFloatRange(min=0), default=10.0, show_default=True, metavar="SECONDS", help="Seconds from SIGTERM to SIGKILL when stopping.")
@click.option("--nnodes", type=NodeCount(), help="Machines taking part, or MIN:MAX: go on with as few as MIN when nodes die, grow again when they return [default: from SLURM/Kubernetes, else 1].")
@click.option("--node-rank", type=click.IntRange(0, MAX_HOSTS - 1), help="This machine's number; node 0 hosts the rendezvous [default: from SLURM/Kubernetes, else 0].")
@click.option("--master-addr", type=HostName(), metavar="ADDR", help="Address of node 0 (several machines) [default: SLURM's first node].")
@click.option("--master-port", type=click.IntRange(1, 65535), help="Rendezvous port on node 0 [default: 15000 + SLURM job id % 20000, else 29500].")
@click.option("--local-addr", type=HostName(), metavar="ADDR", help="This node's address as others reach it [default: the route to the master].")
@click.option("--rdzv-timeout", type=FiniteFloatRange(min=0, min_open=True), default=300.0, show_default=True, metavar="SECONDS", help="Wait this long for the master and the other nodes.")
@click.option("--timeout", "timeout", type=FiniteFloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Collective timeout of the workers' Sessions (GPUKIT_TIMEOUT_S) [default: 1800]; a rank "
                   "that stalls is named with its stack after min(60, SECONDS/2).")
@click.option("--signal", "preempt_signal", type=Name("USR2", max_chars=16), metavar="USR2|USR1|TERM",
              help="The scheduler's preemption warning (#SBATCH --signal=B:USR2@90): workers save and stop, "
                   "then the SLURM job is requeued [default: GPUKIT_PREEMPT_SIGNAL, else USR2].")
@click.option("--max-requeues", type=click.IntRange(0, 1_000_000), metavar="N",
              help="Requeue a preempted SLURM job only while SLURM_RESTART_COUNT < N [default: GPUKIT_MAX_REQUEUES, "
                   "else 10].")
@click.option("-m", "--module", type=Name("pkg.train", pattern=r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$"),
              metavar="MODULE", help="Run a module (python -m MODULE) instead of a script.")
@click.option("-v", "--verbose", is_flag=True, help="Show torch elastic's own log lines.")
@click.option("--record", "record", metavar="DIR", type=NonEmptyPath(file_okay=False),
              help="Record the run (step times, session.log scalars, GPU figures) in DIR for `gpukit report DIR`.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def run(
    gpus: str | None,
    min_free: str | None,
    max_util: float | None,
    wait: str | None,
    share: bool,
    nproc: int | None,
    cpu: bool,
    max_restarts: int,
    grace: float,
    nnodes: tuple[int, int] | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    local_addr: str | None,
    rdzv_timeout: float,
    timeout: float | None,
    preempt_signal: str | None,
    max_requeues: int | None,
    module: str | None,
    verbose: bool,
    record: str | None,
    command: tuple[str, ...],
) -> None:
    """Run SCRIPT [ARGS]... (or -m MODULE [ARGS]...) in worker processes, as torchrun would.

    Workers get RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port) and
    CUDA_VISIBLE_DEVICES of the claimed GPUs. SIGTERM: SIGTERM to every worker, Ctrl-C:
    SIGINT; SIGKILL after --grace.

    Under SLURM (`srun gpukit run`) or in a Kubernetes PyTorchJob pod, the node
    flags come from the scheduler.

    \b
    Exit code: 0 success; the failed worker's code; 75 preempted (stopped by
    SIGTERM or the --signal and every worker exited cleanly: requeue -- under
    SLURM node 0 has already requeued the job); 130 Ctrl-C; 128+N killed by signal N
    (137: a worker was SIGKILLed, e.g. by the OOM killer); 124 a rank
    stalled and the collective timeout ended the run; 2 bad input.
    """
    from gpukit.launch import (
        GpuRequest, LaunchSpec, RunInterruptedError, WorkerFailedError, launch_script, node_topology,
    )
    from gpukit.worker import parse_preempt_signal

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
    min_nodes = nnodes[0] if nnodes is not None and nnodes[0] < nnodes[1] else None  # elastic
    topology = node_topology(nnodes=None if nnodes is None else nnodes[1], node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                             local_addr=local_addr, rdzv_timeout_s=rdzv_timeout)
    _check_master_resolves(topology, master_addr)
    spec = LaunchSpec(
        nproc=nproc,
        cpu=cpu,
        gpus=GpuRequest() if gpus is None else GpuRequest.parse(gpus),  # parsed here, once
        min_free_memory=parse_size_option("--min-free", min_free),
        max_utilization=max_util,
        wait=waiting,
        wait_timeout_s=wait_timeout_s,
        share_gpus=share,
        max_restarts=max_restarts,
        min_nodes=min_nodes,
        grace_s=grace,
        topology=topology,
        timeout_s=timeout,
        preempt_signal=None if preempt_signal is None else parse_preempt_signal(preempt_signal),
        max_requeues=max_requeues,
        record_dir=record,  # every worker's Session records there (GPUKIT_RECORD_DIR)
        verbose=verbose,
    )
    try:
        launch_script(target, script_args, spec, module=module is not None,
                      echo=lambda line: click.echo(line, err=True))
        if record is not None:
            click.echo(f"gpukit: run recorded in {record}; see it with: gpukit report {record}", err=True)
    except WorkerFailedError as exc:
        click.echo(f"gpukit: {exc}", err=True)
        sys.exit(exc.exit_code)
    except RunInterruptedError as exc:
        click.echo(f"gpukit: {exc}", err=True)
        sys.exit(exc.exit_code)
