"""SessionConfig: every argument of ``Session(...)`` as one typed value, checked once, where it is made.

``Session.__init__`` builds one from its arguments; its parts read the fields (not a dict by string
keys); :meth:`Session.launch <gpukit.Session.launch>` sends it to the workers it starts, where each
builds an equal Session from :meth:`SessionConfig.arguments`; the trackers log :meth:`SessionConfig.tracked`.
The checks that need nothing but the values themselves run here (:meth:`__post_init__`); those that need
the machine (devices, the strategy, the batch sizes over the data-parallel ranks) run where that is known.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from gpukit._util.timeouts import parse_timeout_s
from gpukit.errors import ConfigurationError
from gpukit.session._auto_decide import check_auto
from gpukit.session._memory import check_memory_options
from gpukit.strategies import check_compile

if TYPE_CHECKING:
    from gpukit.accelerators import Accelerator
    from gpukit.precision import Precision
    from gpukit.strategies import Strategy
    from gpukit.worker import WorkerEnv

__all__ = ["SessionConfig", "check_session_options", "with_arguments"]


def check_session_options(accumulate_grad_batches: Any, seed: Any) -> None:
    """Refuse a Session's counting options that are not what they must be, before any set-up."""
    if (
        not isinstance(accumulate_grad_batches, int)
        or isinstance(accumulate_grad_batches, bool)
        or accumulate_grad_batches < 1
    ):
        raise ConfigurationError(f"accumulate_grad_batches={accumulate_grad_batches!r}; use an int >= 1.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ConfigurationError(f"seed={seed!r}; use an int or None (ints from 0 to 2**63 - 1).")


@dataclass(frozen=True, eq=False)
class SessionConfig:
    """The arguments of :class:`gpukit.Session`, under the same names and with the same defaults, and their
    checked forms; ``help(Session)`` shows the arguments documented here.

    Args:
        devices: "auto" (one device per process), an int N (-1: all visible GPUs), a list of
            GPU indices, or one device ("cpu", "cuda:1", a torch.device). On the CPU,
            ``accelerator="cpu", devices=N`` means N processes (DDP on gloo).
        precision: "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true" or "auto".
        strategy: "auto", "single", "dp", "ddp", "fsdp" (sharded over processes;
            ``FSDPStrategy(auto_wrap=..., cpu_offload=True)`` for other settings) or "pipeline"
            (layers split over ``devices`` in one process; ``PipelineStrategy(devices, chunks=4)``
            for micro-batches), or a Strategy.
        seed: seeds Python, NumPy, torch, every GPU, shuffling and loader workers.
        seed_per_rank: after ``setup``, reseed Python, NumPy and torch with ``seed + rank`` (for
            scripts that sample batches with ``torch.randint``; models still start identical).
        accumulate_grad_batches: micro-batches per optimizer step.
        global_batch_size, micro_batch_size: samples per optimizer step over all ranks, and per
            forward on one rank: the accumulation is ``global / (micro * world_size)``, worked
            out for the world size the job runs with; ``micro_batch_size`` is also the default
            ``batch_size`` of ``setup_dataloader``.
        step_at_loader_end: end an accumulation window with the pass of a gpukit loader (10
            batches with accumulation 4: steps after 4, 8 and 10); False carries the last
            micro-batches' gradients into the next epoch.
        sync_batchnorm: under DDP, compute BatchNorm statistics over the global batch.
        accelerator: "auto", "cpu", "cuda" or "mps".
        verbose: print (on rank 0) what was chosen.
        oom: out of memory in ``run_step``: None (propagates), "raise" (post-mortem, then
            StepOutOfMemoryError) or "backoff" (halve the micro-batch and retry).
        watch_memory: True or a step interval: ``watch_memory(every_n_steps)`` at start.
        record: a directory for the run record (per-step timings, ``session.log`` scalars, system
            samples, events; ``gpukit report DIR`` plots it); default ``GPUKIT_RECORD_DIR`` or none.
        timeout_s: how long a collective waits for a rank that stopped before it raises;
            default ``GPUKIT_TIMEOUT_S`` (``gpukit run --timeout``) or 1800.
        activation_checkpointing: recompute blocks' activations in backward instead of keeping
            them: True (every block), "selective" (every other block), a set of module classes
            or a callable ``(module, name) -> bool``; works with every strategy (see docs/memory.md).
        compile: True or a dict of ``torch.compile`` options: ``setup`` compiles the model the
            way the strategy needs (the DDP wrapper, each FSDP unit). A ``torch.compile(model)``
            given to ``setup`` is compiled the same way with its own settings, not dropped.
        fit: True (the GPU's free memory) or a budget per device ("20GiB"): ``setup(model,
            optimizer, example_input=x)`` plans and applies the precision, activation checkpointing
            and micro-batch left open (``session.fit_choice``; see docs/memory.md).
        log_with: experiment trackers for ``session.log``: "csv", "mlflow", "wandb", a list, or
            tracker objects (``gpukit.monitor.CSVTracker`` ...); rank 0 only (docs/run-records.md).
        peak_tflops: the device's dense peak TFLOP/s in the precision that runs, for MFU on a device
            gpukit's table lacks (CPUs included); default: the data sheet's (docs/sessions.md, "MFU and achieved TFLOP/s").
        flops_per_step: floating-point operations of one micro-batch's forward and backward on one
            process, when the model knows them; default: counted by torch on the second step.
        auto: the settings a GPU rewards, each printed once with its reason (``session.auto_settings``):
            bf16, tf32, fused_optimizer, channels_last, attention at setup; compile and cuda_graphs
            after the first steps are measured. False: none (docs/sessions.md, "Automatic settings").
        refuse: setting names to keep off, e.g. ``refuse=("compile", "channels_last")``.
        tensor_parallel, tensor_plan: split each layer over groups of that many processes (which see
            the same batch), with the plan found by structure or the given ``{name: ParallelStyle}``;
            ``strategy`` "ddp"/"fsdp" replicates/shards the groups (docs/sessions.md, "Tensor parallelism");
            ``tensor_parallel="auto"`` with ``fit``: the degree is chosen at setup (groups only where nothing
            fits without them; docs/memory.md).

    Attributes:
        (each argument above, as given), and the checked forms:
        watch_every_n_steps: ``watch_memory`` as a step interval, ``None``: no leak watching.
        compile_options: ``compile`` as ``torch.compile`` keyword arguments, ``None``: no compilation.
        auto_on, refused: ``auto`` and ``refuse`` checked: whether automatic settings are on, the names kept off.
        collective_timeout_s: ``timeout_s`` in seconds, ``None``: the launcher's or the default.

    Raises:
        ConfigurationError: a setting that is wrong whatever the machine (the message says what is allowed).
    """

    devices: Any = "auto"
    precision: str | Precision = "auto"
    strategy: str | Strategy = "auto"
    seed: int | None = None
    accumulate_grad_batches: int = 1
    sync_batchnorm: bool = False
    accelerator: str | Accelerator = "auto"
    verbose: bool = True
    oom: str | None = None
    watch_memory: bool | int = False
    record: str | os.PathLike[str] | None = None
    timeout_s: float | None = None
    activation_checkpointing: Any = None
    compile: bool | dict[str, Any] | None = None
    fit: bool | str | int | None = None
    seed_per_rank: bool = False
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    step_at_loader_end: bool = True
    log_with: Any = None
    peak_tflops: float | None = None
    flops_per_step: int | None = None
    auto: bool = True
    refuse: Iterable[str] = ()
    tensor_parallel: int | str = 1
    tensor_plan: dict[str, Any] | None = None
    # the checked forms (not arguments: a worker rebuilds them from the arguments)
    watch_every_n_steps: int | None = field(init=False, repr=False)
    compile_options: dict[str, Any] | None = field(init=False, repr=False)
    auto_on: bool = field(init=False, repr=False)
    refused: frozenset[str] = field(init=False, repr=False)
    collective_timeout_s: float | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_session_options(self.accumulate_grad_batches, self.seed)
        # before any set-up: a bad memory option must not leave a process group behind
        watch_every = check_memory_options(self.oom, self.watch_memory, self.sync_batchnorm)
        object.__setattr__(self, "watch_every_n_steps", watch_every)
        object.__setattr__(self, "compile_options", check_compile(self.compile))
        auto_on, refused = check_auto(self.auto, self.refuse)
        object.__setattr__(self, "auto_on", auto_on)
        object.__setattr__(self, "refused", refused)
        timeout_s = None if self.timeout_s is None else parse_timeout_s(self.timeout_s)
        object.__setattr__(self, "collective_timeout_s", timeout_s)
        check_tensor_auto(self)

    def arguments(self) -> dict[str, Any]:
        """The arguments as given, by name: ``Session(**config.arguments())`` builds an equal session."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def for_worker(self, worker: WorkerEnv) -> SessionConfig:
        """This config as the process ``worker`` describes runs it: ``gpukit run --cpu`` makes an
        ``accelerator="auto"`` the CPU (gloo, even where GPUs exist)."""
        if self.accelerator == "auto" and worker.cpu:
            return replace(self, accelerator="cpu")
        return self

    def tracked(self, **chosen: Any) -> dict[str, Any]:
        """What the trackers log with each run (the one list): every argument as a tracker can log it,
        then ``chosen`` (what the session made of them: the strategy, precision, world size ...)."""
        logged = {name: _plain(value) for name, value in self.arguments().items()}
        logged.update(chosen)
        return logged


def check_tensor_auto(config: SessionConfig) -> None:
    """``tensor_parallel="auto"``: only with ``fit`` (which chooses it), and without the settings fixed by
    the data-parallel size before the model is seen.

    Raises:
        ConfigurationError: another string, or "auto" without ``fit`` / with ``global_batch_size`` or
            ``oom="backoff"``.
    """
    given = config.tensor_parallel
    if not isinstance(given, str):
        return
    if given != "auto":
        raise ConfigurationError(f"Session(tensor_parallel={given!r}): give a whole number >= 1, or 'auto' with "
                                 "fit=... (the degree chosen at setup).")
    why = ("there is nothing that chooses it: add fit='20GiB' (or fit=True on a GPU), or give the degree"
           if config.fit in (None, False) else
           "global_batch_size is divided by the data-parallel size when the Session is built, before the degree "
           "is chosen: give micro_batch_size / accumulate_grad_batches instead, or the degree"
           if config.global_batch_size is not None else
           "oom='backoff' cannot split batches under tensor groups: use oom='raise' (or None), or give the degree"
           if config.oom == "backoff" else None)
    if why is not None:
        raise ConfigurationError(f"Session(tensor_parallel='auto'): {why} (tensor_parallel=2).")


def _plain(value: Any) -> Any:
    """A setting as a tracker can log it: plain values (and lists of them) as they are, else the type's name."""
    plain = (str, int, float, bool, type(None))
    if isinstance(value, plain):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
        return list(value)
    return type(value).__name__


def with_arguments(doc: str | None) -> str | None:
    """``doc`` (the Session's docstring) with its ``Args:`` section replaced by :class:`SessionConfig`'s,
    so each argument is documented once, with its type and check, and ``help(Session)`` still lists all.

    Raises:
        ValueError: ``doc`` or SessionConfig's docstring lacks the sections (a programming error).
    """
    own, config = doc, SessionConfig.__doc__
    if own is None or config is None:  # python -OO: no docstrings to join
        return doc
    start, end = own.find("    Args:\n"), own.find("    Raises:\n")
    args_start, args_end = config.find("    Args:\n"), config.find("    Attributes:\n")
    if min(start, end, args_start, args_end) < 0:
        raise ValueError("the Session's and SessionConfig's docstrings must have Args: and Raises: / Attributes:")
    return own[:start] + config[args_start:args_end] + own[end:]
