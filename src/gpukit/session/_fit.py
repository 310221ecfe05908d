"""``Session(fit=...)``: the session chooses, at ``setup``, what ``gpukit plan --fit`` would print.

``Session(fit=True)`` (the GPU's free memory) or ``fit="20GiB"`` (a budget per device) leaves
to :meth:`SessionFit.apply`, called by ``session.setup(model, optimizer, example_input=batch)``:

* the precision, when ``precision`` was left at "auto": the accelerator's own choice is kept when
  some configuration with it fits, and a lower-memory one (bf16-mixed, then bf16-true) is taken
  only when none does -- fit's cost model counts 16-bit as faster, but a session does not change
  the maths of training for speed alone;
* activation checkpointing (none, "selective", True), when it was not given;
* the micro-batch: ``session.run_step`` splits each batch into micro-batches of that size
  (gradient accumulation inside the step; the gradient stays the whole batch's).

What the user set is kept and planned as set; the strategy is always the session's (the launcher
decided the processes; fit plans DDP or FSDP over them as they are, with the session's tensor-parallel
groups: ``Session(tensor_parallel=2, fit=...)`` plans each rank's shard of the model and the groups'
collectives, as ``gpukit plan --fit`` does). The tensor-parallel degree itself is the session's too:
the data-parallel coordinates (the loader's shards, the seeds, the global batch) follow from it when the
Session is built, before the model is seen; where no configuration fits and a degree would, the error
says which one (``Session(tensor_parallel=N)``). ``Session(tensor_parallel="auto", fit=...)`` leaves the
degree to fit: tensor groups only where nothing fits without them (the smallest degree that fits; each
process keeps its batch, which the ranks of a group then share), applied at setup before the model is
split -- the strategy's layout, the loader tracker's and the seeding's data-parallel coordinates -- and
refused when a loader was set up first (it was sharded for the coordinates of then). Among what is left open, the
cheapest predicted step whose planned peak fits wins (:func:`gpukit.memory.fit`). Rank 0 decides
on the smallest budget of any rank and broadcasts, so every rank applies the same choice.

On the CPU the budget must be given (``fit="8GiB"``): running out of RAM is the OS killing the
process or swapping, not an error, and processes share the RAM, so no free-memory probe is honest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpukit._util.units import format_bytes, parse_size
from gpukit.errors import ConfigurationError, GpukitError, MemoryPlanError
from gpukit.layout import plan_name_of
from gpukit.memory import (
    FIT_PRECISIONS, FitOption, FitPlanner, FitResult, check_policy, example_batch_size, fit, policy_name,
)
from gpukit.placement import unwrap_model

if TYPE_CHECKING:
    from gpukit.accelerators import Accelerator
    from gpukit.session._config import SessionConfig
    from gpukit.session._memory import SessionMemory
    from gpukit.strategies import Strategy

__all__ = ["FitChoice", "SessionFit", "fit_at_setup", "FREE_MEMORY_SHARE"]

#: share of the GPU's free memory ``fit=True`` budgets (fragmentation, library workspaces)
FREE_MEMORY_SHARE = 0.9
_POLICY = {"none": None, "selective": "selective", "full": True}


class FitNothingFitsError(MemoryPlanError):
    """``Session(fit=...)``: no configuration left open fits the budget."""


@dataclass(frozen=True)
class FitChoice:
    """What ``Session(fit=...)`` chose at ``setup`` (``session.fit_choice``).

    Attributes:
        option: the planned configuration (precision, checkpointing, strategy, micro-batch,
            accumulation, predicted peak per device and step time).
        budget_bytes: the memory per device it had to fit in; ``budget_source`` says where from.
        batch_size: the per-process batch it planned (dim 0 of ``example_input``).
        chosen: the settings fit chose; ``kept``: the ones the user set (planned as set).
        faster_rejected: the cheaper configuration that did not fit, if any (why this one).
    """

    option: FitOption
    budget_bytes: int
    budget_source: str
    batch_size: int
    chosen: tuple[str, ...]
    kept: tuple[str, ...]
    faster_rejected: FitOption | None = None

    @property
    def precision(self) -> str:
        return self.option.precision

    @property
    def activation_checkpointing(self) -> Any:
        """The policy as ``Session(activation_checkpointing=...)`` takes it (None, "selective", True)."""
        return _POLICY[self.option.activation_checkpointing]

    @property
    def micro_batch(self) -> int:
        return self.option.micro_batch

    @property
    def accumulate(self) -> int:
        """Micro-batches per batch (``run_step`` runs them; not ``accumulate_grad_batches``)."""
        return self.option.accumulate

    @property
    def peak_bytes(self) -> int:
        return self.option.peak_bytes

    def __str__(self) -> str:
        o = self.option
        split = (f"micro-batch {o.micro_batch} x{self.accumulate} (run_step splits each batch of {self.batch_size})"
                 if o.micro_batch < self.batch_size else f"whole batches of {self.batch_size}")
        why = ""
        if self.faster_rejected is not None:
            r = self.faster_rejected
            why = (f"; faster {r.precision}/checkpointing {r.activation_checkpointing}/micro-batch {r.micro_batch} "
                   f"needs {format_bytes(r.peak_bytes)}")
        kept = f"; kept as set: {', '.join(self.kept)}" if self.kept else ""
        return (f"gpukit fit: precision {o.precision}, activation checkpointing {o.activation_checkpointing}, "
                f"{split} -- planned peak {format_bytes(o.peak_bytes)} of {format_bytes(self.budget_bytes)} "
                f"({self.budget_source}); cheapest predicted step that fits{why}; chose {', '.join(self.chosen)}{kept}")


class SessionFit:
    """The ``fit`` option of a Session: checked when built, applied by ``setup`` (module docstring).

    Args:
        fit: True (GPU free memory) or a budget per device ("20GiB" or bytes).
        config: the Session's arguments as given (which options the user set).
        strategy, accelerator: the session's (the strategy's precision is the one before the choice,
            and the one ``apply`` replaces).
        verbose: print the choice on rank 0.

    Raises:
        ConfigurationError: a bad ``fit``, ``fit=True`` on the CPU, or an option fit cannot plan
            (DataParallel, pipeline, "16-mixed", a custom checkpointing policy).
    """

    def __init__(self, fit: Any, *, config: SessionConfig, strategy: Strategy, accelerator: Accelerator,
                 verbose: bool) -> None:
        if fit is True:
            if accelerator.is_host:
                raise ConfigurationError(
                    "Session(fit=True) on the CPU: there is no free device memory to measure (running out of RAM "
                    "kills the process rather than raising). Give the budget per process: Session(fit='8GiB').")
            self.budget: int | None = None
        elif isinstance(fit, (str, int)) and not isinstance(fit, bool):
            self.budget = parse_size(fit)
            if self.budget < 1:
                raise ConfigurationError(f"Session(fit={fit!r}): that is {self.budget} bytes; give the memory of one "
                                         "device, e.g. fit='20GiB' (or fit=True for the GPU's free memory).")
        else:
            raise ConfigurationError(
                f"Session(fit={fit!r}): use True (fit the GPU's free memory), a size per device such as "
                "fit='20GiB' or bytes, or leave it out (None).")
        self._strategy, self._accelerator, self._verbose = strategy, accelerator, verbose
        self.plan_strategy = _plan_strategy(strategy)
        #: ``tensor_parallel="auto"``: the degrees tried (in order) where nothing fits without tensor groups;
        #: groups stay inside a node (ranks are tensor-innermost: the degree divides the processes per node)
        node = strategy.num_processes
        self.degrees = ([t for t in range(2, node + 1) if strategy.world_size % t == 0 and node % t == 0]
                        if config.tensor_parallel == "auto" else [])
        name = self.plan_strategy if self.degrees else strategy.name  # "auto": "tp" x1 is DDP or FSDP so far
        self.kept: list[str] = [f"strategy {name}" + (f" x{strategy.world_size}" if strategy.world_size > 1 else "")]
        precision = strategy.precision
        if config.precision == "auto":
            self.precisions = _preferred_precisions(precision.name, accelerator, strategy.root_device)
        else:
            if precision.name not in FIT_PRECISIONS:
                raise ConfigurationError(
                    f"Session(precision={config.precision!r}, fit=...): fit plans {', '.join(FIT_PRECISIONS)}; "
                    "give one of those or leave precision to fit ('auto').")
            self.precisions = [precision.name]
            self.kept.append(f"precision={precision.name!r}")
        own = getattr(strategy, "activation_checkpointing", None)
        if config.activation_checkpointing is None and own is None:
            self.checkpointing = ["none", "selective", "full"]
        else:
            name = policy_name(check_policy(config.activation_checkpointing if own is None else own))
            if name == "custom":
                raise ConfigurationError(
                    "Session(fit=...) plans activation_checkpointing None, 'selective' or True; a custom policy "
                    "(module classes or a callable) cannot be planned: give one of those, or leave it to fit.")
            self.checkpointing = [name]
            self.kept.append(f"activation_checkpointing={_POLICY[name]!r}")
        #: the choice, once ``apply`` has run
        self.choice: FitChoice | None = None

    @classmethod
    def create(cls, fit: Any, config: SessionConfig, strategy: Strategy, *, verbose: bool) -> SessionFit | None:
        """The component for ``Session(fit=fit)``; ``None`` for ``fit=None`` or ``False``."""
        if fit is None or fit is False:
            return None
        return cls(fit, config=config, strategy=strategy, accelerator=strategy.accelerator, verbose=verbose)

    def apply(self, model: nn.Module, optimizer: Any, example_input: Any, *, memory: SessionMemory,
              regroup: Callable[[int], None] | None = None) -> None:
        """Choose (rank 0, broadcast) and apply: the precision and checkpointing to the strategy, which
        owns them (every component reads the precision through it), the micro-batch to ``memory``, a
        tensor-parallel degree (``tensor_parallel="auto"``) to ``regroup``."""
        from gpukit.precision import get_precision

        if example_input is None:
            raise ConfigurationError(
                "Session(fit=...) chooses at setup from the model's input: call "
                "session.setup(model, optimizer, example_input=batch_inputs) (one batch of this process, "
                "batch first, as model(batch_inputs) takes it).")
        budget, source = self._budget(model)
        outcome: Any
        if self._strategy.rank == 0:
            try:
                outcome = self._choose(model, optimizer, example_input, budget, source)
            except GpukitError as exc:
                outcome = exc  # raised on every rank, not only here (the others would wait)
            except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks too
                outcome = MemoryPlanError(f"Session(fit=...) could not plan the model: {type(exc).__name__}: {exc}")
        else:
            outcome = None
        outcome = self._strategy.broadcast(outcome, 0)
        if isinstance(outcome, BaseException):
            raise outcome
        self.choice = choice = outcome
        if choice.option.layout.tensor != self._strategy.layout.tensor:
            if regroup is None:
                raise ConfigurationError("Session(fit=...) chose tensor groups but cannot apply them here")
            regroup(choice.option.layout.tensor)
        if self._verbose and self._strategy.rank == 0:
            print(choice, file=sys.stderr, flush=True)
        self._strategy.activation_checkpointing = choice.activation_checkpointing
        if choice.micro_batch < choice.batch_size:
            memory.use_micro_batch(choice.micro_batch)
        if choice.precision != self._strategy.precision.name:
            self._strategy.precision = get_precision(choice.precision, self._accelerator, self._strategy.root_device)

    # -- choosing ----------------------------------------------------------------------------------
    def _budget(self, model: nn.Module) -> tuple[int, str]:
        if self.budget is not None:
            return self.budget, "given"
        device = self._strategy.root_device
        free = self._accelerator.free_memory_bytes(device)
        if free is None:
            raise ConfigurationError(
                f"Session(fit=True) on {device}: the device does not report its free memory. Give the budget per "
                "process: Session(fit='8GiB').")
        stats = self._accelerator.memory_stats(device)
        cached = (stats.get("reserved_bytes") or 0) - (stats.get("allocated_bytes") or 0)
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.device == device)
        budget = int((free + cached + held) * FREE_MEMORY_SHARE)
        if self._strategy.world_size > 1:
            budget = int(self._strategy.all_reduce(float(budget), "min").item())
        share = round(FREE_MEMORY_SHARE * 100)
        return budget, f"{share}% of the free GPU memory" + (", smallest rank" if self._strategy.world_size > 1 else "")

    def _choose(self, model: nn.Module, optimizer: Any, example: Any, budget: int, source: str) -> FitChoice:
        n = self._strategy.world_size
        batch = example_batch_size(example)
        plain = unwrap_model(model)
        planner = FitPlanner(plain, example, optimizer, self._accelerator.type)
        groups = self._strategy.data_parallel_size  # the ranks of a tensor group share one batch

        def rank(precisions: list[str], strategy: str, checkpointing: list[str],
                 tensor: tuple[int, ...] | str = (), groups: int = groups) -> FitResult:
            return fit(plain, example, memory=budget, devices=n, global_batch=batch * groups, strategies=[strategy],
                       precisions=precisions, checkpointing=checkpointing, top=1, planner=planner,
                       device=self._accelerator.type, optimizer=optimizer, tensor_parallel=tensor)

        first: FitResult | None = None
        # tensor groups (tensor_parallel="auto") only where nothing fits without: a process keeps its batch
        for degree in [1, *self.degrees]:
            label, degree_groups = self._layout_with(degree)
            for precision in self.precisions:
                result = rank([precision], label, self.checkpointing, (degree,) if degree > 1 else (),
                              degree_groups)
                first = result if degree == 1 else first  # the closest without groups, as without "auto"
                if result.best is not None:
                    chosen = ["precision"] if len(self.precisions) > 1 else []
                    chosen += ["activation checkpointing"] if len(self.checkpointing) > 1 else []
                    chosen += ["micro-batch"] + ([f"tensor_parallel={degree}"] if self.degrees else [])
                    return FitChoice(result.best, budget, source, batch, tuple(chosen), tuple(self.kept),
                                     result.cheaper_rejected)
        assert first is not None
        raise FitNothingFitsError(self._nothing_fits(first, budget, source, rank))

    def _layout_with(self, degree: int) -> tuple[str, int]:
        """The planner's name for the session's layout with tensor groups of ``degree`` (1: as it is), and
        its data-parallel size."""
        layout = self._strategy.layout
        if degree == 1:
            return self.plan_strategy, layout.data_parallel_size
        groups = self._strategy.world_size // degree
        grouped = replace(layout, tensor=degree, **({"shards": groups} if layout.shards > 1 else {"replicas": groups}))
        label = plan_name_of(grouped)
        assert label is not None  # DDP or FSDP over tensor groups: registered layouts
        return label, groups

    def _nothing_fits(self, result: FitResult, budget: int, source: str, rank: Any) -> str:
        closest = result.closest
        lines = [f"Session(fit=...): nothing fits {format_bytes(budget)} per device ({source})."]
        if closest is not None:
            lines.append(f"  closest: {closest.describe()}: needs {format_bytes(closest.peak_bytes - budget)} more "
                         f"({closest.peak_bytes / budget:.2f}x the budget).")
        tensor = f"; tensor_parallel {', '.join(map(str, [1, *self.degrees]))}" if self.degrees else ""
        lines.append(f"  tried: precision {', '.join(self.precisions)}; activation checkpointing "
                     f"{', '.join(self.checkpointing)}{tensor}; every micro-batch down to 1. Kept as set: "
                     f"{', '.join(self.kept)}.")
        hints = []
        if len(self.precisions) == 1 and self.precisions[0] != "bf16-true":  # the user fixed the precision
            other = rank(["bf16-true"], self.plan_strategy, self.checkpointing).best
            if other is not None:
                hints.append(f"precision='bf16-true' would fit ({format_bytes(other.peak_bytes)}): leave precision to fit")
        if len(self.checkpointing) == 1 and self.checkpointing[0] != "full":
            other = rank(self.precisions[-1:], self.plan_strategy, ["full"]).best
            if other is not None:
                hints.append(f"activation_checkpointing=True would fit ({format_bytes(other.peak_bytes)})")
        if self._strategy.world_size > 1 and self.plan_strategy == "ddp":
            other = rank(self.precisions[-1:], "fsdp", self.checkpointing).best
            if other is not None:
                hints.append(f"strategy='fsdp' would fit ({format_bytes(other.peak_bytes)}): it shards parameters, "
                             "gradients and optimizer state")
        if self._strategy.world_size > 1 and self._strategy.layout.tensor == 1 and not self.degrees:
            other = rank(self.precisions[-1:], self.plan_strategy, self.checkpointing, "auto").best
            if other is not None and other.layout.tensor > 1:
                hints.append(f"tensor_parallel={other.layout.tensor} would fit ({format_bytes(other.peak_bytes)}): "
                             "each layer split over a group of processes that share a batch; or "
                             "tensor_parallel='auto' to let fit choose it at setup")
        hints.append("a smaller batch per process, more processes, or a device with more memory")
        return "\n".join(lines + [f"  fix: {h}." for h in hints])


def fit_at_setup(fit: SessionFit | None, model: nn.Module, optimizer: Any, example_input: Any, *,
                 memory: SessionMemory, regroup: Callable[[int], None] | None = None) -> None:
    """``session.setup``'s part for ``fit``: the first model set up decides, later ones follow it."""
    if fit is None:
        raise ConfigurationError("session.setup(example_input=...) is for Session(fit=...), which this session was "
                                 "not given: add fit='20GiB' (or fit=True on a GPU), or drop example_input.")
    if fit.choice is None:
        fit.apply(model, optimizer, example_input, memory=memory, regroup=regroup)


def _plan_strategy(strategy: Strategy) -> str:
    """The planner's name for the session's layout (a layout of one device per process, with or without
    tensor groups: "ddp", "fsdp+tp2", "tp2")."""
    layout = strategy.layout
    label = None if layout.one_process else plan_name_of(layout)
    if label is not None:
        return label
    name = strategy.name
    raise ConfigurationError(
        f"Session(strategy={name!r}, fit=...): fit plans one device per process (single, DDP, FSDP); "
        f"for {name!r} use gpukit.memory.fit(...) / `gpukit plan --fit` and set the options yourself.")


def _preferred_precisions(auto: str, accelerator: Accelerator, device: torch.device) -> list[str]:
    """The precision "auto" gave first, then the lower-memory ones the device runs natively."""
    supported = [p for p in FIT_PRECISIONS if p == "32-true" or accelerator.supports_bf16(device)]
    start = supported.index(auto) if auto in supported else 0
    return supported[start:]
