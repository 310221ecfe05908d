"""``gpukit plan module:factory --batch-shape 64,3,32,32``: predicted training memory."""

from __future__ import annotations

import importlib
import json
import os
import sys

import click

from gpukit.errors import ConfigurationError

__all__ = ["plan"]

_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32")


def _load_factory(target: str) -> object:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"Model {target!r}: expected 'module:factory', e.g. 'mymodels:resnet18'.")
    if os.getcwd() not in sys.path:  # like `python -m`: modules in the working directory import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"Model {target!r}: cannot import {module_name!r} ({exc}).") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigurationError(f"Model {target!r}: {module_name!r} has no callable {attr!r}.")
    return factory


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigurationError(f"--batch-shape {text!r}: expected positive integers separated by commas, e.g. 64,3,32,32.")
    return dims


@click.command()
@click.argument("model")
@click.option("--batch-shape", "shapes", multiple=True, required=True, help="Shape of one model input, e.g. 64,3,32,32 (repeat for several inputs).")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(_DTYPES), help="dtype of each input (default float32; int64 for token ids).")
@click.option("--precision", default="32-true", show_default=True, help="Precision to plan for: 32-true, bf16-mixed, 16-mixed, bf16-true or 16-true (checked by gpukit.precision).")
@click.option("--optimizer", default="adam", show_default=True, type=click.Choice(["adam", "adamw", "sgd", "none"]))
@click.option("--device", default="cuda", show_default=True, help="Device type to plan for (no GPU is needed).")
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON.")
def plan(model: str, shapes: tuple[str, ...], dtypes: tuple[str, ...], precision: str, optimizer: str, device: str, as_json: bool) -> None:
    """Predict peak training memory of MODEL (a 'module:factory' returning an nn.Module).

    Nothing is allocated on the GPU: the step runs on fake tensors.
    """
    import torch

    from gpukit.memory import estimate_memory

    if dtypes and len(dtypes) != len(shapes):
        raise ConfigurationError(f"Got {len(shapes)} --batch-shape but {len(dtypes)} --dtype; give one --dtype per input or none.")
    built = _load_factory(model)()
    if not isinstance(built, torch.nn.Module):
        raise ConfigurationError(f"{model!r} returned {type(built).__name__}, not a torch.nn.Module.")
    with torch.device("meta"):  # only shapes and dtypes matter
        inputs = [torch.empty(_shape(s), dtype=getattr(torch, d)) for s, d in zip(shapes, dtypes or ("float32",) * len(shapes))]
    estimate = estimate_memory(built, optimizer, inputs[0] if len(inputs) == 1 else tuple(inputs), precision=precision, device=device)
    click.echo(json.dumps(estimate.to_dict(), indent=2) if as_json else str(estimate))
