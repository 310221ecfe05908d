"""``gpukit plan MODULE:FACTORY --inference --batch-shape B,S [--max-memory DEVICE=SIZE ...]``: where each
unit of the model goes for inference, each device's predicted peak and the tokens/s bound, without
loading anything (the model is built on meta; ``gpukit.inference.plan_inference`` does the work).

For a Hugging Face model (its config says the layers and heads) ``--batch-shape B,S`` is the batch and
the prompt's length (``--prompt-len`` overrides S), ``--new-tokens`` the tokens generated; for a plain
module ``--batch-shape`` is its input (in the weights' ``--dtype``), or the factory returns
``(model, example_inputs)``; ``--weights int8`` (or ``float8``) plans the Linear weights quantised. A
workload that cannot fit is refused with its numbers (exit status 2).
"""

from __future__ import annotations

import json
from typing import Any

import click

from gpukit.cli._common import given_options
from gpukit.errors import ConfigurationError

__all__ = ["check_mode", "parse_max_memory", "print_inference_plan"]

_WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


#: options of one mode only: given in the other they were ignored without a word
_TRAINING_ONLY = {"fit_memory": "--fit", "precision": "--precision", "optimizer": "--optimizer",
                  "strategy": "--strategy", "nproc": "--nproc"}
_INFERENCE_ONLY = {"max_memory": "--max-memory", "prompt_len": "--prompt-len", "new_tokens": "--new-tokens"}


def check_mode(inference: bool) -> None:
    """Refuse an option of the other mode (training plan or ``--inference``) given on the command line."""
    named = given_options()
    given = [flag for name, flag in (_TRAINING_ONLY if inference else _INFERENCE_ONLY).items() if name in named]
    if given and inference:
        raise ConfigurationError(f"{', '.join(given)}: training options, which --inference does not use; drop them "
                                 "(--inference places the model within --max-memory DEVICE=SIZE budgets).")
    if given:
        raise ConfigurationError(f"{', '.join(given)}: inference options, which only --inference uses; add "
                                 "--inference, or drop them.")


def parse_max_memory(items: tuple[str, ...]) -> dict[str, int] | None:
    """``("cuda:0=20GiB", "cpu=64GiB")`` -> ``{"cuda:0": ..., "cpu": ...}``; ``None`` for no items."""
    from gpukit._util.units import parse_size

    if not items:
        return None
    out: dict[str, int] = {}
    for item in items:
        device, sep, size = item.partition("=")
        device = device.strip().lower()
        if not sep or not device or not size:
            raise ConfigurationError(f"--max-memory {item!r}: expected DEVICE=SIZE, e.g. --max-memory cuda:0=20GiB "
                                     "(devices: cuda:N, cpu, disk).")
        if device in out:
            raise ConfigurationError(f"--max-memory names {device!r} twice; give each device once.")
        out[device] = parse_size(size)
    return out


def print_inference_plan(model: Any, example: Any, dims: list[tuple[int, ...]], dtypes: tuple[str, ...],
                         max_memory: tuple[str, ...], prompt_len: int | None, new_tokens: int, as_json: bool,
                         weights: str | None = None) -> None:
    """Plan and print (see the module docstring); ``weights`` (``--weights int8|float8``): each
    ``nn.Linear`` weight planned quantised (``gpukit.inference.plan_inference(weights=)``).

    Raises:
        ConfigurationError: options that do not describe one workload.
        MemoryPlanError: the workload does not fit (what would fit is in the message).
    """
    import torch

    from gpukit.inference import plan_inference
    from gpukit.memory import kv_shape

    budget = parse_max_memory(max_memory)
    if len(dtypes) > 1 or (dtypes and dtypes[0] not in _WEIGHT_DTYPES):
        raise ConfigurationError(f"--dtype with --inference is the weights' dtype, once: one of "
                                 f"{', '.join(_WEIGHT_DTYPES)} (got {', '.join(dtypes)}).")
    dtype = getattr(torch, dtypes[0]) if dtypes else None
    generative = kv_shape(model) is not None
    if generative and example is None:
        if len(dims) != 1 or len(dims[0]) != 2:
            raise ConfigurationError("--inference for a generative model takes --batch-shape BATCH,PROMPT_LEN "
                                     "(e.g. --batch-shape 8,2048), once.")
        batch, prompt = dims[0]
        plan = plan_inference(model, batch_size=batch, prompt_len=prompt_len or prompt, new_tokens=new_tokens,
                              dtype=dtype, max_memory=budget, weights=weights)
    else:
        if prompt_len is not None or new_tokens:
            raise ConfigurationError(f"--prompt-len/--new-tokens describe a generative model's workload; "
                                     f"{type(model).__name__} has no config saying its layers and heads, so its "
                                     "--batch-shape (or the factory's example inputs) is the workload.")
        if example is None:
            if not dims:
                raise ConfigurationError("--inference needs --batch-shape (the input at its planned size).")
            with torch.device("meta"):
                inputs = [torch.empty(d, dtype=dtype or torch.float32) for d in dims]
            example = inputs[0] if len(inputs) == 1 else tuple(inputs)
        plan = plan_inference(model, example_input=example, dtype=dtype, max_memory=budget, weights=weights)
    click.echo(json.dumps(plan.to_dict(), indent=2, default=str) if as_json else str(plan))
