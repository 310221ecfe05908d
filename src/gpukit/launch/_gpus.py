"""Which devices a run gets: claim GPUs through the devices layer, or run on the CPU.

The claim is held by the launcher for the whole run (the OS drops it if the launcher
dies), and the workers see the claimed GPUs through ``CUDA_VISIBLE_DEVICES`` with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so ``cuda:0`` is the first GPU claimed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from gpukit.errors import ConfigurationError, GpuSelectionError

__all__ = ["GpuRequest", "DevicePlan", "parse_gpu_request", "plan_devices"]

#: ``None`` (automatic), a count, ``"all"``, or specific GPUs (indices or UUIDs).
GpuRequest = Union[None, int, str, Sequence[Union[int, str]]]

_GPU_FORMS = (
    "a count (--gpus 2), 'all', or a comma-separated list of GPU indices or UUIDs as "
    "`gpukit ls` shows them (--gpus 1,3; one GPU by index: --gpus 3,)"
)


def parse_gpu_request(text: str) -> GpuRequest:
    """Parse ``--gpus``: ``"2"`` -> 2, ``"all"``, ``"1,3"`` -> [1, 3], ``"3,"`` -> [3].

    Raises:
        ConfigurationError: for anything else, naming the accepted forms.
    """
    value = text.strip()
    if value.lower() == "all":
        return "all"
    if value.isdigit():
        if int(value) == 0:
            raise ConfigurationError(
                f"Invalid --gpus {text!r}: a run needs at least 1 GPU. To run on the CPU use "
                "--cpu (with --nproc N for N processes); otherwise give "
                f"{_GPU_FORMS}."
            )
        return int(value)
    items = [item.strip() for item in value.split(",")]
    if "," not in value or not any(items):
        raise ConfigurationError(f"Invalid --gpus {text!r}: expected {_GPU_FORMS}.")
    parsed: list[int | str] = []
    for item in items:
        if not item:
            continue
        if item.isdigit():
            parsed.append(int(item))
        elif item.upper().startswith(("GPU-", "MIG-")):
            parsed.append(item)
        else:
            raise ConfigurationError(f"Invalid GPU {item!r} in --gpus {text!r}: expected {_GPU_FORMS}.")
    return parsed


@dataclass
class DevicePlan:
    """What the workers get: the CUDA variables to set (or ``cpu``), the claim to hold, and a line to show."""

    env: dict[str, str] = field(default_factory=dict)
    cpu: bool = False  # a --cpu run: gloo, and GPUs hidden from the workers
    gpu_count: int = 0
    mapping: str = ""
    claim: Any = None  # gpukit.devices.GpuClaim, held until release()

    def label_claim(self, run_id: str, nproc: int, node_rank: int = 0) -> None:
        """Note in the claim the run and the rank on each GPU (local rank i uses GPU i)."""
        if self.claim is None:
            return
        count = len(self.claim.gpus)
        first = node_rank * nproc
        ranks = [first + i if nproc == count else first if nproc == 1 else None for i in range(count)]
        self.claim.label(run_id, ranks)

    def release(self) -> None:
        """Give the claimed GPUs back (idempotent)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None


def plan_devices(
    gpus: GpuRequest = None,
    *,
    cpu: bool = False,
    nproc: int | None = None,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    wait: bool = False,
    wait_timeout_s: float | None = None,
) -> DevicePlan:
    """Choose and claim the run's devices.

    Args:
        gpus: ``None``: ``nproc`` GPUs (1 when ``nproc`` is unset) if this machine has any,
            else the CPU. An ``int``: that many of the best free GPUs. ``"all"``: every GPU.
            A list: exactly those GPUs (indices or UUIDs).
        cpu: Run on the CPU (gloo); GPUs are hidden from the workers.
        nproc: Worker processes per node, when the user gave it.
        min_free_memory, max_utilization: Selection criteria (see ``gpukit.devices.select_gpus``).
        wait, wait_timeout_s: Wait for GPUs to become free instead of failing.

    Returns:
        A :class:`DevicePlan`; call ``release()`` when the run is over.

    Raises:
        GpuSelectionError: too few GPUs qualify or they are claimed by other jobs.
        ConfigurationError: contradictory arguments.
    """
    if cpu:
        if gpus is not None:
            raise ConfigurationError(f"--cpu and --gpus {gpus!r} contradict each other: give one of them.")
        return DevicePlan(env={"CUDA_VISIBLE_DEVICES": ""}, cpu=True, mapping="devices: CPU (gloo); GPUs hidden")

    from gpukit import devices  # no torch in there; imported late to keep `gpukit run -h` fast

    if gpus is None:
        if not devices.list_gpus():
            return DevicePlan(mapping="devices: CPU (no NVIDIA GPU found)")
        gpus = nproc or 1
    criteria: dict[str, Any] = {
        "min_free_memory": min_free_memory,
        "max_utilization": max_utilization,
        "wait": wait,
        "timeout_s": wait_timeout_s,
    }
    if isinstance(gpus, bool):
        raise ConfigurationError(f"Invalid gpus={gpus!r}: expected {_GPU_FORMS}.")
    if isinstance(gpus, int):
        if gpus < 1:
            raise ConfigurationError(
                f"Invalid gpus={gpus!r}: a run needs at least 1 GPU; use cpu=True (--cpu) to run "
                "on the CPU."
            )
        present = len(devices.list_gpus())
        if gpus > present:  # no amount of waiting makes more GPUs appear
            raise GpuSelectionError(
                f"--gpus {gpus}: this machine has {present} GPU{'s' if present != 1 else ''}. Ask for at most "
                f"{present}, or use several machines (--nnodes)."
            )
        claim = devices.claim_gpus(gpus, **criteria)
    elif isinstance(gpus, str) and gpus.lower() == "all":
        everything = [gpu.index for gpu in devices.list_gpus()]
        if not everything:
            raise ConfigurationError("--gpus all: no NVIDIA GPU found on this machine; use --cpu to run on the CPU.")
        claim = devices.claim_gpus(gpus=everything, **criteria)
    elif isinstance(gpus, str):
        return plan_devices(parse_gpu_request(gpus), nproc=nproc, min_free_memory=min_free_memory,
                            max_utilization=max_utilization, wait=wait, wait_timeout_s=wait_timeout_s)
    else:
        claim = devices.claim_gpus(gpus=list(gpus), **criteria)
    try:
        mig = [gpu for gpu in claim.gpus if gpu.is_mig]
        if mig and len(claim.gpus) > 1:
            # CUDA enumerates only the first MIG device of CUDA_VISIBLE_DEVICES, so every worker
            # would land on the same instance; one per worker needs a per-worker variable.
            raise ConfigurationError(
                f"--gpus {gpus!r} chose {len(claim.gpus)} devices, {len(mig)} of them MIG instances "
                f"({', '.join(g.uuid or '?' for g in mig)}). CUDA shows a process only one MIG "
                "instance, so the workers would share it. Run one worker per MIG instance "
                "(--gpus MIG-<uuid>, one gpukit run each), or use whole GPUs (--exclude the MIG GPU)."
            )
        env: dict[str, str] = {}
        devices.use_gpus(claim.gpus, env=env)
        mapping = devices.describe_mapping(env=env)
    except BaseException:
        claim.release()
        raise
    return DevicePlan(env=env, gpu_count=len(claim.gpus), mapping=mapping, claim=claim)
