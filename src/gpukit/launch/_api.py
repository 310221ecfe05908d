"""launch_function / launch_script: validate, claim devices, run the workers, release.

Settings reach the workers as environment variables (documented in docs/readme/run.md):
``GPUKIT_RUN_ID``, ``GPUKIT_LAUNCHER_PID``, ``GPUKIT_GRACE_S``, ``GPUKIT_CPU`` and
``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER``, next to everything torchrun sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...).
``GPUKIT_MAX_NPROC`` raises the cap on workers per node (default: 4 per CPU core, at least 8).
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import signal
import sys
import uuid
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from typing import Any

from gpukit._util.cpu import usable_cpu_count
from gpukit._util.envvars import GRACE_ENV, MAX_NPROC_ENV, RUN_ID_ENV
from gpukit._util.timeouts import parse_timeout_s
from gpukit.cluster import announce, check_max_requeues, environment
from gpukit.errors import ConfigurationError
from gpukit.launch._elastic import run_workers
from gpukit.launch._gpus import DevicePlan, GpuRequest, plan_devices
from gpukit.launch._notebook import check_fork, needs_fork
from gpukit.launch._signals import RunInterruptedError, StopSignal, held_signals_raise, raise_if_held
from gpukit.launch._topology import Topology, check_topology, node_topology, scheduler_gpu_count
from gpukit.worker import (
    WorkerEnv,
    max_requeues_from_env,
    parse_preempt_signal,
    requeue_after_preemption,
    run_forked_function,
    run_function,
)
from gpukit.worker import preempt_signal as default_preempt_signal

__all__ = ["launch_function", "launch_script", "GRACE_ENV", "RUN_ID_ENV", "MAX_NPROC_ENV", "DEFAULT_GRACE_S"]

DEFAULT_GRACE_S = 10.0

Echo = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def _check_run_settings(nproc: int | None, max_restarts: int, grace_s: float) -> None:
    if nproc is not None:
        _check_int("nproc (--nproc)", nproc, 1)
        _check_nproc_cap(nproc)
    _check_int("max_restarts (--max-restarts)", max_restarts, 0)
    if (not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or not math.isfinite(grace_s)
            or grace_s < 0):
        raise ConfigurationError(f"grace_s (--grace) must be a finite number of seconds >= 0, got {grace_s!r}.")


def _check_nproc_cap(nproc: int) -> None:
    """Refuse a worker count no machine runs well (``--nproc 100000`` would fork until the OS gives out)."""
    cores = os.cpu_count() or 1
    try:
        cap = int(os.environ.get(MAX_NPROC_ENV) or max(8, 4 * cores))
    except ValueError:
        raise ConfigurationError(f"{MAX_NPROC_ENV}={os.environ[MAX_NPROC_ENV]!r}: give a whole number of "
                                 "worker processes.") from None
    if nproc > cap:
        raise ConfigurationError(
            f"nproc (--nproc) {nproc} is more worker processes than this machine runs well: it has {cores} "
            f"CPU core(s) and the cap is {cap} (4 per core, at least 8). Use fewer, spread the job over "
            f"machines (--nnodes), or raise the cap with {MAX_NPROC_ENV}={nproc} if you mean it."
        )


def _check_target(target: str, module: bool) -> None:
    if module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigurationError(
                f"Module {target!r} not found (searched the current directory and sys.path). "
                "Give an importable module after -m, or a script path without -m."
            )
    elif not os.path.isfile(target):
        raise ConfigurationError(
            f"Script {target!r} not found (relative to {os.getcwd()}). Give the path of a Python "
            "file, or -m package.module to run a module."
        )


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise ConfigurationError(
            f"launch_function({name}): workers are started fresh (spawn) and cannot see functions defined "
            "in an interactive session, notebook or `python -c`. Put the function in a .py module and import it."
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing here
        raise ConfigurationError(
            f"launch_function({name}): the function must be importable by worker processes, which are "
            f"started fresh (spawn), but it cannot be pickled ({type(exc).__name__}: {exc}). Define it at "
            "module level -- not a lambda, nested function or bound method of an unpicklable object."
        ) from exc
    try:
        pickle.dumps(args)
    except Exception as exc:  # noqa: BLE001
        raise ConfigurationError(
            f"launch_function({name}): its args must be picklable to reach the workers, but "
            f"{type(exc).__name__}: {exc}."
        ) from exc


def _worker_env(plan: DevicePlan, *, grace_s: float, run_id: str, timeout_s: float | None = None,
                preempt: signal.Signals | None = None, max_requeues: int | None = None) -> WorkerEnv:
    """What every worker of this run is told (the run's directory is added by ``run_workers``)."""
    return WorkerEnv(
        run_id=run_id, launcher_pid=os.getpid(), grace_s=grace_s, cpu=plan.cpu,
        # the workers' collective timeout (a Session reads it)
        timeout_s=None if timeout_s is None else parse_timeout_s(timeout_s, "timeout_s (--timeout)"),
        preempt_signal=preempt, max_requeues=max_requeues,
    )


def _process_env(plan: DevicePlan, nproc: int) -> dict[str, str]:
    """The other variables the workers get: the claimed GPUs, and their share of the CPU."""
    env = dict(plan.env)
    if "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun: N workers each using every core would oversubscribe the CPU. The
        # affinity mask, not the machine's count: SLURM (--cpus-per-task) or a container limits it.
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpu_count() // nproc))
    return env


def _announce(echo: Echo | None, plan: DevicePlan, nproc: int, topology: Topology) -> None:
    if echo is None:
        return
    where = "" if topology.nnodes == 1 else f" (node {topology.node_rank} of {topology.nnodes})"
    echo(f"gpukit: {nproc} worker process{'es' if nproc != 1 else ''} on this node{where}")
    for line in plan.mapping.splitlines():
        echo(f"gpukit: {line}")


def launch_function(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nproc: int,
    cpu: bool = False,
    gpus: GpuRequest | int | str | Sequence[int | str] | None = None,
    max_restarts: int = 0,
    grace_s: float = DEFAULT_GRACE_S,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    wait: bool = False,
    wait_timeout_s: float | None = None,
    verbose: bool = False,
    echo: Echo | None = _stderr,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` worker processes on this machine, as torchrun would.

    Each worker has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (a free port: launches side by side never collide), so
    ``torch.distributed.init_process_group()`` works inside ``fn`` with no arguments.

    Args:
        fn: A module-level function (workers are started with spawn and import it). In a
            notebook, REPL or ``python -c``, a function (or args) defined there is run in
            workers forked from this process instead (refused with the reason where fork
            cannot work: no fork on the platform, or CUDA initialised here for GPU workers).
        args: Picklable positional arguments for ``fn`` (any, when forked).
        nproc: Number of worker processes.
        cpu: Run on the CPU (gloo); GPUs are hidden from the workers.
        gpus: ``None`` (``nproc`` GPUs if the machine has any, else CPU), a count,
            ``"all"``, or GPU indices/UUIDs. Claimed for the launch's duration.
        max_restarts: Restart the whole group this many times after a failure.
        grace_s: Seconds between SIGTERM and SIGKILL when workers are stopped.
        min_free_memory, max_utilization, wait, wait_timeout_s: GPU selection (see
            ``gpukit.devices.claim_gpus``).
        verbose: Keep torch elastic's log lines.
        echo: Where the device mapping is printed (default stderr; ``None``: silent).

    Returns:
        ``fn``'s return value of each rank, by rank.

    Raises:
        ConfigurationError: bad arguments, or ``fn``/``args`` that workers cannot unpickle.
        GpuSelectionError: the GPUs asked for are not there or not free.
        WorkerFailedError: (a ``LaunchError``) a worker raised or died; names the rank and error.
        RunInterruptedError: (a ``LaunchError``) this process got Ctrl-C/SIGTERM meanwhile.
    """
    _check_run_settings(nproc, max_restarts, grace_s)
    fork = needs_fork(fn, args)  # defined in a notebook: workers are forked from it (see _notebook.py)
    if not fork:
        _check_picklable(fn, args)
    topology = Topology()
    plan = plan_devices(GpuRequest.of(gpus), cpu=cpu, nproc=nproc, min_free_memory=min_free_memory,
                        max_utilization=max_utilization, wait=wait, wait_timeout_s=wait_timeout_s)
    try:
        if fork:
            check_fork(f"launch_function({getattr(fn, '__qualname__', fn)!r})", uses_gpus=plan.gpu_count > 0)
        _announce(echo, plan, nproc, topology)
        run_id = f"gpukit-{uuid.uuid4().hex[:12]}"
        plan.label_claim(run_id, nproc, topology.node_rank)
        values = run_workers(
            run_forked_function if fork else run_function, (fn, *args), nproc=nproc, topology=topology,
            env=_process_env(plan, nproc), worker=_worker_env(plan, grace_s=grace_s, run_id=run_id), run_id=run_id,
            max_restarts=max_restarts, grace_s=grace_s, verbose=verbose, start_method="fork" if fork else "spawn",
        )
    finally:
        plan.release()
    return [values[rank] for rank in sorted(values)]


def launch_script(
    target: str,
    script_args: Sequence[str] = (),
    *,
    module: bool = False,
    nproc: int | None = None,
    cpu: bool = False,
    gpus: GpuRequest | int | str | Sequence[int | str] | None = None,
    max_restarts: int = 0,
    grace_s: float = DEFAULT_GRACE_S,
    topology: Topology | None = None,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    wait: bool = False,
    wait_timeout_s: float | None = None,
    verbose: bool = False,
    echo: Echo | None = _stderr,
    preempt_signal: str | None = None,
    max_requeues: int | None = None,
    timeout_s: float | None = None,
) -> None:
    """Run a script (or ``-m`` module) in worker processes -- what ``gpukit run`` does.

    Args:
        target: Path of the script, or the module name when ``module`` is true.
        script_args: The script's own arguments.
        module: Run ``target`` as ``python -m target``.
        nproc: Workers on this node; default the number of GPUs claimed, or 1.
        topology: Nodes and rendezvous (default: from SLURM/Kubernetes, else this machine only).
        preempt_signal: The scheduler's preemption warning, ``"USR2"`` (default, or
            ``GPUKIT_PREEMPT_SIGNAL``), ``"USR1"`` or ``"TERM"``: it stops the run like SIGTERM,
            and under SLURM node 0 then requeues the job (``scontrol requeue``).
        max_requeues: Requeue only while ``SLURM_RESTART_COUNT`` is below this (default 10,
            or ``GPUKIT_MAX_REQUEUES``).
        timeout_s: The workers' collective timeout (``GPUKIT_TIMEOUT_S``; a positive finite
            number of seconds; default: a Session's 1800). A rank that stops calling collectives
            is named (with its stack) after min(60, timeout_s / 2) s; the timeout ends the run.
        Other args: as for :func:`launch_function`.

    Raises:
        ConfigurationError: bad arguments or a missing script/module.
        GpuSelectionError: the GPUs asked for are not there or not free.
        WorkerFailedError: a worker failed; ``exit_code`` is what ``gpukit run`` exits with.
        RunInterruptedError: Ctrl-C/SIGTERM; ``exit_code`` is 75 when preempted cleanly.
        LaunchError: the rendezvous failed (unreachable master, nodes missing).
    """
    topology = topology or node_topology()
    _check_run_settings(nproc, max_restarts, grace_s)
    check_topology(topology)
    _check_target(target, module)
    if timeout_s is not None:
        parse_timeout_s(timeout_s, "timeout_s (--timeout)")  # before any GPU is claimed
    preempt = parse_preempt_signal(preempt_signal) if preempt_signal else default_preempt_signal()
    limit = max_requeues_from_env() if max_requeues is None else check_max_requeues(max_requeues)
    cluster = environment()
    if echo is not None:
        announce(cluster, under_gpukit=WorkerEnv.from_env().launcher_pid is not None)  # a launch inside a worker
    request = GpuRequest.of(gpus)
    if request.automatic and nproc is None and not cpu:
        request = GpuRequest.of(scheduler_gpu_count(cluster))  # every GPU SLURM gave this node, and no other
    try:
        # a stop held since the CLI started is acted on here, and when run_workers installs the
        # launcher's handlers (after its imports): stop before any worker starts, exit 75
        raise_if_held()
        _launch_script_workers(target, script_args, module=module, nproc=nproc, cpu=cpu, gpus=request,
                               max_restarts=max_restarts, grace_s=grace_s, topology=topology,
                               min_free_memory=min_free_memory, max_utilization=max_utilization,
                               wait=wait, wait_timeout_s=wait_timeout_s, verbose=verbose, echo=echo,
                               preempt=preempt, limit=limit, timeout_s=timeout_s)
    except StopSignal as exc:  # before any worker started: nothing to save
        interrupted = RunInterruptedError(exc.signum, preempted=True, grace_s=grace_s,
                                          detail="no worker had started yet, nothing to save")
        _requeue_if_preempted(interrupted, preempt, limit, cluster, echo)
        raise interrupted from None
    except RunInterruptedError as exc:
        _requeue_if_preempted(exc, preempt, limit, cluster, echo)
        raise


def _requeue_if_preempted(exc: RunInterruptedError, preempt: Any, limit: int, cluster: Any,
                          echo: Echo | None) -> None:
    # The preemption warning reached this node's launcher or (node 0 heard from them) another
    # node's: node 0 requeues -- also when a worker did not stop cleanly (it resumes from its
    # last complete checkpoint); a requeued job is never worse than a job lost from the queue.
    if preempt.name == exc.signal_name or preempt.name in exc.other_signals:
        requeue_after_preemption(preempt.name, preempt, max_requeues=limit, env=cluster, echo=echo)


def _launch_script_workers(target: str, script_args: Sequence[str], *, module: bool, nproc: int | None,
                           cpu: bool, gpus: GpuRequest, max_restarts: int, grace_s: float, topology: Topology,
                           min_free_memory: int | str | None, max_utilization: float | None, wait: bool,
                           wait_timeout_s: float | None, verbose: bool, echo: Echo | None, preempt: Any,
                           limit: int, timeout_s: float | None) -> None:
    with held_signals_raise() if wait else nullcontext():  # a stop while waiting for GPUs ends the wait
        plan = plan_devices(gpus, cpu=cpu, nproc=nproc, min_free_memory=min_free_memory,
                            max_utilization=max_utilization, wait=wait, wait_timeout_s=wait_timeout_s)
    try:
        workers = nproc or max(1, plan.gpu_count)
        _announce(echo, plan, workers, topology)
        run_id = f"gpukit-{uuid.uuid4().hex[:12]}" if topology.single_machine else f"gpukit-{topology.master_port}"
        plan.label_claim(run_id, workers, topology.node_rank)
        command = ("-u", "-m", "gpukit.worker._bootstrap", *(("-m",) if module else ()), target, *script_args)
        worker = _worker_env(plan, grace_s=grace_s, run_id=run_id, timeout_s=timeout_s, preempt=preempt,
                             max_requeues=limit)
        run_workers(
            sys.executable, command, nproc=workers, topology=topology, env=_process_env(plan, workers),
            worker=worker, run_id=run_id,
            max_restarts=max_restarts, grace_s=grace_s, verbose=verbose, preempt_signal=preempt,
        )
    finally:
        plan.release()
