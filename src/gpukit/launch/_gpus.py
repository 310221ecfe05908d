"""Which devices a run gets: claim GPUs through the devices layer, or run on the CPU.

The claim is held by the launcher for the whole run (the OS drops it if the launcher
dies), and the workers see the claimed GPUs through ``CUDA_VISIBLE_DEVICES`` with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so ``cuda:0`` is the first GPU claimed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gpukit.errors import ConfigurationError, GpuSelectionError
from gpukit.launch._gpu_request import GpuRequest
from gpukit.launch._spec import LaunchSpec

__all__ = ["DevicePlan", "plan_devices"]


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


def plan_devices(spec: LaunchSpec, *, run: str | None = None) -> DevicePlan:
    """Choose and claim the run's devices, as ``spec`` asks.

    ``spec.gpus`` automatic: ``nproc`` GPUs (1 when ``nproc`` is unset) if this machine has any, else
    the CPU; a count: that many of the best free GPUs; every GPU, or exactly the GPUs listed.
    ``spec.cpu``: the CPU (gloo), GPUs hidden from the workers. ``min_free_memory``,
    ``max_utilization``, ``share_gpus``: the selection criteria (see ``gpukit.devices.select_gpus``);
    ``wait``, ``wait_timeout_s``: wait in the fair queue instead of failing. ``run``: the run's id,
    shown in the queue (``gpukit ls``) while it waits.

    Returns:
        A :class:`DevicePlan`; call ``release()`` when the run is over.

    Raises:
        GpuSelectionError: too few GPUs qualify or they are claimed by other jobs.
        ConfigurationError: contradictory settings.
    """
    gpus = spec.gpus
    if spec.cpu:  # LaunchSpec refused --cpu with --gpus when it was made
        return DevicePlan(env={"CUDA_VISIBLE_DEVICES": ""}, cpu=True, mapping="devices: CPU (gloo); GPUs hidden")

    from gpukit import devices  # no torch in there; imported late to keep `gpukit run -h` fast

    if gpus.automatic:
        if not devices.list_gpus():
            return DevicePlan(mapping="devices: CPU (no NVIDIA GPU found)")
        gpus = GpuRequest(count=spec.nproc or 1)
    criteria: dict[str, Any] = {
        "min_free_memory": spec.min_free_memory,
        "max_utilization": spec.max_utilization,
        "wait": spec.wait,
        "timeout_s": spec.wait_timeout_s,
        "share": spec.share_gpus,
        "run": run,
    }
    claim = _claim(gpus, criteria)
    try:
        _refuse_several_mig(claim, gpus)
        env: dict[str, str] = {}
        devices.use_gpus(claim.gpus, env=env)
        mapping = devices.describe_mapping(env=env)
        if devices.is_fake_backend():  # the mapping reads like real GPUs: say what the workers will use
            source = (f"{devices.FAKE_ENV}={os.environ[devices.FAKE_ENV]}" if os.environ.get(devices.FAKE_ENV)
                      else "a FakeNvml")
            mapping += (f"\nthese GPUs are fake ({source}): the "
                        "selection, the claim and this mapping are gpukit's real behaviour, but torch in the workers "
                        "does not see them -- without a real GPU here they train on the CPU (gloo)")
    except BaseException:
        claim.release()
        raise
    return DevicePlan(env=env, gpu_count=len(claim.gpus), mapping=mapping, claim=claim)


def _claim(gpus: GpuRequest, criteria: dict[str, Any]) -> Any:
    """Claim the GPUs ``gpus`` names (a count of the best, every one, or those listed)."""
    from gpukit import devices

    if gpus.count is not None:
        present = len(devices.list_gpus())
        if gpus.count > present:  # no amount of waiting makes more GPUs appear
            if present == 0:
                raise GpuSelectionError(
                    f"--gpus {gpus.count}: this machine has no NVIDIA GPU. To run {gpus.count} processes on the CPU "
                    f"(gloo) say so: gpukit run --cpu --nproc {gpus.count} ...; or run it on a machine with GPUs."
                )
            raise GpuSelectionError(
                f"--gpus {gpus.count}: this machine has {present} GPU{'s' if present != 1 else ''}. Ask for at most "
                f"{present}, or use several machines (--nnodes)."
            )
        return devices.claim_gpus(gpus.count, **criteria)
    if gpus.every:
        everything = [gpu.index for gpu in devices.list_gpus()]
        if not everything:
            raise ConfigurationError("--gpus all: no NVIDIA GPU found on this machine; use --cpu to run on the CPU.")
        return devices.claim_gpus(gpus=everything, **criteria)
    return devices.claim_gpus(gpus=list(gpus.ids), **criteria)


def _refuse_several_mig(claim: Any, gpus: GpuRequest) -> None:
    """CUDA enumerates only the first MIG device of CUDA_VISIBLE_DEVICES, so every worker would land
    on the same instance; one per worker needs a per-worker variable."""
    mig = [gpu for gpu in claim.gpus if gpu.is_mig]
    if mig and len(claim.gpus) > 1:
        raise ConfigurationError(
            f"--gpus {gpus} chose {len(claim.gpus)} devices, {len(mig)} of them MIG instances "
            f"({', '.join(g.uuid or '?' for g in mig)}). CUDA shows a process only one MIG "
            "instance, so the workers would share it. Run one worker per MIG instance "
            "(--gpus MIG-<uuid>, one gpukit run each), or use whole GPUs (--exclude the MIG GPU)."
        )
