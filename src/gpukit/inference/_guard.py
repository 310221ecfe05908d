"""Never out of memory on the first token: a request beyond the planned workload is refused before it runs.

The plan budgeted the KV cache and activations of ``batch_size`` sequences of ``prompt_len +
new_tokens`` tokens (or, for a plain module, inputs up to ``example_input``'s shape). A forward
pre-hook on the model compares every call with that -- batch, this call's tokens plus those already
in the cache -- and a Hugging Face model's ``generate`` is checked before it starts (prompt and
``max_new_tokens`` together), so a longer prompt than planned gets a :class:`WorkloadError` naming
both workloads and the fix, not an out-of-memory error half-way through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gpukit.errors import ConfigurationError

__all__ = ["WorkloadError", "install_guard"]


class WorkloadError(ConfigurationError):
    """A request is larger than the workload the model was placed for."""


def _fix(plan: Any) -> str:
    w = plan.workload
    return (f"load it again for the larger workload (load_for_inference(..., batch_size=, prompt_len=, "
            f"new_tokens=)); it was placed for batch {w.batch_size} x {w.tokens} tokens")


def _past_length(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "get_seq_length"):  # a Cache object (transformers 4.36+ and 5.x)
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0] \
            and isinstance(cache[0][0], torch.Tensor) and cache[0][0].dim() >= 2:
        return int(cache[0][0].shape[-2])  # 4.x's legacy tuple: layers x (key, value) of [batch, heads, tokens, dim]
    return 0


def install_guard(model: nn.Module, plan: Any, example_input: Any) -> list[Any]:
    """Check every call of ``model`` (and its ``generate``) against ``plan``'s workload; returns the hook handles."""
    w = plan.workload
    if example_input is not None:
        limits = [tuple(t.shape) for t in tree_leaves(example_input) if isinstance(t, torch.Tensor)]

        def check_plain(module: nn.Module, args: Any, kwargs: Any) -> None:
            given = [tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for shape, limit in zip(given, limits):
                if len(shape) != len(limit) or any(s > m for s, m in zip(shape, limit)):
                    raise WorkloadError(f"Input of shape {list(shape)} is larger than the planned {list(limit)}: "
                                        f"{type(module).__name__} was placed for example_input's sizes; load it "
                                        "again with a larger example_input.")
        return [model.register_forward_pre_hook(check_plain, with_kwargs=True)]

    def check(module: nn.Module, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            return
        batch, tokens = int(ids.shape[0]), int(ids.shape[1]) + _past_length(kwargs)
        if batch > w.batch_size or tokens > w.tokens:
            raise WorkloadError(f"A forward of batch {batch} x {tokens} tokens (cache included) is beyond the "
                                f"plan: {_fix(plan)}.")

    handles = [model.register_forward_pre_hook(check, with_kwargs=True)]
    generate = getattr(model, "generate", None)
    if callable(generate):
        def checked_generate(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
                new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
                if new is None:
                    length = kwargs.get("max_length", getattr(config, "max_length", None))
                    new = max(0, int(length) - int(ids.shape[1])) if length is not None else 0
                batch, prompt = int(ids.shape[0]), int(ids.shape[1])
                if batch > w.batch_size or prompt + int(new) > w.tokens:
                    raise WorkloadError(
                        f"generate(batch {batch}, prompt {prompt} tokens, max_new_tokens {new}) needs batch {batch} x "
                        f"{prompt + int(new)} tokens; {_fix(plan)} ({w.prompt_len} prompt + {w.new_tokens} new). "
                        "Give a shorter prompt, fewer new tokens or a smaller batch, or re-plan.")
            return plan_timer(model, generate, args, kwargs)
        model.generate = checked_generate  # type: ignore[method-assign]
    return handles


def plan_timer(model: nn.Module, generate: Any, args: Any, kwargs: Any) -> Any:
    """Run ``generate`` and record its measured tokens/s beside the plan's bound (``model.gpukit_inference``)."""
    run = getattr(model, "gpukit_inference", None)
    if run is None:
        return generate(*args, **kwargs)
    return run.timed_generate(generate, args, kwargs)
