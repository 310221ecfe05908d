"""The precision names gpukit accepts, and their aliases -- without torch.

:func:`gpukit.precision.get_precision` turns a name into a precision object; ``gpukit plan``
checks ``--precision`` here before torch loads (it takes seconds). One list for both.
"""

from __future__ import annotations

from collections.abc import Collection

from gpukit.errors import ConfigurationError

__all__ = ["PRECISIONS", "precision_name"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "auto")

#: unambiguous short names, accepted as other libraries (Lightning) accept them
_ALIASES = {
    "32": "32-true",
    "fp32": "32-true",
    "float32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
}

#: names that could mean either the mixed or the true variant: rejected with a suggestion
_DID_YOU_MEAN = {
    "fp16": "'16-mixed' (fp16 autocast, weights fp32) or '16-true' (weights fp16)",
    "float16": "'16-mixed' (fp16 autocast, weights fp32) or '16-true' (weights fp16)",
    "half": "'16-mixed' (fp16 autocast, weights fp32) or '16-true' (weights fp16)",
    "bfloat16": "'bf16-mixed' (bf16 autocast, weights fp32) or 'bf16-true' (weights bf16)",
    "mixed": "'bf16-mixed' or '16-mixed'",
    "amp": "'bf16-mixed' or '16-mixed'",
}


def precision_name(name: object, allowed: Collection[str] = PRECISIONS, *, source: str | None = None) -> str:
    """The canonical name of ``name`` (``"bf16"`` -> ``"bf16-mixed"``, ``32`` -> ``"32-true"``);
    ``source`` (``"--precision"``) names where it was given in the error.

    Raises:
        ConfigurationError: not one of ``allowed`` (ambiguous names such as ``"fp16"`` get a suggestion).
    """
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)  # precision=32 / 16 as in other libraries
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in allowed:
        hint = _DID_YOU_MEAN.get(key)
        fix = f" Did you mean {hint}?" if hint else ""
        given = f"Unknown precision {name!r}" if source is None else f"{source} {name!r} is not a precision"
        raise ConfigurationError(f"{given}; choose one of {', '.join(map(repr, allowed))}." + fix)
    return key
