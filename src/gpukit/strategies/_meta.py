"""Models built on the meta device (``with torch.device("meta"): model = Net()``): allocated and
initialised where they will run, by the model's own initialisers.

Every strategy takes such a model. FSDP allocates it shard by shard after ``fully_shard`` (no rank
ever holds the whole model); every other strategy allocates it on its device before wrapping
(the pipeline on the CPU, before its stages move). Either way :func:`materialise`:

1. allocates every parameter and buffer (``to_empty``), and ties again the parameters that were
   shared (``to_empty`` would leave an output layer tied to its embedding untied);
2. fills the floating-point ones with NaN, so a tensor nothing initialises is found, not trained;
3. initialises each module that holds tensors: with the model's ``_init_weights(module)`` when the
   model has one (Hugging Face models: their own scheme, rotary-embedding buffers included), then
   with the module's ``reset_parameters()`` (``_reset_parameters`` for ``nn.MultiheadAttention``)
   where that left it uninitialised;
4. refuses, naming them, the tensors still NaN: a module with tensors and no initialiser.

The values are then the model's own initialisation (other random draws than a CPU-built model's);
load real weights afterwards -- ``session.resume``, ``gpukit.load_state_dict`` or a Hugging Face
checkpoint's state dict -- to start from them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["has_meta_tensors", "materialise"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP (DTensor) parameter; the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _reset_of(module: nn.Module) -> Any:
    # nn.MultiheadAttention names its initialiser _reset_parameters
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    return None


def _shared(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (owner, name) that hold one parameter (tied weights)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((sub, name))
    return [group for group in holders.values() if len(group) > 1]


def _uninitialised(tensor: torch.Tensor) -> bool:
    local = _local(tensor)
    return local.is_floating_point() and local.numel() > 0 and bool(torch.isnan(local).any())


def materialise(module: nn.Module, device: torch.device, *, rank: int = 0) -> None:
    """Allocate ``module``'s meta tensors on ``device`` and initialise them (see the module docstring).

    Args:
        module: the model (FSDP: already sharded).
        device: where its tensors go.
        rank: this process's rank; on the CPU each rank draws from ``initial_seed() + rank``, as
            DTensor has no per-shard random stream there (shards would otherwise repeat each other).

    Raises:
        ConfigurationError: a module with parameters or buffers that nothing initialised.
    """
    ties = _shared(module)
    module.to_empty(device=device)
    for group in ties:
        owner, name = group[0]
        for other, other_name in group[1:]:
            setattr(other, other_name, getattr(owner, name))
    holders = [sub for sub in module.modules() if _own_tensors(sub)]
    with torch.no_grad():
        for sub in holders:
            for _, tensor in _own_tensors(sub):
                if _local(tensor).is_floating_point():
                    _local(tensor).fill_(float("nan"))
    init_weights = getattr(module, "_init_weights", None)  # a Hugging Face PreTrainedModel's scheme
    sharded = any(hasattr(p, "to_local") for p in module.parameters())
    with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        if sharded and device.type == "cpu":
            torch.manual_seed(torch.initial_seed() + rank)
            warnings.filterwarnings("ignore", "DTensor random operators")
        for sub in holders:
            if callable(init_weights):
                init_weights(sub)
            reset = _reset_of(sub)
            if reset is not None and any(_uninitialised(t) for _, t in _own_tensors(sub)):
                reset()
    missing = [f"{name or type(module).__name__}.{tensor_name}" for name, sub in module.named_modules()
               for tensor_name, tensor in _own_tensors(sub) if _uninitialised(tensor)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigurationError(
            f"The model was built on the meta device, but nothing initialises {shown} after allocation: "
            "their module has no reset_parameters() (and the model no _init_weights). Give that module a "
            "reset_parameters() that fills them, create only the parameters on the meta device (its buffers "
            "on the CPU), or build the model on the CPU."
        )
