"""launch_function / launch_script: validate, claim devices, run the workers, release.

Both take a :class:`~gpukit.launch.LaunchSpec` (or its fields as keywords). What the workers are
told crosses as ``gpukit.worker.WorkerEnv`` (``GPUKIT_RUN_ID``, ``GPUKIT_LAUNCHER_PID``,
``GPUKIT_GRACE_S``, ``GPUKIT_CPU``, ...; README.md documents them), next to
``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` and everything torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, cast

from gpukit._util.cpu import usable_cpu_count
from gpukit._util.envvars import GRACE_ENV, MAX_NPROC_ENV, RUN_ID_ENV
from gpukit.cluster import ClusterEnvironment, announce, environment
from gpukit.errors import ConfigurationError
from gpukit.launch._elastic import run_workers
from gpukit.launch._gpu_request import GpuRequest
from gpukit.launch._gpus import DevicePlan, plan_devices
from gpukit.launch._notebook import check_fork, is_interactive, needs_fork
from gpukit.launch._signals import RunInterruptedError, StopSignal, held_signals_raise, raise_if_held
from gpukit.launch._spec import DEFAULT_GRACE_S, LaunchSpec, spec_from
from gpukit.launch._topology import Topology, check_topology, node_topology, scheduler_gpu_count
from gpukit.worker import (
    WorkerEnv,
    main_imported_by_gpukit,
    max_requeues_from_env,
    preempt_signal,
    requeue_after_preemption,
    run_forked_function,
    run_function,
    worker_env,
)

__all__ = ["launch_function", "launch_script", "GRACE_ENV", "RUN_ID_ENV", "MAX_NPROC_ENV", "DEFAULT_GRACE_S"]

Echo = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
        if os.path.exists(target):  # a folder, a FIFO, a device: there is something, but no script
            kind = "a directory" if os.path.isdir(target) else "not a regular file (a FIFO, socket or device)"
            raise ConfigurationError(
                f"Script {target!r} is {kind}. Give the path of a Python file, or -m package.module to run a module."
            )
        raise ConfigurationError(
            f"Script {target!r} not found (relative to {os.getcwd()}). Give the path of a Python "
            "file, or -m package.module to run a module."
        )


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) == "__main__" and is_interactive():
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


def _worker_env(spec: LaunchSpec, plan: DevicePlan, run_id: str) -> WorkerEnv:
    """What every worker of this run is told (the run's directory is added by ``run_workers``)."""
    return WorkerEnv(
        run_id=run_id, launcher_pid=os.getpid(), grace_s=spec.grace_s, cpu=plan.cpu, timeout_s=spec.timeout_s,
        preempt_signal=spec.preempt_signal, max_requeues=spec.max_requeues, record_dir=spec.record_dir,
    )


def _process_env(plan: DevicePlan, nproc: int) -> dict[str, str]:
    """The other variables the workers get: the claimed GPUs, and their share of the CPU."""
    env = dict(plan.env)
    if "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun: N workers each using every core would oversubscribe the CPU. The
        # affinity mask, not the machine's count: SLURM (--cpus-per-task) or a container limits it.
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpu_count() // nproc))
    return env


def _plan(spec: LaunchSpec, run_id: str) -> DevicePlan:
    return plan_devices(spec, run=run_id)


def _run_id(topology: Topology) -> str:
    """The run's id: random on one machine; the rendezvous port on several (every node must agree)."""
    return f"gpukit-{uuid.uuid4().hex[:12]}" if topology.single_machine else f"gpukit-{topology.master_port}"


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
    spec: LaunchSpec | None = None,
    *,
    echo: Echo | None = _stderr,
    **settings: Any,
) -> list[Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` worker processes on this machine, as torchrun would.

    Each worker has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (a free port: launches side by side never collide), so
    ``torch.distributed.init_process_group()`` works inside ``fn`` with no arguments.

    Args:
        fn: A module-level function (workers are started with spawn and import it). In a
            notebook, REPL or ``python -c``, a function (or args) defined there is run in
            workers forked from this process instead (refused with the reason where fork
            cannot work: no fork on the platform, or CUDA initialised here for GPU workers).
        args: Picklable positional arguments for ``fn`` (any, when forked).
        spec: How to launch (:class:`LaunchSpec`; ``nproc`` is required, and a function runs on
            this machine only: no ``topology``, ``preempt_signal`` or ``max_requeues``).
        echo: Where the device mapping is printed (default stderr; ``None``: silent).
        **settings: Instead of ``spec``, its fields: ``launch_function(fn, nproc=2, cpu=True)``.

    Returns:
        ``fn``'s return value of each rank, by rank.

    Raises:
        ConfigurationError: bad settings, or ``fn``/``args`` that workers cannot unpickle.
        GpuSelectionError: the GPUs asked for are not there or not free.
        WorkerFailedError: (a ``LaunchError``) a worker raised or died; names the rank and error.
        RunInterruptedError: (a ``LaunchError``) this process got Ctrl-C/SIGTERM meanwhile.
    """
    spec = spec_from(spec, settings, "launch_function")
    _check_function_spec(spec)
    nproc = cast(int, spec.nproc)  # checked just above
    fork = needs_fork(fn, args)  # defined in a notebook: workers are forked from it (see _notebook.py)
    if not fork:
        _check_picklable(fn, args)
    topology = Topology()  # this machine
    spec = dataclasses.replace(spec, topology=topology)
    run_id = _run_id(topology)
    plan = _plan(spec, run_id)
    try:
        if fork:
            check_fork(f"launch_function({getattr(fn, '__qualname__', fn)!r})", uses_gpus=plan.gpu_count > 0)
        _announce(echo, plan, nproc, topology)
        plan.label_claim(run_id, nproc, topology.node_rank)
        # spawned workers import this script again: through gpukit, which keeps the error if that fails
        with nullcontext() if fork else main_imported_by_gpukit():
            values = run_workers(
                run_forked_function if fork else run_function, (fn, *args), spec, nproc=nproc,
                env=_process_env(plan, nproc), worker=_worker_env(spec, plan, run_id), run_id=run_id,
                start_method="fork" if fork else "spawn",
            )
    finally:
        plan.release()
    return [values[rank] for rank in sorted(values)]


def _check_function_spec(spec: LaunchSpec) -> None:
    if spec.nproc is None:
        raise ConfigurationError("launch_function: give nproc, the number of worker processes (nproc=2).")
    given = [name for name in ("topology", "preempt_signal", "max_requeues") if getattr(spec, name) is not None]
    if given:
        raise ConfigurationError(f"launch_function runs its workers on this machine and handles no scheduler "
                                 f"preemption: {', '.join(given)} are for scripts (launch_script, gpukit run).")


def launch_script(
    target: str,
    script_args: Sequence[str] = (),
    spec: LaunchSpec | None = None,
    *,
    module: bool = False,
    echo: Echo | None = _stderr,
    **settings: Any,
) -> None:
    """Run a script (or ``-m`` module) in worker processes -- what ``gpukit run`` does.

    Args:
        target: Path of the script, or the module name when ``module`` is true.
        script_args: The script's own arguments.
        spec: How to launch (:class:`LaunchSpec`); its defaults take the topology, the GPUs, the
            preemption signal and the requeue bound from the scheduler and ``GPUKIT_*`` variables.
        module: Run ``target`` as ``python -m target``.
        echo: Where the device mapping is printed (default stderr; ``None``: silent).
        **settings: Instead of ``spec``, its fields.

    Raises:
        ConfigurationError: bad settings or a missing script/module.
        GpuSelectionError: the GPUs asked for are not there or not free.
        WorkerFailedError: a worker failed; ``exit_code`` is what ``gpukit run`` exits with.
        RunInterruptedError: Ctrl-C/SIGTERM; ``exit_code`` is 75 when preempted cleanly.
        LaunchError: the rendezvous failed (unreachable master, nodes missing).
    """
    spec = spec_from(spec, settings, "launch_script")
    topology = spec.topology or node_topology()
    check_topology(topology)
    _check_target(target, module)
    cluster = environment()
    if echo is not None:
        announce(cluster, under_gpukit=worker_env().launcher_pid is not None)  # a launch inside a worker
    gpus = spec.gpus
    if gpus.automatic and spec.nproc is None and not spec.cpu:
        gpus = GpuRequest.of(scheduler_gpu_count(cluster))  # every GPU SLURM gave this node, and no other
    spec = dataclasses.replace(  # what was left to the scheduler and the GPUKIT_* settings, decided
        spec, topology=topology, gpus=gpus,
        preempt_signal=spec.preempt_signal or preempt_signal(),
        max_requeues=max_requeues_from_env() if spec.max_requeues is None else spec.max_requeues,
    )
    try:
        # a stop held since the CLI started is acted on here, and when run_workers installs the
        # launcher's handlers (after its imports): stop before any worker starts, exit 75
        raise_if_held()
        _launch_script_workers(target, script_args, spec, module=module, echo=echo)
    except StopSignal as exc:  # before any worker started: nothing to save
        interrupted = RunInterruptedError(exc.signum, preempted=True, grace_s=spec.grace_s,
                                          detail="no worker had started yet, nothing to save")
        _requeue_if_preempted(interrupted, spec, cluster, echo)
        raise interrupted from None
    except RunInterruptedError as exc:
        _requeue_if_preempted(exc, spec, cluster, echo)
        raise


def _requeue_if_preempted(exc: RunInterruptedError, spec: LaunchSpec, cluster: ClusterEnvironment,
                          echo: Echo | None) -> None:
    # The preemption warning reached this node's launcher or (node 0 heard from them) another
    # node's: node 0 requeues -- also when a worker did not stop cleanly (it resumes from its
    # last complete checkpoint); a requeued job is never worse than a job lost from the queue.
    preempt = spec.preempt_signal
    if preempt is not None and (preempt.name == exc.signal_name or preempt.name in exc.other_signals):
        limit = cast(int, spec.max_requeues)  # launch_script decided it
        requeue_after_preemption(preempt.name, preempt, max_requeues=limit, env=cluster, echo=echo)


def _launch_script_workers(target: str, script_args: Sequence[str], spec: LaunchSpec, *, module: bool,
                           echo: Echo | None) -> None:
    topology = cast(Topology, spec.topology)  # launch_script decided it
    run_id = _run_id(topology)
    with held_signals_raise() if spec.wait else nullcontext():  # a stop while waiting for GPUs ends the wait
        plan = _plan(spec, run_id)
    try:
        workers = spec.nproc or max(1, plan.gpu_count)
        _announce(echo, plan, workers, topology)
        plan.label_claim(run_id, workers, topology.node_rank)
        command = ("-u", "-m", "gpukit.worker._bootstrap", *(("-m",) if module else ()), target, *script_args)
        run_workers(sys.executable, command, spec, nproc=workers, env=_process_env(plan, workers),
                    worker=_worker_env(spec, plan, run_id), run_id=run_id)
    finally:
        plan.release()
