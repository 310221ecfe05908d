"""``load_for_inference``: a model bigger than a device, built on meta, placed by the planner, its
weights read from the checkpoint straight to where the plan puts them, offloaded units streamed.

Order (nothing is read before the plan holds):

1. build the model with meta parameters (``_empty.py``);
2. plan (``plan_inference``): a workload that cannot fit is refused here, with its numbers;
3. open the checkpoint's headers (``gpukit.checkpoint.open_tensor_files``) and match every tensor of
   the model to one in the files (prefixes as ``load_state_dict`` handles them; shapes checked);
4. read each resident tensor into a tensor made on its device (at most one tensor in host memory
   beside the model: peak host memory stays near the largest tensor, not the model); CPU-RAM units
   of a GPU run into one pinned buffer each; disk units stay in the original file;
5. stream the offloaded units (``_stream.py``) and guard the workload (``_guard.py``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gpukit.accelerators import Accelerator, get_accelerator
from gpukit.checkpoint import TensorFiles, open_tensor_files
from gpukit._util.units import format_bytes
from gpukit.errors import CheckpointError, ConfigurationError
from gpukit.inference._bandwidth import read_bandwidth
from gpukit.inference._empty import build_empty, model_folder
from gpukit.inference._guard import install_guard
from gpukit.inference._hostmem import host_weights_buffer
from gpukit.inference._plan import InferencePlan, as_dtype, plan_inference
from gpukit.inference._quantized import QuantizedLinear, quantize_linear_weights, quantize_rows, weights_kind
from gpukit.inference._stream import StreamedTensor, StreamedUnit, UnitStreamer
from gpukit.memory import model_units, planned_dtype, unit_tensor_names

__all__ = ["InferenceRun", "load_for_inference"]


@dataclass
class InferenceRun:
    """What ``load_for_inference`` set up, as ``model.gpukit_inference``: the plan, the streamer,
    and the last ``generate``'s measured tokens/s beside the plan's bound."""

    plan: InferencePlan
    streamer: UnitStreamer | None = None
    files: TensorFiles | None = None  # open while disk units stream from them
    handles: list[Any] = field(default_factory=list)
    measured_tokens_per_s: float | None = None
    verbose: bool = False

    def timed_generate(self, generate: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        elapsed = time.perf_counter() - start
        sequences = getattr(out, "sequences", out)
        if isinstance(ids, torch.Tensor) and isinstance(sequences, torch.Tensor) and elapsed > 0:
            new = int(sequences.shape[-1]) - int(ids.shape[-1])
            self.measured_tokens_per_s = new / elapsed if new > 0 else None
            if self.verbose:
                print(self.summary(), file=sys.stderr)
        return out

    def summary(self) -> str:
        """``measured 3.1 tokens/s, bound 4.2 (74%)``."""
        bound = self.plan.tokens_per_s_bound
        measured = self.measured_tokens_per_s
        if measured is None:
            return "gpukit: no generate measured yet"
        share = f" ({measured / bound:.0%} of it)" if bound else ""
        return (f"gpukit: measured {measured:.3g} tokens/s, the plan's bound "
                f"{f'{bound:.3g}' if bound else 'n/a'}{share}")

    def close(self) -> None:
        """Stop streaming and remove gpukit's hooks (the model keeps its resident weights)."""
        if self.streamer is not None:
            self.streamer.close()
        if self.files is not None:
            self.files.close()
        for handle in self.handles:
            handle.remove()


def load_for_inference(
    model_or_factory: nn.Module | Callable[[], Any] | str | os.PathLike[str],
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    max_memory: Mapping[str | int, str | int] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    batch_size: int = 1,
    prompt_len: int | None = None,
    new_tokens: int = 0,
    dtype: torch.dtype | str | None = None,
    example_input: Any = None,
    prefetch: int = 1,
    trust: bool = False,
    verbose: bool = False,
    weights: str | None = None,
) -> nn.Module:
    """Load a model for inference over the devices' memory, streaming what does not fit.

    Args:
        model_or_factory: a module (best with meta parameters), a function that builds one (called with
            its parameters on meta), or a Hugging Face model folder or id already on disk (built from
            config.json; an id is found in the local Hugging Face cache, never downloaded).
        checkpoint: a safetensors or torch file, a folder of shards (with or without their index), or a
            gpukit sharded (DCP) step directory; default: the model folder.
        max_memory: budget per device, e.g. ``{"cuda:0": "20GiB", "cpu": "48GiB", "disk": "1TiB"}``;
            default: what is free now less a margin. Disk is used only when listed or ``offload_dir``
            is given.
        offload_dir: lets the plan use disk (disk units are read from the checkpoint file itself).
        batch_size, prompt_len, new_tokens: the workload of a generative (Hugging Face) model.
        dtype: the weights' dtype (default: the model's); disk units must already have it in the file.
        example_input: for a plain module: its largest input, defining the workload.
        prefetch: offloaded units read ahead of the one computing.
        trust: allow full unpickling of torch files (files you trust only).
        verbose: print the plan, and measured tokens/s against its bound after each ``generate``.
        weights: ``"int8"`` or ``"float8"`` (``torch.float8_e4m3fn``): each ``nn.Linear`` weight quantised
            as it is read (weight-only, one absmax scale per output row in ``dtype``; see
            ``gpukit.inference.quantize_linear_weights``), upcast per forward. ``None``: as ``dtype``.
            Quantised units are kept in memory (never on disk).

    Returns:
        The model, in eval mode, ready to call (``model.gpukit_inference`` holds the plan and figures).

    Raises:
        MemoryPlanError: the workload cannot fit (before anything is read).
        CheckpointError, UnsafeCheckpointError: a file cannot be read or would run code.
        StateDictMismatchError: the checkpoint does not hold the model's tensors.
        ConfigurationError: an argument that is not one, or ``weights=`` with a plan that needs disk.
    """
    weights_kind(weights)  # a bad value is refused before anything is built or read
    model = build_empty(model_or_factory)
    dtype = as_dtype(dtype, model)
    if weights is not None:  # on meta: shapes only; the values come from the checkpoint, quantised as read
        quantize_linear_weights(model, weights, dtype)
    if checkpoint is None:
        if not isinstance(model_or_factory, (str, os.PathLike)):
            raise CheckpointError("checkpoint=... is needed: the weights file or folder to load.")
        checkpoint = model_folder(model_or_factory)
    files = open_tensor_files(checkpoint, trust=trust)
    try:
        lists_disk = offload_dir is not None or any(str(k).strip().lower() == "disk" for k in (max_memory or {}))
        disk_speed = _disk_speed(files) if lists_disk else None  # a cold read of the checkpoint: only if needed
        plan = plan_inference(model, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype,
                              example_input=example_input, max_memory=max_memory, offload_dir=offload_dir,
                              prefetch=prefetch, disk_bytes_per_s=disk_speed, weights=weights)
        _refuse_quantized_on_disk(plan)
        if verbose:
            print(plan, file=sys.stderr)
        keys = files.keys_for(model)
        run = _materialize(model, files, keys, plan, prefetch)
    except BaseException:
        files.close()
        raise
    run.verbose = verbose
    if run.streamer is None:
        files.close()  # nothing is read from the files again
    else:
        run.files = files
    run.handles += install_guard(model, plan, example_input)
    model.gpukit_inference = run  # type: ignore[assignment]
    return model.eval()


def _refuse_quantized_on_disk(plan: InferencePlan) -> None:
    """Disk units are views of the checkpoint file, which holds float weights: quantised ones have no file."""
    on_disk = [unit for unit, place in plan.device_map.items() if place == "disk"]
    if plan.workload.weights is None or not on_disk:
        return
    disk_bytes = sum(plan.unit_bytes.get(unit, 0) for unit in on_disk)
    raise ConfigurationError(
        f"weights={plan.workload.weights!r}: the plan puts {len(on_disk)} unit(s) ({format_bytes(disk_bytes)} quantised) "
        "on disk, and quantised units are kept in memory only (disk units are read from the checkpoint file, which "
        f"holds the float weights). Give the memory they need (max_memory), or load without weights= to stream the "
        f"float weights from disk. The plan:\n{plan}")


def _disk_speed(files: TensorFiles) -> float | None:
    names = list(files.meta_tree())
    where = files.location(names[0]) if names else None
    return read_bandwidth(where[0], limit_bytes=64 * 2**20) if where is not None else None


def _holders(model: nn.Module, names: list[str]) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (module, attribute, is parameter) holding it, for the qualified ``names``."""
    out: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for qualified in names:
        owner_name, _, attr = qualified.rpartition(".")
        owner = model.get_submodule(owner_name)
        is_param = attr in owner._parameters
        tensor = owner._parameters[attr] if is_param else owner._buffers[attr]
        if tensor is not None:
            out.setdefault(id(tensor), []).append((owner, attr, is_param))
    return out


def _target_dtype(tensor: torch.Tensor, plan: InferencePlan) -> torch.dtype:
    return planned_dtype(tensor, plan.workload.dtype)


class _Reads:
    """Reads checkpoint tensors into their places; a quantised Linear's weight (``_quantized.py``) is
    read in the planned dtype into a transient tensor on its destination's device, quantised into its
    place, and its scales held until their own place is read (keyed ``<weight key>::scale``, always
    right after the weight: see :meth:`ordered`)."""

    SCALE = "::scale"

    def __init__(self, model: nn.Module, files: TensorFiles, keys: dict[int, str], dtype: torch.dtype) -> None:
        self.files = files
        self.dtype = dtype
        self.scale_of = {id(m.weight): m.weight_scale for m in model.modules() if isinstance(m, QuantizedLinear)}
        self.quantized = {keys[ident] for ident in self.scale_of if ident in keys}
        self._pending: dict[str, torch.Tensor] = {}
        for ident, scale in self.scale_of.items():
            if ident in keys:
                keys[id(scale)] = keys[ident] + self.SCALE

    def ordered(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``tensors`` with each quantised weight's scales right after it."""
        scales = {id(s) for s in self.scale_of.values()}
        out: dict[int, torch.Tensor] = {}
        for ident, tensor in tensors.items():
            if ident in scales:
                continue
            out[ident] = tensor
            if ident in self.scale_of:
                out[id(self.scale_of[ident])] = self.scale_of[ident]
        return out

    def read(self, key: str, dest: torch.Tensor) -> None:
        if key.endswith(self.SCALE):
            dest.copy_(self._pending.pop(key[:-len(self.SCALE)]))
            return
        if key not in self.quantized:
            self.files.read_into({key: dest})
            return
        stored = self.files.meta_tree()[key].dtype
        if not (stored.is_floating_point and stored.itemsize > 1):
            raise CheckpointError(
                f"{self.files.source}: {key!r} is stored as {stored}: weights= quantises float weights as it reads "
                "them; a pre-quantised checkpoint (int8/float8 values with their own scales) is not supported. Give "
                "a checkpoint with float weights (float32, float16, bfloat16).")
        full = torch.empty(dest.shape, dtype=self.dtype, device=dest.device)  # one transient float copy
        self.files.read_into({key: full})
        self._pending[key] = quantize_rows(full, dest, self.dtype)


def _materialize(model: nn.Module, files: TensorFiles, keys: dict[int, str], plan: InferencePlan,
                 prefetch: int) -> InferenceRun:
    names = unit_tensor_names(model, [n for n, _ in model_units(model)])
    execution = torch.device(plan.execution_device)
    accelerator = get_accelerator(execution)
    reads = _Reads(model, files, keys, plan.workload.dtype)
    streamed: list[StreamedUnit] = []
    on_host: list[StreamedTensor] = []  # resident on the host: laid out in one huge-page buffer
    # a resident tensor is made once for every name holding it, across units: a tied output head shares
    # the embedding's tensor (the plan counts it once and puts both units on one device)
    everywhere = _holders(model, [name for unit in plan.device_map for name in names.get(unit, [])])
    made: set[int] = set()
    for unit in [n for n in plan.device_map]:  # the forward's order
        place = plan.device_map[unit]
        holders = _holders(model, names.get(unit, []))
        tensors = reads.ordered({id(t): t for t in _unique(model, names.get(unit, []))})
        if place in ("cpu", "disk") and plan.execution_device != place:
            streamed.append(_streamed(unit, model, tensors, holders, keys, files, plan, place, accelerator, reads))
            continue
        device = torch.device(place)
        host = get_accelerator(device).is_host
        holders = everywhere
        for ident, tensor in tensors.items():
            if ident in made:
                continue
            made.add(ident)
            if ident not in keys:  # a buffer no checkpoint holds (a rotary table): it moves as it is
                _assign(holders[ident], tensor.to(device))
                continue
            if host:
                on_host.append(StreamedTensor(keys[ident], tuple(tensor.shape), _target_dtype(tensor, plan),
                                              holders=holders[ident]))
                continue
            dest = torch.empty(tensor.shape, dtype=_target_dtype(tensor, plan), device=device)
            reads.read(keys[ident], dest)
            _assign(holders[ident], nn.Parameter(dest, requires_grad=False) if holders[ident][0][2] else dest)
    _fill_host(reads, on_host)
    run = InferenceRun(plan)
    if streamed:
        run.streamer = UnitStreamer(streamed, execution, accelerator, lambda key, view: _read_view(files, key, view),
                                    prefetch, files.release)
    if len({d for d in plan.device_map.values()} - {"disk"} | {plan.execution_device}) > 1:
        run.handles += _align_devices(model, plan)
    return run


def _fill_host(reads: _Reads, parts: list[StreamedTensor]) -> None:
    """Read the host-resident tensors into one buffer in huge pages (``_hostmem.py``), one tensor at a time."""
    if not parts:
        return
    layout = StreamedUnit("", nn.Module(), parts)
    buffer = host_weights_buffer(layout.layout())
    for part in parts:
        dest = buffer[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
        reads.read(part.key, dest)  # converts the dtype where the plan's differs from the file's
        _assign(part.holders, nn.Parameter(dest, requires_grad=False) if part.holders[0][2] else dest)


def _unique(model: nn.Module, names: list[str]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for qualified in names:
        owner_name, _, attr = qualified.rpartition(".")
        owner = model.get_submodule(owner_name)
        tensor = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
        if tensor is not None:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _assign(holders: list[tuple[nn.Module, str, bool]], value: torch.Tensor) -> None:
    for module, attr, is_param in holders:
        (module._parameters if is_param else module._buffers)[attr] = value


def _read_view(files: TensorFiles, key: str, view: torch.Tensor) -> None:
    if files.location(key) is not None and view.is_contiguous() and view.device.type == "cpu":
        files.read_bytes_into(key, memoryview(view.reshape(-1).view(torch.uint8).numpy()))
    else:
        files.read_into({key: view})


def _streamed(unit: str, model: nn.Module, tensors: dict[int, torch.Tensor], holders: dict[int, Any],
              keys: dict[int, str], files: TensorFiles, plan: InferencePlan, place: str,
              accelerator: Accelerator, reads: _Reads) -> StreamedUnit:
    execution = torch.device(plan.execution_device)
    parts: list[StreamedTensor] = []
    for ident, tensor in tensors.items():
        if ident not in keys:  # not in the checkpoint: it stays resident on the execution device
            _assign(holders[ident], tensor.to(execution))
            continue
        dtype = _target_dtype(tensor, plan)
        meta = files.meta_tree()[keys[ident]] if place == "disk" else tensor
        if place == "disk" and (files.location(keys[ident]) is None or meta.dtype != dtype):
            raise CheckpointError(
                f"{unit} is placed on disk, and disk units are read from the checkpoint file as stored: "
                f"{keys[ident]!r} is {'stored as ' + str(meta.dtype) if meta.dtype != dtype else 'not one byte range'} "
                f"in {files.source}. Give dtype={meta.dtype} or export the weights as safetensors in the "
                "planned dtype (gpukit ckpt convert ... --dtype).")
        parts.append(StreamedTensor(keys[ident], tuple(tensor.shape), dtype, holders=holders[ident]))
    streamed = StreamedUnit(unit, model.get_submodule(unit) if unit else model, parts)
    if place == "disk" and accelerator.is_host:  # the host computes on the file's own pages
        views = {part.key: files.mapped(part.key) for part in parts}
        if all(v is not None for v in views.values()):
            streamed.mapped = views  # type: ignore[assignment]
    if place == "cpu":  # its bytes in one pinned host buffer, laid out as its slot
        size = streamed.layout()
        streamed.host = accelerator.pinned_empty((size,), torch.uint8)
        for part in parts:
            view = streamed.host[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
            reads.read(part.key, view)
    return streamed


def _align_devices(model: nn.Module, plan: InferencePlan) -> list[Any]:
    """Move each unit's inputs to where it runs, and the model's outputs back to where its inputs were."""
    handles = []
    for unit, place in plan.device_map.items():
        if not unit:
            continue
        device = torch.device(plan.execution_device if place in ("cpu", "disk") else place)

        def move(module: nn.Module, args: Any, kwargs: Any, device: torch.device = device) -> Any:
            to = (lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t)
            return tree_map(to, args), tree_map(to, kwargs)
        handles.append(model.get_submodule(unit).register_forward_pre_hook(move, with_kwargs=True))
    first: list[torch.device] = []

    def remember(module: nn.Module, args: Any, kwargs: Any) -> None:
        found = [t.device for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        first[:] = found[:1]

    def back(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if not first:
            return output
        return tree_map(lambda t: t.to(first[0]) if isinstance(t, torch.Tensor) else t, output)
    handles.append(model.register_forward_pre_hook(remember, with_kwargs=True))
    handles.append(model.register_forward_hook(back, with_kwargs=True))
    return handles
