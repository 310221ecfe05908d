"""``gpukit plan module:factory --batch-shape 64,3,32,32``: predicted training memory."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import warnings
from typing import Any, TextIO

import click

from gpukit._util.precision_names import PRECISIONS, precision_name
from gpukit.cli._common import MAX_BATCH, given_options
from gpukit.cli._plan_inference import check_mode
from gpukit.errors import ConfigurationError
from gpukit.layout import REGISTRY, plan_layout, plan_names

__all__ = ["plan"]

_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32")
#: what a single plan (no --fit) takes: the registered strategies of one device per process
_ONE_PLAN_STRATEGIES = [name for name, entry in REGISTRY.items()
                        if name in entry.plans and entry.placement in ("one-device", "per-process")]
_PLANNABLE = tuple(p for p in PRECISIONS if p != "auto")  # 'auto' depends on the GPU that will run it
_MAX_INPUT_NUMEL = 2**48  # elements of one input (1 PiB of fp32): more is a typo, and overflows torch's sizes
#: ``plan --fit`` when no configuration fits (what is missing is printed first), as ``gpukit select``'s
NOTHING_FITS_EXIT_CODE = 2


def _load_factory(target: str) -> object:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"Model {target!r}: expected 'module:factory', e.g. 'mymodels:resnet18'.")
    if module_name.endswith(".py") or not all(part.isidentifier() for part in module_name.split(".")):
        # a path: importing 'models.py' runs models.py and then fails, './models.py' raised TypeError
        stem = os.path.splitext(os.path.basename(module_name.replace("\\", "/")))[0] or "mymodels"
        raise ConfigurationError(f"Model {target!r}: {module_name!r} is not a module name (nothing was run); give "
                                 f"'module:factory' as Python imports it, e.g. '{stem}:{attr}' from the folder "
                                 "that holds the file.")
    if os.getcwd() not in sys.path:  # like `python -m`: modules in the working directory import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"Model {target!r}: cannot import {module_name!r} ({exc}).") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code failed as it was imported: one line, as a factory's
        raise ConfigurationError(f"Model {target!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}."
                                 ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigurationError(f"Model {target!r}: {module_name!r} has no callable {attr!r}.")
    return factory


def _build(target: str, factory: object) -> tuple[object, object]:
    """Call the factory: ``(model, example batch or None)``; its errors become one line naming it.

    The factory runs under ``torch.device("meta")`` first: the plan needs shapes, dtypes and the
    module tree, never values, and making a large model's weights costs seconds. A factory that
    cannot run there (it reads a value, loads a file, copies to a device) is called again as it
    is, and its errors are reported from that call."""
    import torch

    try:
        with warnings.catch_warnings(record=True) as said, torch.device("meta"):
            warnings.simplefilter("always")
            built = factory()  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - any failure on meta: run it as written (below), its warnings unsaid
        built = None
    if built is not None and _is_model(built):
        for w in said:  # the factory's own warnings, as a plain call would have given them
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        return _checked(target, built)
    try:
        built = factory()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
        tb, last = exc.__traceback__, None
        while tb is not None:  # the innermost frame outside this file: where the user's code failed
            if tb.tb_frame.f_code.co_filename != __file__:
                last = tb
            tb = tb.tb_next
        where = f" at {last.tb_frame.f_code.co_filename}:{last.tb_lineno}" if last is not None else ""
        raise ConfigurationError(
            f"Model {target!r}: {target.partition(':')[2]}() raised {type(exc).__name__}: {exc}{where} "
            "(gpukit plan calls the factory with no arguments)."
        ) from None
    return _checked(target, built)


def _is_pair(built: object) -> bool:
    """A (module, example inputs) pair."""
    import torch

    return isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)


def _is_model(built: object) -> bool:
    """A module, or a (module, inputs) pair: what a factory built on meta may be kept as."""
    import torch

    return isinstance(built, torch.nn.Module) or _is_pair(built)


def _checked(target: str, built: object) -> tuple[object, object]:
    """``(model, example batch or None)`` from what the factory returned, or a one-line error."""
    import torch

    example = None
    if _is_pair(built):
        built, example = built  # type: ignore[misc]  # (model, example inputs): a dict for model(**inputs), a tensor or a tuple
        if not isinstance(example, (dict, tuple, list, torch.Tensor)):
            raise ConfigurationError(f"{target!r} returned (model, {type(example).__name__}); the second item must be "
                                     "the example inputs: a dict of tensors (model(**inputs)), a tensor or a tuple.")
    if not isinstance(built, torch.nn.Module):
        raise ConfigurationError(f"{target!r} returned {type(built).__name__}, not a torch.nn.Module (or a "
                                 "(model, example_inputs) pair).")
    return built, example


def _shape(text: str, option: str = "--batch-shape") -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigurationError(f"{option} {text!r}: expected positive integers separated by commas, e.g. 64,3,32,32.")
    numel = math.prod(dims)
    if max(dims) > MAX_BATCH or numel > _MAX_INPUT_NUMEL:
        raise ConfigurationError(
            f"{option} {text!r}: {numel:.3g} elements is beyond any device (each dimension at most "
            f"{MAX_BATCH:,}, the whole input at most {_MAX_INPUT_NUMEL:.3g} elements); give the shape of one "
            "batch, e.g. 64,3,32,32.")
    return dims


def _keyword_input(text: str) -> tuple[str, tuple[int, ...], str]:
    """``--input input_ids=8,512:int64`` -> ("input_ids", (8, 512), "int64")."""
    name, sep, rest = text.partition("=")
    shape, _, dtype = rest.partition(":")
    if not sep or not name.isidentifier():
        raise ConfigurationError(f"--input {text!r}: expected NAME=SHAPE[:DTYPE], e.g. --input input_ids=8,512:int64 "
                                 "(NAME is the forward argument's name).")
    dtype = dtype or "float32"
    if dtype not in _DTYPES:
        raise ConfigurationError(f"--input {text!r}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}.")
    return name, _shape(shape, f"--input {name}="), dtype


def _visible_gpu_count() -> int:
    """``--strategy fsdp`` without ``--nproc``: shard over the GPUs visible here (said on stderr), or refuse."""
    import os

    from gpukit.devices import list_gpus, resolve_visible, silence_notice

    silence_notice()
    visible = len(resolve_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), list_gpus()))
    if visible < 1:
        raise ConfigurationError("--strategy fsdp shards the model over --nproc processes, and no GPU is visible "
                                 "here to count: give --nproc N (the number of GPUs the run will use).")
    click.echo(f"gpukit: planning FSDP over {visible} rank(s), the GPUs visible here; give --nproc N to plan for "
               "another count.", err=True)
    return visible


@click.command(short_help="Predict peak training memory of a model, without a GPU.")
@click.argument("model")
@click.option("--batch-shape", "shapes", multiple=True, help="Shape of one positional model input, e.g. 64,3,32,32 (repeat for several inputs).")
@click.option("--input", "keyword_inputs", multiple=True, metavar="NAME=SHAPE[:DTYPE]",
              help="A keyword input, e.g. input_ids=8,512:int64 (repeat: labels=8,512:int64); model(**inputs).")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(_DTYPES), help="dtype of each input (default float32; int64 for token ids).")
@click.option("--precision", default="32-true", show_default=True, help="Precision to plan for: 32-true, bf16-mixed, 16-mixed, bf16-true or 16-true (checked by gpukit.precision).")
@click.option("--optimizer", default="adam", show_default=True, type=click.Choice(["adam", "adamw", "sgd", "none"]))
@click.option("--device", default="cuda", show_default=True, help="Device type to plan for (no GPU is needed).")
@click.option("--strategy", type=click.Choice(_ONE_PLAN_STRATEGIES), default="single", show_default=True,
              help="fsdp: per-rank memory with parameters, gradients and optimizer state sharded over --nproc.")
@click.option("--nproc", type=click.IntRange(1, 1 << 20), default=None,
              help="Processes the model is sharded over (with --strategy fsdp) [default: the GPUs visible here].")
@click.option("--fit", "fit_memory", metavar="SIZE", default=None,
              help="Memory per device, e.g. 24GiB: rank the configurations that fit (precision, activation "
                   "checkpointing, strategy over --nproc devices, micro-batch) by predicted step time; exit "
                   "status 2 (after saying what is missing) when none fits.")
@click.option("--node-gpus", type=click.IntRange(1, 1 << 10), default=None,
              help="With --fit: GPUs of one node; tensor-parallel groups stay inside one [default: --nproc, all on "
                   "one node].")
@click.option("--jobs", type=click.IntRange(1, 256), default=None,
              help="With --fit: processes planning side by side (the same figures) [default: the CPUs this "
                   "process may use, at most 8].")
@click.option("--inference", is_flag=True, help="Plan inference instead: the units' placement over the GPUs, CPU "
              "RAM and disk, each device's peak, the tokens/s bound (see docs/inference.md).")
@click.option("--max-memory", "max_memory", multiple=True, metavar="DEVICE=SIZE",
              help="With --inference: a device's budget, e.g. cuda:0=20GiB, cpu=64GiB, disk=1TiB (repeat) "
                   "[default: what is free now, less a margin].")
@click.option("--prompt-len", type=click.IntRange(1, MAX_BATCH), default=None,
              help="With --inference: the prompt's length in tokens [default: --batch-shape's second number].")
@click.option("--new-tokens", type=click.IntRange(0, MAX_BATCH), default=0, help="With --inference: tokens generated.")
@click.option("--weights", default=None, metavar="int8|float8",
              help="With --inference: plan each nn.Linear weight stored quantised per output row (see docs/inference.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON.")
def plan(model: str, shapes: tuple[str, ...], keyword_inputs: tuple[str, ...], dtypes: tuple[str, ...], precision: str,
         optimizer: str, device: str, strategy: str, nproc: int | None, fit_memory: str | None,
         node_gpus: int | None, jobs: int | None, inference: bool, max_memory: tuple[str, ...],
         prompt_len: int | None, new_tokens: int, weights: str | None, as_json: bool) -> None:
    """Predict peak training memory of MODEL (a 'module:factory' returning an nn.Module).

    The inputs: --batch-shape (positional), --input NAME=SHAPE[:DTYPE] (keyword; a Hugging Face
    model given labels= is planned on its own loss), or a factory that returns
    (model, example_inputs). Nothing is allocated on the GPU: the step runs on fake tensors.
    """
    # Everything that needs no torch is checked before torch loads (it takes seconds).
    if shapes and keyword_inputs:
        raise ConfigurationError("Give the inputs either positionally (--batch-shape) or by name (--input NAME=SHAPE), "
                                 "not both.")
    named = [_keyword_input(text) for text in keyword_inputs]
    if len({n for n, _, _ in named}) != len(named):
        raise ConfigurationError(f"--input names one argument twice: {', '.join(n for n, _, _ in named)}.")
    if dtypes and keyword_inputs:
        raise ConfigurationError("--dtype goes with --batch-shape; with --input write the dtype in it: "
                                 "--input input_ids=8,512:int64.")
    if dtypes and len(dtypes) != len(shapes):
        raise ConfigurationError(f"Got {len(shapes)} --batch-shape but {len(dtypes)} --dtype; give one --dtype per input or none.")
    _check_precision(precision)
    if weights is not None and not inference:
        raise ConfigurationError(f"--weights {weights} goes with --inference (quantised weights for inference).")
    check_mode(inference)
    dims = [_shape(s) for s in shapes]
    budget = _fit_budget(fit_memory)
    if jobs is not None and budget is None:
        raise ConfigurationError(f"--jobs {jobs} goes with --fit SIZE (a single plan runs in one process).")
    if node_gpus is not None and budget is None:
        raise ConfigurationError(f"--node-gpus {node_gpus} goes with --fit SIZE (it bounds the tensor-parallel "
                                 "degrees --fit plans).")
    sharded = plan_layout(strategy, 2).shards > 1  # the strategy shards the model over --nproc
    if sharded and nproc is None and budget is None:
        nproc = _visible_gpu_count()
    factory = _load_factory(model)  # a typo in MODEL is reported before torch loads (unless the module imports it)

    import torch

    from gpukit.errors import MemoryPlanError
    from gpukit.memory import estimate_memory

    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigurationError(f"--device {device!r}: give a torch device type such as cuda, cpu or mps "
                                 "(no such device is needed: nothing is allocated).") from None
    dtype_names = dtypes or ("float32",) * len(shapes)
    built, example = _build(model, factory)
    if inference:  # forward-only placement (issue 40), in a module of its own
        from gpukit.cli._plan_inference import print_inference_plan

        print_inference_plan(built, example, dims, dtypes, max_memory, prompt_len, new_tokens, as_json, weights)
        return
    if example is not None and (shapes or named):
        raise ConfigurationError(f"{model!r} returns its own example inputs; drop --batch-shape/--input, or return "
                                 "the model alone.")
    if example is None and not (shapes or named):
        raise ConfigurationError("No inputs to plan with: give --batch-shape 64,3,32,32 (positional), --input "
                                 "NAME=SHAPE[:DTYPE] (keyword, e.g. input_ids=8,512:int64), or let the factory "
                                 "return (model, example_inputs).")
    with torch.device("meta"):  # only shapes and dtypes matter
        positional = [torch.empty(d, dtype=getattr(torch, t)) for d, t in zip(dims, dtype_names)]
        keywords = {n: torch.empty(d, dtype=getattr(torch, t)) for n, d, t in named}
    batch = example if example is not None else keywords or (
        positional[0] if len(positional) == 1 else tuple(positional))
    if budget is not None:  # a --precision or --strategy given restricts the ranking to it (it was ignored)
        given = given_options()
        _print_fit(built, batch, budget, nproc or 1, optimizer, device, jobs, as_json, node_gpus,
                   precision_name(precision, allowed=_PLANNABLE) if "precision" in given else None,
                   strategy if "strategy" in given else None)
        return
    try:
        estimate = estimate_memory(built, optimizer, batch, precision=precision, device=device)
    except MemoryPlanError as exc:
        if example is not None:
            raise MemoryPlanError(f"{exc} Inputs: the factory's example inputs.") from None
        given = ", ".join([f"{t}[{','.join(map(str, d))}]" for d, t in zip(dims, dtype_names)] +
                          [f"{n}={t}[{','.join(map(str, d))}]" for n, d, t in named])
        raise MemoryPlanError(f"{exc} Inputs given: {given}; check --batch-shape/--input and the dtypes "
                              "(token ids need int64).") from None
    if sharded:  # per rank: the units the Session's FSDP makes, sharded over nproc
        from gpukit.memory import fsdp_unit_numels, shard_estimate

        estimate = shard_estimate(estimate, nproc or 1, fsdp_unit_numels(built, estimate.precision))
    click.echo(json.dumps(estimate.to_dict(), indent=2) if as_json else str(estimate))


def _check_precision(text: str) -> None:
    """``--precision``, checked before torch loads: a name gpukit.precision takes, other than 'auto'."""
    if text.strip().lower() == "auto":
        raise ConfigurationError(f"--precision 'auto': plan for one of {', '.join(_PLANNABLE)} ('auto' depends "
                                 "on the GPU that will run it, so name the precision).")
    precision_name(text, allowed=_PLANNABLE, source="--precision")


class StatusLine:
    """One line of what is happening, redrawn in place on a terminal and wiped at the end (so
    what is printed after it starts on a clean line); nothing at all where ``stream`` is no
    terminal (a log, a pipe). No thread: it is drawn by the caller, between plans."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.on = stream.isatty()
        self.drawn = False

    def show(self, line: str) -> None:
        if self.on:  # cut to the terminal's width: a wrapped line would not be wiped whole
            line = line[: max(10, shutil.get_terminal_size().columns - 1)]
            self.stream.write(f"\r\x1b[K{line}")
            self.stream.flush()
            self.drawn = True

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _fit_budget(text: str | None) -> int | None:
    """``--fit SIZE`` in bytes (checked before torch loads)."""
    if text is None:
        return None
    from gpukit._util.units import parse_size

    budget = parse_size(text)
    if budget <= 0:
        raise ConfigurationError(f"--fit {text!r}: give the memory of one device, e.g. --fit 24GiB.")
    return budget


def _print_fit(model: object, batch: object, budget: int, devices: int, optimizer: str, device: str,
               jobs: int | None, as_json: bool, node_gpus: int | None = None, precision: str | None = None,
               strategy: str | None = None) -> None:
    """``gpukit plan --fit``: the ranked configurations (``gpukit.memory.fit``), with tensor-parallel
    groups inside one node of ``node_gpus`` (default: all ``devices``), or what is missing; ``precision``
    and ``strategy`` (given on the command line) restrict the ranking to them."""
    from dataclasses import asdict

    from gpukit.memory import FIT_PRECISIONS, available_workers, fit

    if precision is not None and precision not in FIT_PRECISIONS:
        raise ConfigurationError(f"--fit with --precision {precision}: --fit ranks {', '.join(FIT_PRECISIONS)}; give "
                                 "one of those, or leave --precision out to rank them all.")
    if strategy is not None and (plan_layout(strategy, 2).processes > 1) != (devices > 1):
        raise ConfigurationError(f"--fit with --strategy {strategy} and --nproc {devices}: {strategy} runs in "
                                 f"{'one process' if devices > 1 else '--nproc N >= 2 processes'}; fix --nproc, or "
                                 "leave --strategy out to rank every strategy.")
    # --nproc N asks for N processes: rank the layouts that run in N (one-process ones -- a pipeline
    # over N devices, one device -- are said to be left out, not ranked first)
    names = [name for name in plan_names() if devices == 1 or plan_layout(name, devices).processes == devices]
    left_out = [name for name in plan_names() if name not in names]
    if strategy is not None:
        names, left_out = [strategy], []
    with StatusLine(sys.stderr) as status:
        # the names leave out one-process layouts; the tensor groups of the per-process ones are added
        result = fit(model, batch, memory=budget, devices=devices, optimizer=optimizer,  # type: ignore[arg-type]
                     device=device, workers=jobs or available_workers(), progress=status.show, strategies=names,
                     tensor_parallel="auto", node_devices=node_gpus,
                     precisions=(precision,) if precision is not None else FIT_PRECISIONS)

    def described(option: Any) -> dict[str, Any]:
        return {**asdict(option), "strategy": option.strategy, "devices": option.devices,
                "tensor": option.layout.tensor, "session": option.session_line()}

    if as_json:
        click.echo(json.dumps({"memory_bytes": result.memory_bytes, "global_batch": result.global_batch,
                               "options": [described(o) for o in result.options],
                               "closest": described(result.closest) if result.closest else None,
                               "not_ranked": left_out,
                               "tensor": {"link_bytes_per_s": result.tensor_link_bytes_per_s,
                                          "node_gpus": node_gpus or devices, "degrees": list(result.tensor)}},
                              indent=2))
    else:
        click.echo(str(result))
        if left_out:
            click.echo(f"not ranked: {', '.join(left_out)} (they run in one process, and --nproc {devices} asks for "
                       f"{devices}; gpukit.memory.fit(model, example, memory=..., devices={devices}) ranks them too)")
    if not result.options:  # as `gpukit select` when no GPU qualifies: scripts can tell
        click.get_current_context().exit(NOTHING_FITS_EXIT_CODE)
