"""``gpukit doctor``: check a machine for the traps that break PyTorch GPU runs, and say how to fix each.

:func:`run_checks` returns :class:`Finding` objects (status ``ok``/``info``/``warn``/``fail``,
what was found, a one-line fix) and a report to paste into a bug report. Checks: the CUDA
environment (``CUDA_VISIBLE_DEVICES`` mapping, device order, CUDA initialised too early), the
driver against torch's CUDA, GPUs held by dead or orphaned processes and stale gpukit claims,
MIG and persistence mode, CPUs and affinity, ``/dev/shm``, and the network a multi-machine
run would use. :func:`run_gpu_checks` (``gpukit doctor --gpu``) then measures each GPU: copy
bandwidth, a matrix product, allocatable memory, ECC, an all-reduce between GPUs. Importing this
package does not import torch (the measurements run in child processes that do).
"""

from __future__ import annotations

from gpukit.doctor._context import SHM_PATH_ENV, DoctorContext
from gpukit.doctor._finding import STATUSES, Finding, worst
from gpukit.doctor._gpu_run import run_gpu_checks
from gpukit.doctor._run import CHECKS, DoctorResult, run_checks

__all__ = ["run_checks", "run_gpu_checks", "DoctorResult", "Finding", "STATUSES", "CHECKS", "DoctorContext",
           "SHM_PATH_ENV", "worst"]
