"""The launcher process: launch workers the way torchrun does -- through PyTorch's elastic agent --
on the GPUs gpukit claims, and never leave a process behind.

``gpukit run`` is the command-line face of :func:`launch_script`; ``Session.launch``
calls :func:`launch_function`. What runs inside the workers is :mod:`gpukit.worker` (its stop
flag is re-exported here: :func:`install_preemption_handler`, :func:`stop_requested`,
:data:`PREEMPTED_EXIT_CODE`). Importing this package does not import torch.
"""

from __future__ import annotations

from gpukit._util.envvars import CPU_ENV, LAUNCHER_PID_ENV
from gpukit.launch._api import GRACE_ENV, RUN_ID_ENV, launch_function, launch_script
from gpukit.launch._gpu_request import GpuRequest
from gpukit.launch._signals import RunInterruptedError
from gpukit.launch._spec import DEFAULT_GRACE_S, LaunchSpec
from gpukit.launch._summary import WorkerFailedError, WorkerFailure
from gpukit.launch._topology import Topology, node_topology, scheduler_gpu_count
from gpukit.worker import (  # the worker side, for scripts that import it from here
    PREEMPTED_EXIT_CODE,
    clear_stop_request,
    install_preemption_handler,
    request_stop,
    stop_requested,
    uninstall_preemption_handler,
)

__all__ = [
    "launch_function",
    "launch_script",
    "LaunchSpec",
    "Topology",
    "node_topology",
    "scheduler_gpu_count",
    "GpuRequest",
    "stop_requested",
    "install_preemption_handler",
    "uninstall_preemption_handler",
    "request_stop",
    "clear_stop_request",
    "PREEMPTED_EXIT_CODE",
    "WorkerFailedError",
    "WorkerFailure",
    "RunInterruptedError",
    "DEFAULT_GRACE_S",
    "GRACE_ENV",
    "RUN_ID_ENV",
    "CPU_ENV",
    "LAUNCHER_PID_ENV",
]
