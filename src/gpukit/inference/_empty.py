"""Building a model without its weights: parameters on the meta device, buffers real.

A module's parameters are replaced by meta ones as they are registered, so none of them holds
memory for longer than its own construction; buffers (a rotary table computed in ``__init__``,
which no checkpoint holds) stay as the module made them. Hugging Face folders are built from their
``config.json`` the same way (``transformers`` is needed only then); a model id is looked up in the
local Hugging Face cache, never downloaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["build_empty", "empty_parameters", "model_folder"]

_lock_depth = [0]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Inside, every parameter a module registers is moved to the meta device at once."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        held = self._parameters.get(name)
        if held is not None and held.device.type != "meta":
            kind = type(held)
            self._parameters[name] = kind(held.to("meta"), requires_grad=held.requires_grad)

    _lock_depth[0] += 1
    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        _lock_depth[0] -= 1
        if _lock_depth[0] == 0:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_empty(model_or_factory: nn.Module | Callable[[], Any] | str | os.PathLike[str]) -> nn.Module:
    """The model with meta parameters: a module as given, a factory called, or a Hugging Face folder.

    Raises:
        ConfigurationError: the argument is none of these, or the factory returned no ``nn.Module``.
    """
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if isinstance(model_or_factory, (str, os.PathLike)):
        return _from_config(model_folder(model_or_factory))
    if not callable(model_or_factory):
        raise ConfigurationError(f"model_or_factory={model_or_factory!r}: expected an nn.Module, a function that "
                                 "builds one, or a Hugging Face model folder (with config.json).")
    with empty_parameters():
        built = model_or_factory()
    if not isinstance(built, nn.Module):
        raise ConfigurationError(f"The factory returned {type(built).__name__}, not a torch.nn.Module.")
    return built


def model_folder(name: str | os.PathLike[str]) -> Path:
    """A Hugging Face model folder: the path itself, or a model id already in the local Hugging Face
    cache (nothing is downloaded).

    Raises:
        ConfigurationError: neither a folder nor an id in the cache.
    """
    folder = Path(name)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ConfigurationError(f"{str(name)!r} is not a folder (and huggingface_hub, which finds model ids in the "
                                 "local cache, is not installed).") from None
    try:
        return Path(snapshot_download(str(name), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise ConfigurationError(f"{str(name)!r} is neither a model folder nor a model id in the local Hugging Face "
                                 f"cache ({type(exc).__name__}); download it first (huggingface-cli download "
                                 f"{name}) or give its folder.") from None


def _from_config(folder: Path) -> nn.Module:
    if not (folder / "config.json").is_file():
        raise ConfigurationError(f"{folder} has no config.json: give a Hugging Face model folder already on disk, "
                                 "or a factory that builds the model.")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigurationError(f"Building {folder} from its config.json needs transformers: pip install "
                                 "transformers, or pass a factory that builds the model.") from None
    config = AutoConfig.from_pretrained(folder)  # JSON only: no code from the folder (trust_remote_code off)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        raise ConfigurationError(
            f"{folder} holds a quantised model (config.json quantization_config, quant_method "
            f"{str(method)!r}): gpukit's inference loads weights stored as float32, float16 or bfloat16 (cast to "
            "dtype=...); bitsandbytes, GPTQ, AWQ, float8 and the other quantisation formats are not supported. Load it "
            "with transformers and its quantisation library, or use a float checkpoint of the model.")
    with empty_parameters():
        return AutoModelForCausalLM.from_config(config)
