"""Gathering values from every rank: ``all_gather`` that refuses unequal shapes, and
``gather_for_metrics``, which gives exactly the dataset's samples.

**Why.** 11 samples over 2 ranks: DistributedSampler repeats one so both ranks get 6, and a
plain gather of every rank's predictions has 12. And ``all_gather`` of tensors whose shapes differ
between ranks aborts the process inside gloo (``EnforceNotMet``, SIGABRT) or hangs under nccl.

**How.** Every gather starts with a small exchange of what each rank holds (shapes, dtypes, the
structure, and how many samples of the batch in hand are real, from the gpukit loader): every rank
then knows everything, so a value that cannot be gathered raises the same
:class:`~gpukit.errors.DistributedError` on every rank instead of a crash or a hang. Tensors are
padded to the largest shape, gathered, and cut back to each rank's own; per-sample rows (dim 0
equal to the batch's length) lose the padding repeats and, for a gpukit loader, are put back in the
epoch's order (rank ``r``'s ``p``-th sample is position ``p * W + r``), which without shuffling is
the dataset's order.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gpukit.errors import DistributedError

if TYPE_CHECKING:
    from gpukit.session._loaders import LoaderTracker
    from gpukit.strategies import Strategy

__all__ = ["all_gather_checked", "gather_for_metrics"]

_MAX_DIMS = 16
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + zlib.crc32(str(dtype).encode()) % 10_000


def _describe(tensor: torch.Tensor) -> torch.Tensor:
    """``[ndim, dtype, hash of the shape, dims...]`` in a fixed length, so describing is one small gather."""
    shape = tuple(tensor.shape)
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    return torch.tensor([len(shape), _dtype_code(tensor.dtype), zlib.crc32(repr(shape).encode()), *dims],
                        dtype=torch.int64, device=tensor.device)


def all_gather_checked(strategy: Strategy, value: torch.Tensor | float) -> torch.Tensor:
    """``strategy.all_gather(value)`` after every rank has checked that all shapes and dtypes agree.

    Raises:
        DistributedError: on every rank, when the ranks' shapes or dtypes differ (naming each).
    """
    tensor = strategy.as_tensor(value)
    if strategy.world_size == 1:
        return strategy.all_gather(tensor)
    described = strategy.all_gather(_describe(tensor))
    if not bool((described == described[0]).all()):
        shapes = strategy.all_gather_object((tuple(tensor.shape), str(tensor.dtype)))
        listing = "; ".join(f"rank {r}: shape {list(s)} {d}" for r, (s, d) in enumerate(shapes))
        raise DistributedError(
            f"session.all_gather needs the same shape and dtype on every rank; got {listing}. Pad to one "
            "shape first, or use session.gather_for_metrics(value), which pads, gathers and cuts back."
        )
    return strategy.all_gather(tensor)


# -- gather_for_metrics ----------------------------------------------------------------------------
def _flatten(value: Any, leaves: list[Any]) -> Any:
    """The structure of ``value`` (picklable, comparable) with its tensors appended to ``leaves``."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return "T"
    if isinstance(value, dict):
        return ("dict", list(value.keys()), [_flatten(v, leaves) for v in value.values()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, len(value), [_flatten(v, leaves) for v in value])
    raise TypeError(type(value).__name__)


def _rebuild(spec: Any, template: Any, leaves: list[Any]) -> Any:
    if spec == "T":
        return leaves.pop(0)
    if isinstance(template, dict):
        return type(template)({k: _rebuild(s, template[k], leaves) for k, s in zip(spec[1], spec[2])})
    items = [_rebuild(s, t, leaves) for s, t in zip(spec[2], template)]
    if hasattr(template, "_fields"):  # a namedtuple
        return type(template)(*items)
    return type(template)(items)


def _tensor_tree(value: Any) -> tuple[Any, list[torch.Tensor]] | None:
    leaves: list[torch.Tensor] = []
    try:
        return _flatten(value, leaves), leaves
    except TypeError:  # a leaf that is no tensor: gathered as objects
        return None


def gather_for_metrics(strategy: Strategy, loaders: LoaderTracker, value: Any, pad_index: Any = None) -> Any:
    """Every rank's ``value`` joined into the dataset's samples (see the module docstring).

    Args:
        strategy: the session's (its collectives).
        loaders: where the batch in hand came from (its padding repeats and order).
        value: a tensor (dim 0: samples), a nested dict/list/tuple of them, a list of per-sample
            objects (strings...), or any other picklable object (returned once per data-parallel rank:
            the ranks of a tensor group hold the same samples, which come back once).
        pad_index: pad dims after the first to the largest rank's with this value, so rows of
            different lengths (token sequences) can be joined; ``None``: they must agree.

    Raises:
        DistributedError: on every rank, for what cannot be joined (structures, dtypes or trailing
            dims that differ between ranks).
    """
    if strategy.data_parallel_size == 1:
        return value
    in_hand = loaders.samples_in_batch()  # (samples in the batch in hand, of them not repeats)
    keep = _data_parallel_ranks(strategy)
    tree = _tensor_tree(value)
    if tree is None and isinstance(value, dict):
        # tensors beside per-sample objects (a list of strings): each entry joined on its own
        keys = strategy.all_gather_object(list(value.keys()))
        if any(k != keys[0] for k in keys):
            listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            raise DistributedError(f"session.gather_for_metrics got dicts with different keys on each rank ({listing}).")
        return type(value)({k: gather_for_metrics(strategy, loaders, v, pad_index) for k, v in value.items()})
    if tree is None:
        return _gather_objects(strategy, value, in_hand, keep)
    spec, leaves = tree
    meta = strategy.all_gather_object((spec, [(tuple(t.shape), str(t.dtype)) for t in leaves], in_hand))
    meta = [meta[r] for r in keep]
    if any(m[0] != spec for m in meta):
        kinds = "; ".join(f"rank {r}: {_spec_text(m[0])}" for r, m in enumerate(meta))
        raise DistributedError(f"session.gather_for_metrics got a different structure on each rank ({kinds}).")
    ordered = all(m[2] is not None for m in meta)
    gathered = [_gather_leaf(strategy, t, i, [m[1][i] for m in meta], [m[2] for m in meta], ordered, pad_index,
                             keep) for i, t in enumerate(leaves)]
    return _rebuild(spec, value, gathered)


def _data_parallel_ranks(strategy: Strategy) -> list[int]:
    """One rank per data-parallel group, in data-parallel order: the ranks of a tensor group hold the
    same samples, which must come back once (tensor rank 0's)."""
    layout = strategy.layout
    return [r for r in range(strategy.world_size) if layout.tensor_rank(r) == 0]


def _spec_text(spec: Any) -> str:
    if spec == "T":
        return "tensor"
    return f"{spec[0]} of {len(spec[2])}"


def _gather_leaf(strategy: Strategy, tensor: torch.Tensor, index: int, shapes: list[tuple[tuple[int, ...], str]],
                 in_hand: list[Any], ordered: bool, pad_index: Any, keep: list[int]) -> torch.Tensor:
    dims = {len(s) for s, _ in shapes}
    dtypes = {d for _, d in shapes}
    where = f"session.gather_for_metrics (tensor #{index} of the value)"
    listing = "; ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(shapes))
    if len(dims) > 1 or len(dtypes) > 1:
        raise DistributedError(f"{where}: the ranks' tensors differ in number of dims or dtype ({listing}).")
    if dims == {0}:
        return strategy.all_gather(tensor)[keep]  # one value per data-parallel rank (a per-batch statistic)
    trailing = {s[1:] for s, _ in shapes}
    if len(trailing) > 1 and pad_index is None:
        raise DistributedError(
            f"{where}: rows of different lengths cannot be joined ({listing}). Pass pad_index= (e.g. "
            "-100 for labels, the tokenizer's pad id for tokens) to pad every dim after the first to the "
            "longest rank's."
        )
    largest = [max(s[d] for s, _ in shapes) for d in range(len(shapes[0][0]))]
    padding: list[int] = []
    for d in reversed(range(tensor.dim())):
        padding += [0, largest[d] - tensor.shape[d]]
    fill = pad_index if pad_index is not None else 0
    padded = F.pad(tensor, padding, value=fill) if any(padding) else tensor
    stacked = strategy.all_gather(padded.contiguous())[keep]  # [data-parallel ranks, rows, ...]
    rows = []
    for rank, (shape, _) in enumerate(shapes):
        batch = in_hand[rank]
        keep = shape[0]
        if batch is not None and shape[0] == batch[0]:  # one row per sample: the repeats go
            keep = batch[1]
        rows.append(keep)
    if pad_index is None:
        stacked = stacked[(slice(None), slice(None), *[slice(0, n) for n in largest[1:]])]
    if not ordered:  # not from a gpukit loader: rank after rank
        return torch.cat([stacked[r, :n] for r, n in enumerate(rows)])
    # position p of rank r is the epoch's p * W + r: row-major over (p, r) is the epoch's order
    world, most = stacked.shape[0], stacked.shape[1]
    interleaved = stacked.transpose(0, 1).reshape(most * world, *stacked.shape[2:])
    counts = torch.tensor(rows, device=stacked.device)
    valid = (torch.arange(most, device=stacked.device)[:, None] < counts[None, :]).reshape(-1)
    return interleaved[valid]


def _gather_objects(strategy: Strategy, value: Any, in_hand: Any, keep: list[int]) -> Any:
    """A list/tuple of per-sample objects joined like tensor rows; anything else: one per data-parallel rank."""
    meta = strategy.all_gather_object((value, in_hand))
    meta = [meta[r] for r in keep]
    values = [m[0] for m in meta]
    if not all(isinstance(v, (list, tuple)) for v in values):
        return values
    keep = []
    for v, batch in ((m[0], m[1]) for m in meta):
        keep.append(batch[1] if batch is not None and len(v) == batch[0] else len(v))
    if not all(m[1] is not None for m in meta):
        return [item for v, n in zip(values, keep) for item in list(v)[:n]]
    out = []
    for p in range(max(keep, default=0)):
        out.extend(v[p] for v, n in zip(values, keep) if p < n)
    return out
