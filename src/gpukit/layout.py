"""How a job is parallel: one small frozen value, and the one registry of strategy names.

A :class:`Layout` says how the devices of a job divide the work: ``replicas`` (full copies of the
model, each on its own batch: DDP, DataParallel), ``shards`` (the model's parameters, gradients and
optimizer state split over a group that still sees different batches: FSDP), ``tensor`` (each layer
split over a group that sees the *same* batch), ``stages`` (consecutive layers on consecutive
devices: the pipeline), and ``offload`` (sharded state kept in host memory between uses). Every
strategy exposes its layout; anything that means "data-parallel rank" (which samples a process
loads, the global batch, ``gather_for_metrics``, loss averaging) reads :meth:`Layout.data_parallel_rank`
and :attr:`Layout.data_parallel_size`, never the global rank and world size -- the two differ as soon as
a tensor group shares one batch.

The registry (:data:`REGISTRY`) is the one list of strategy names: ``Session(strategy=...)``, the
planner (``gpukit plan --fit``, ``Session(fit=...)``) and the CLI read it, and the ``Session(...)``
line the planner suggests is written from it. A new strategy is a ``Strategy`` subclass in its own
module plus one :func:`register_strategy` call (docs/architecture.md, "Where new code goes").

This module imports no torch: the planner's torch-free parts, the CLI's option lists and the
launcher read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpukit.errors import ConfigurationError

__all__ = [
    "Layout",
    "StrategyEntry",
    "PLACEMENTS",
    "REGISTRY",
    "register_strategy",
    "strategy_entry",
    "strategy_names",
    "plan_layout",
    "plan_names",
    "plan_name_of",
    "session_arguments",
]


@dataclass(frozen=True)
class Layout:
    """How a job's devices divide the work (see the module docstring).

    Ranks are ordered with ``tensor`` innermost, then ``shards``, then ``replicas`` (torchtitan's
    order): ranks ``0 .. tensor-1`` form the first tensor group and load the same batch.

    Raises:
        ConfigurationError: a degree that is not a whole number >= 1.
    """

    replicas: int = 1
    shards: int = 1
    tensor: int = 1
    stages: int = 1
    offload: bool = False
    #: one process drives every device (DataParallel, the pipeline): data-parallel coordinates
    #: of the *process* are then 0 of 1, whatever the devices do inside it
    one_process: bool = False

    def __post_init__(self) -> None:
        for name in ("replicas", "shards", "tensor", "stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"Layout({name}={value!r}): a parallel degree is a whole number >= 1 (1: not split that way)."
                )

    @property
    def devices(self) -> int:
        """Devices the job uses in all."""
        return self.replicas * self.shards * self.tensor * self.stages

    @property
    def processes(self) -> int:
        """Processes the job runs in."""
        return 1 if self.one_process else self.devices // self.stages

    @property
    def data_parallel_size(self) -> int:
        """Processes that load different batches (the sampler's number of shards)."""
        return 1 if self.one_process else self.replicas * self.shards

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: which shard of the data it loads."""
        return 0 if self.one_process else rank // self.tensor

    def tensor_rank(self, rank: int) -> int:
        """Where global ``rank`` sits in its tensor group (0 when layers are not split)."""
        return 0 if self.one_process else rank % self.tensor

    def describe(self) -> str:
        """A short phrase: ``"1 device"``, ``"2 replicas"``, ``"2 shards x 2 tensor"``..."""
        parts = [f"{n} {word}" for n, word in ((self.replicas, "replicas"), (self.shards, "shards"),
                                                (self.tensor, "tensor"), (self.stages, "stages")) if n > 1]
        text = " x ".join(parts) or "1 device"
        return text + (", offloaded" if self.offload else "")


#: how a strategy takes its devices, which ``strategies/_select.py`` checks and builds by:
#: one device in one process; several devices in one process; one device per process; stage
#: devices in one process
PLACEMENTS = ("one-device", "in-process", "per-process", "stages")


@dataclass(frozen=True)
class StrategyEntry:
    """One registered strategy name.

    Attributes:
        name: what ``Session(strategy=...)`` accepts.
        target: ``"module:Class"`` of its ``Strategy`` subclass (imported when chosen).
        placement: one of :data:`PLACEMENTS`.
        plans: the planner's names for the layouts this strategy runs over ``n`` devices, each with
            its layout factory (empty: the planner does not plan it).
        summary: one line for help texts.
        argument: writes the ``strategy=...`` argument of the ``Session(...)`` line that runs a
            planned layout (``None``: ``strategy='<name>'``, none for a one-device strategy).
    """

    name: str
    target: str
    placement: str
    plans: dict[str, Callable[[int], Layout]] = field(default_factory=dict)
    summary: str = ""
    argument: Callable[[Layout], str] | None = None

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(
                f"StrategyEntry({self.name!r}, placement={self.placement!r}): choose one of {', '.join(PLACEMENTS)}."
            )
        if ":" not in self.target:
            raise ConfigurationError(f"StrategyEntry({self.name!r}, target={self.target!r}): write 'module:Class'.")


REGISTRY: dict[str, StrategyEntry] = {}


def register_strategy(entry: StrategyEntry) -> StrategyEntry:
    """Add ``entry`` to the registry (the one line a new strategy needs).

    Raises:
        ConfigurationError: the name is taken, or "auto".
    """
    if entry.name == "auto" or entry.name in REGISTRY:
        raise ConfigurationError(f"strategy name {entry.name!r} is taken; registered: {', '.join(REGISTRY)}.")
    taken = {label for other in REGISTRY.values() for label in other.plans}
    clash = sorted(taken & set(entry.plans))
    if clash:
        raise ConfigurationError(f"strategy {entry.name!r}: plan name(s) {clash} are taken by another strategy.")
    REGISTRY[entry.name] = entry
    return entry


register_strategy(StrategyEntry("single", "gpukit.strategies.single:SingleDeviceStrategy", "one-device",
                                {"single": lambda n: Layout()}, "one device, one process"))
register_strategy(StrategyEntry("dp", "gpukit.strategies.dp:DataParallelStrategy", "in-process",
                                summary="torch's DataParallel: several GPUs, one process"))
register_strategy(StrategyEntry("ddp", "gpukit.strategies.ddp:DDPStrategy", "per-process",
                                {"ddp": lambda n: Layout(replicas=n)}, "DistributedDataParallel: a process per device"))
register_strategy(StrategyEntry("fsdp", "gpukit.strategies.fsdp:FSDPStrategy", "per-process",
                                {"fsdp": lambda n: Layout(shards=n),
                                 "fsdp-offload": lambda n: Layout(shards=n, offload=True)},
                                "FSDP2: parameters, gradients and optimizer state sharded",
                                lambda layout: ("strategy=gpukit.strategies.FSDPStrategy(cpu_offload=True)"
                                                if layout.offload else "strategy='fsdp'")))
register_strategy(StrategyEntry("tp", "gpukit.strategies.tensor:TensorParallelStrategy", "per-process",
                                summary="tensor parallel: each layer split over the processes (torch DTensor); "
                                        "Session(tensor_parallel=N) for N-process groups under ddp or fsdp"))
register_strategy(StrategyEntry("pipeline", "gpukit.strategies.pipeline:PipelineStrategy", "stages",
                                {"pipeline": lambda n: Layout(stages=n, one_process=True)},
                                "the model's layers split over devices in one process",
                                lambda layout: (f"strategy=gpukit.strategies.PipelineStrategy("
                                                f"list(range({layout.devices})), chunks={4 * layout.devices})")))


def strategy_names() -> tuple[str, ...]:
    """Every name ``Session(strategy=...)`` accepts, ``"auto"`` first."""
    return ("auto", *REGISTRY)


def strategy_entry(name: str) -> StrategyEntry:
    """The registered entry for ``name``.

    Raises:
        ConfigurationError: an unknown name (the message lists the known ones).
    """
    entry = REGISTRY.get(str(name).strip().lower())
    if entry is None:
        raise ConfigurationError(
            f"Unknown strategy {name!r}; choose one of {', '.join(map(repr, strategy_names()))}."
        )
    return entry


def plan_names() -> tuple[str, ...]:
    """The planner's names for what it can plan (``fit(strategies=...)``, ``plan --fit``)."""
    return tuple(label for entry in REGISTRY.values() for label in entry.plans)


def _tensor_label(label: str) -> tuple[str | None, int] | None:
    """``"fsdp+tp2"`` -> ``("fsdp", 2)``, ``"tp4"`` -> ``(None, 4)``; ``None`` for a label without tensor groups."""
    base, plus, tail = str(label).rpartition("+")
    tail = tail if plus else str(label)
    if not tail.startswith("tp") or not tail[2:].isdigit() or int(tail[2:]) < 2:
        return None
    return (base if plus else None), int(tail[2:])


def plan_layout(label: str, devices: int) -> Layout:
    """The layout the planner's ``label`` runs over ``devices``: one of :func:`plan_names`, or one of those
    of one device per process with tensor groups of ``T`` (``"fsdp+tp2"``: FSDP over ``devices / T`` groups;
    ``"tp2"``: one group of 2, whatever ``devices``).

    Raises:
        ConfigurationError: an unknown label, or tensor groups that do not divide ``devices``.
    """
    tensor = _tensor_label(label)
    if tensor is not None:
        base, degree = tensor
        if base is None:
            return Layout(tensor=degree)
        entry = next((e for e in REGISTRY.values() if base in e.plans), None)
        if entry is None or entry.placement != "per-process" or devices % degree:
            raise ConfigurationError(
                f"plan {label!r} over {devices} device(s): tensor groups go with a strategy of one device per "
                f"process ({', '.join(n for e in REGISTRY.values() if e.placement == 'per-process' for n in e.plans)})"
                f", and the degree must divide the devices.")
        groups = plan_layout(base, devices // degree)
        return Layout(replicas=groups.replicas, shards=groups.shards, tensor=degree, offload=groups.offload)
    for entry in REGISTRY.values():
        if label in entry.plans:
            return entry.plans[label](1 if entry.placement == "one-device" else devices)
    raise ConfigurationError(f"unknown plan {label!r}; choose from {', '.join(plan_names())} (each of one device per "
                             "process may take tensor groups: 'fsdp+tp2', or 'tp2' for one group).")


def _groups(layout: Layout) -> Layout:
    """``layout`` without its tensor groups: how the groups divide the data."""
    return Layout(replicas=layout.replicas, shards=layout.shards, stages=layout.stages, offload=layout.offload,
                  one_process=layout.one_process)


def plan_name_of(layout: Layout) -> str | None:
    """The planner's name for ``layout`` (``None``: no registered strategy plans it)."""
    if layout.tensor > 1:
        if layout.replicas * layout.shards == 1 and not layout.offload:
            return f"tp{layout.tensor}"
        base = plan_name_of(_groups(layout))
        return None if base is None else f"{base}+tp{layout.tensor}"
    for entry in REGISTRY.values():
        for label, make in entry.plans.items():
            if make(layout.devices) == layout:
                return label
    return None


def session_arguments(layout: Layout) -> list[str]:
    """The ``Session(...)`` arguments that run ``layout`` (placement only: no precision, no batch);
    ``tensor_parallel=T`` for tensor groups (replicated over the groups unless they are sharded).

    Raises:
        ConfigurationError: no registered strategy plans ``layout``.
    """
    if layout.tensor > 1:
        groups = _groups(layout)
        args = [f"devices={layout.devices}"]
        if groups.devices > 1 or groups.offload:  # DDP (replicated) or FSDP (sharded, offloaded) over the groups
            args += [arg for arg in session_arguments(groups) if not arg.startswith("devices=")]
        return [*args, f"tensor_parallel={layout.tensor}"]
    for entry in REGISTRY.values():
        if any(make(layout.devices) == layout for make in entry.plans.values()):
            args = [f"devices={layout.devices}"] if layout.devices > 1 and entry.placement == "per-process" else []
            if entry.argument is not None:
                args.append(entry.argument(layout))
            elif entry.placement != "one-device":
                args.append(f"strategy={entry.name!r}")
            return args
    raise ConfigurationError(f"no registered strategy runs the layout {layout.describe()!r}.")
