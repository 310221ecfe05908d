"""Weight-only quantisation with plain torch ops: each ``nn.Linear``'s weight stored in int8 (or
float8 e4m3) with one absmax scale per output row, upcast to the compute dtype in every forward.

It saves memory, not time: a unit holds a quarter (from float32) or a half (from bfloat16) of its
Linear weights' bytes, and its forward makes one transient copy of a Linear's weight in the compute
dtype (``q.to(dtype) * scale[:, None]``) -- the planner's fake forward runs this same code, so the
copy is in the planned activations. No third-party kernel: what torch runs on every backend.

What is quantised: every module whose type is exactly ``nn.Linear`` (a subclass may read its
``weight`` from outside its forward, as ``nn.MultiheadAttention`` does with its ``out_proj``), except
one whose weight is shared with another module (a tied output head keeps the embedding's float
weight). Embeddings, norms and biases stay in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["QUANTIZED_WEIGHTS", "ROW_CHUNKS", "QuantizedLinear", "quantize_linear_weights", "quantize_rows", "weights_kind"]

#: ``weights=`` values -> the stored dtype and the largest magnitude it holds
QUANTIZED_WEIGHTS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),  # symmetric: -127..127, so the scale maps absmax exactly
    "float8": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),  # 448
}

#: ``quantize_rows`` works on a weight in this many slices of rows (bounds its scratch memory)
ROW_CHUNKS = 16


def weights_kind(weights: str | None) -> str | None:
    """``weights`` checked: ``None`` or a key of :data:`QUANTIZED_WEIGHTS`.

    Raises:
        ConfigurationError: another value.
    """
    if weights is None or (isinstance(weights, str) and weights in QUANTIZED_WEIGHTS):
        return weights
    raise ConfigurationError(
        f"weights={weights!r}: expected one of {', '.join(repr(k) for k in QUANTIZED_WEIGHTS)} (each nn.Linear weight "
        "stored quantised per output row, upcast per forward) or None (weights in the planned dtype). Other formats "
        "(int4, bitsandbytes, GPTQ, AWQ) are not supported.")


def quantize_rows(weight: torch.Tensor, out: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Quantise ``weight`` (2-D, floating) row by row into ``out`` (int8 or float8, same shape).

    Rows are worked on in float32, :data:`ROW_CHUNKS` slices at a time, so the work beside ``weight``
    and ``out`` is a sixteenth of a float32 copy (each row's result does not depend on the slicing).

    Args:
        weight: the float weight (its values as the model computes with them).
        out: where the quantised values go (its dtype says the format).
        scale_dtype: the compute dtype; the scale is rounded to it first, and the values divided by
            that rounded scale, so dequantising reproduces them as closely as the format allows.

    Returns:
        The scales, one per row, in ``scale_dtype`` on ``weight``'s device.
    """
    limit = next(m for d, m in QUANTIZED_WEIGHTS.values() if d == out.dtype)
    scale = torch.empty(weight.shape[0], dtype=scale_dtype, device=weight.device)
    step = max(1, -(-weight.shape[0] // ROW_CHUNKS))
    with torch.no_grad():
        for start in range(0, weight.shape[0], step):
            rows = weight[start:start + step].float()
            absmax = rows.abs().amax(dim=1)
            part = torch.where(absmax > 0, absmax / limit, torch.ones_like(absmax)).to(scale_dtype)
            values = rows / part.float().unsqueeze(1)
            if out.dtype == torch.int8:
                values.round_()
            out[start:start + step].copy_(values.clamp_(-limit, limit))  # float8: the cast rounds to nearest
            scale[start:start + step] = part
    return scale


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with its weight stored quantised per output row (see the module docstring).

    Attributes:
        weight: the quantised values (int8 or float8), ``[out_features, in_features]``, a parameter so
            checkpoints and placement see it under the Linear's own name.
        weight_scale: one scale per output row in the compute dtype (a non-persistent buffer: it is
            made from the weight when quantised, never read from a checkpoint).
        bias: as the Linear had it.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(self.weight_scale.dtype)  # the one transient copy of this weight
        weight.mul_(self.weight_scale.unsqueeze(1))
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={str(self.weight.dtype).replace('torch.', '')}")


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held under more than one name (tied)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {ident for ident, count in seen.items() if count > 1}


def quantize_linear_weights(model: nn.Module, weights: str, dtype: torch.dtype | None = None) -> list[str]:
    """Replace, in place, each ``nn.Linear`` of ``model`` by a :class:`QuantizedLinear`.

    A Linear on the meta device gets meta tensors (shapes and dtypes only: ``load_for_inference``
    fills them from the checkpoint); one with values is quantised from them. Already quantised
    modules are left as they are.

    Args:
        model: the model (changed in place).
        weights: ``"int8"`` or ``"float8"`` (``torch.float8_e4m3fn``).
        dtype: the compute dtype, the scales' dtype (default: each Linear's weight dtype).

    Returns:
        The qualified names of the modules replaced.

    Raises:
        ConfigurationError: ``weights`` is not a supported format.
    """
    kind = weights_kind(weights)
    if kind is None:  # None means "no quantisation" for load_for_inference; here it is a mistake
        raise ConfigurationError(
            "quantize_linear_weights(weights=None): expected 'int8' or 'float8'; to keep the weights as they "
            "are, do not call it")
    stored = QUANTIZED_WEIGHTS[kind][0]
    shared = _shared_weights(model)
    chosen = [(name, module) for name, module in model.named_modules()
              if name and type(module) is nn.Linear and id(module.weight) not in shared]
    for name, linear in chosen:
        compute = dtype or linear.weight.dtype
        device = linear.weight.device
        if device.type == "meta":
            q = torch.empty(linear.weight.shape, dtype=stored, device=device)
            scale = torch.empty(linear.out_features, dtype=compute, device=device)
        else:
            q = torch.empty(linear.weight.shape, dtype=stored, device=device)
            scale = quantize_rows(linear.weight.detach().to(compute), q, compute)
        bias = linear.bias.detach().to(compute) if linear.bias is not None and device.type != "meta" else linear.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, QuantizedLinear(q, scale, bias))
    return [name for name, _ in chosen]
