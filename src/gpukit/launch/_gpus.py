"""Which devices a run gets: claim GPUs through the devices layer, or run on the CPU.

The claim is held by the launcher for the whole run (the OS drops it if the launcher
dies), and the workers see the claimed GPUs through ``CUDA_VISIBLE_DEVICES`` with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so ``cuda:0`` is the first GPU claimed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpukit.errors import ConfigurationError, GpuSelectionError

__all__ = ["GpuRequest", "DevicePlan", "plan_devices"]

_GPU_FORMS = (
    "a count (--gpus 2), 'all', or a comma-separated list of GPU indices or UUIDs as "
    "`gpukit ls` shows them (--gpus 1,3; one GPU by index: --gpus 3,; by UUID: --gpus GPU-1a2b...)"
)
_MAX_DIGITS = 9  # int() of 5,000 digits raises; no machine has a billion GPUs


@dataclass(frozen=True)
class GpuRequest:
    """Which GPUs a run asks for, parsed once where it is given (``--gpus``, or ``gpus=`` from Python).

    One form at most: ``count`` (that many of the best free GPUs), ``every`` (every GPU of the
    machine) or ``ids`` (exactly those GPUs: indices or UUIDs); none of them is automatic
    (``nproc`` GPUs if the machine has any, else the CPU).
    """

    count: int | None = None
    every: bool = False
    ids: tuple[int | str, ...] = ()

    @property
    def automatic(self) -> bool:
        """No GPUs were asked for: the launcher decides."""
        return self.count is None and not self.every and not self.ids

    def __str__(self) -> str:
        """As ``--gpus`` takes it: ``2``, ``all``, ``1,3`` (``auto`` when automatic)."""
        if self.count is not None:
            return str(self.count)
        if self.every:
            return "all"
        if self.ids:
            return ",".join(map(str, self.ids)) + ("," if len(self.ids) == 1 else "")
        return "auto"

    @classmethod
    def parse(cls, text: str) -> GpuRequest:
        """Parse ``--gpus``: ``"2"``, ``"all"``, ``"1,3"``, ``"3,"`` (GPU 3), ``"GPU-<uuid>"``, ``"GPU-<uuid>,1"``.

        Raises:
            ConfigurationError: for anything else (zero GPUs included), naming the accepted forms.
        """
        value = text.strip()
        if value.lower() == "all":
            return cls(every=True)
        items = [item.strip() for item in value.split(",")]
        shown = text if len(text) <= 40 else text[:40] + "..."
        if any(item.isdigit() and (len(item) > _MAX_DIGITS or not item.isascii()) for item in items):
            raise ConfigurationError(f"--gpus {shown!r}: a GPU count or index is a whole number of at most "
                                     f"{_MAX_DIGITS} digits (--gpus 2, --gpus 1,3, or --gpus all).")
        if value.isdigit():
            return cls._count(int(value), f"--gpus {text!r}")
        if value.upper().startswith(("GPU-", "MIG-")) and "," not in value:
            return cls(ids=(value,))  # one GPU by UUID (a count needs no comma; a UUID is no count)
        if "," not in value or not any(items):
            raise ConfigurationError(f"Invalid --gpus {shown!r}: expected {_GPU_FORMS}.")
        parsed: list[int | str] = []
        for item in items:
            if not item:
                continue
            if item.isdigit():
                parsed.append(int(item))
            elif item.upper().startswith(("GPU-", "MIG-")):
                parsed.append(item)
            else:
                raise ConfigurationError(f"Invalid GPU {item!r} in --gpus {shown!r}: expected {_GPU_FORMS}.")
        return cls(ids=tuple(parsed))

    @classmethod
    def of(cls, value: GpuRequest | int | str | Sequence[int | str] | None) -> GpuRequest:
        """A ``gpus=`` argument from Python: ``None`` (automatic), a count, ``"all"`` or any
        ``--gpus`` text, or a sequence of GPU indices/UUIDs.

        Raises:
            ConfigurationError: a bool, a count below 1, an empty sequence or text that does not parse.
        """
        if isinstance(value, GpuRequest):
            return value
        if value is None:
            return cls()
        if isinstance(value, bool):
            raise ConfigurationError(f"Invalid gpus={value!r}: expected {_GPU_FORMS}.")
        if isinstance(value, int):
            return cls._count(value, f"gpus={value!r}")
        if isinstance(value, str):
            return cls.parse(value)
        ids = tuple(value)
        if not ids:
            raise ConfigurationError(f"Invalid gpus={value!r}: no GPU given; expected {_GPU_FORMS}.")
        return cls(ids=ids)

    @classmethod
    def _count(cls, count: int, shown: str) -> GpuRequest:
        # the one place a run is refused for asking for no GPU
        if count < 1:
            raise ConfigurationError(
                f"Invalid {shown}: a run needs at least 1 GPU. To run on the CPU use --cpu (cpu=True; "
                f"--nproc N for N processes); otherwise give {_GPU_FORMS}."
            )
        return cls(count=count)


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
    gpus: GpuRequest,
    *,
    cpu: bool = False,
    nproc: int | None = None,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    wait: bool = False,
    wait_timeout_s: float | None = None,
    share: bool = False,
    run: str | None = None,
) -> DevicePlan:
    """Choose and claim the run's devices.

    Args:
        gpus: Automatic: ``nproc`` GPUs (1 when ``nproc`` is unset) if this machine has any,
            else the CPU. A count: that many of the best free GPUs. Every GPU, or exactly
            the GPUs listed (indices or UUIDs).
        cpu: Run on the CPU (gloo); GPUs are hidden from the workers.
        nproc: Worker processes per node, when the user gave it.
        min_free_memory, max_utilization: Selection criteria (see ``gpukit.devices.select_gpus``).
        wait, wait_timeout_s: Wait in the fair queue for GPUs to become free instead of failing.
        share: Also take GPUs other users' processes are using.
        run: The run's id, shown in the queue (``gpukit ls``) while it waits.

    Returns:
        A :class:`DevicePlan`; call ``release()`` when the run is over.

    Raises:
        GpuSelectionError: too few GPUs qualify or they are claimed by other jobs.
        ConfigurationError: contradictory arguments.
    """
    if cpu:
        if not gpus.automatic:
            raise ConfigurationError(f"--cpu and --gpus {gpus} contradict each other: give one of them.")
        return DevicePlan(env={"CUDA_VISIBLE_DEVICES": ""}, cpu=True, mapping="devices: CPU (gloo); GPUs hidden")

    from gpukit import devices  # no torch in there; imported late to keep `gpukit run -h` fast

    if gpus.automatic:
        if not devices.list_gpus():
            return DevicePlan(mapping="devices: CPU (no NVIDIA GPU found)")
        gpus = GpuRequest(count=nproc or 1)
    criteria: dict[str, Any] = {
        "min_free_memory": min_free_memory,
        "max_utilization": max_utilization,
        "wait": wait,
        "timeout_s": wait_timeout_s,
        "share": share,
        "run": run,
    }
    if gpus.count is not None:
        present = len(devices.list_gpus())
        if gpus.count > present:  # no amount of waiting makes more GPUs appear
            raise GpuSelectionError(
                f"--gpus {gpus.count}: this machine has {present} GPU{'s' if present != 1 else ''}. Ask for at most "
                f"{present}, or use several machines (--nnodes)."
            )
        claim = devices.claim_gpus(gpus.count, **criteria)
    elif gpus.every:
        everything = [gpu.index for gpu in devices.list_gpus()]
        if not everything:
            raise ConfigurationError("--gpus all: no NVIDIA GPU found on this machine; use --cpu to run on the CPU.")
        claim = devices.claim_gpus(gpus=everything, **criteria)
    else:
        claim = devices.claim_gpus(gpus=list(gpus.ids), **criteria)
    try:
        mig = [gpu for gpu in claim.gpus if gpu.is_mig]
        if mig and len(claim.gpus) > 1:
            # CUDA enumerates only the first MIG device of CUDA_VISIBLE_DEVICES, so every worker
            # would land on the same instance; one per worker needs a per-worker variable.
            raise ConfigurationError(
                f"--gpus {gpus} chose {len(claim.gpus)} devices, {len(mig)} of them MIG instances "
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
