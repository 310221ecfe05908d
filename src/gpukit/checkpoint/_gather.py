"""Full tensors out of FSDP-sharded state before a one-file save (collective).

An FSDP2 model's ``state_dict()`` holds DTensors: each rank's shard. Written as they are by
rank 0, a file would hold rank 0's shards only (and DTensors, which ``weights_only`` loading
refuses) -- silent data loss. :func:`gather_sharded` replaces every sharded model (and every
DTensor) in the state with full tensors; every rank must call it, in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpukit._util.dtensor import full_tensor

__all__ = ["gather_sharded"]


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None  # FSDP2 needs a process group: without one nothing is sharded
    from torch.distributed.tensor import DTensor

    return DTensor


def gather_sharded(state: Any, *, everywhere: bool) -> Any:
    """``state`` with FSDP-sharded models and DTensors made full (a collective call).

    Args:
        state: what ``gpukit.save`` was given: a model, a state dict, or a nesting of them.
        everywhere: every rank gets the full tensors (each writes its own file); otherwise
            only rank 0 does (gathered straight to its CPU memory) and the others get empty
            state dicts.
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return state
    return _gather(state, dtensor, everywhere)


def _gather(state: Any, dtensor: type, everywhere: bool) -> Any:
    if isinstance(state, nn.Module):
        if not any(isinstance(p, dtensor) for p in state.parameters()):
            return state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from gpukit.checkpoint._prefixes import strip_wrapper_prefixes

        options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
        return strip_wrapper_prefixes(get_model_state_dict(state, options=options))
    if isinstance(state, dtensor):
        return full_tensor(state)  # an offloaded (CPU) DTensor of a CUDA mesh is gathered on the GPU, then back
    if isinstance(state, Mapping):
        items = ((k, _gather(v, dtensor, everywhere)) for k, v in state.items())
        out: dict[Any, Any] = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list):
        return [_gather(v, dtensor, everywhere) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(_gather(v, dtensor, everywhere) for v in state)
    return state
