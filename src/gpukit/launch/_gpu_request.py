"""``GpuRequest``: which GPUs a run asks for, parsed once where it is given (``--gpus`` or ``gpus=``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpukit.errors import ConfigurationError

__all__ = ["GpuRequest"]

_GPU_FORMS = (
    "a count (--gpus 2), 'all', or a comma-separated list of GPU indices or UUIDs as "
    "`gpukit ls` shows them (--gpus 1,3; one GPU by index: --gpus 3,; by UUID: --gpus GPU-1a2b...)"
)
_MAX_DIGITS = 9  # int() of 5,000 digits raises; no machine has a billion GPUs


@dataclass(frozen=True)
class GpuRequest:
    """Which GPUs a run asks for, parsed once where it is given (``--gpus``, or ``gpus=`` from Python).

    One form at most: ``count`` (that many of the best free GPUs), ``every`` (every GPU of the
    machine) or ``ids`` (exactly those GPUs: indices or UUIDs); none of them is automatic
    (``nproc`` GPUs if the machine has any, else the CPU).
    """

    count: int | None = None
    every: bool = False
    ids: tuple[int | str, ...] = ()

    @property
    def automatic(self) -> bool:
        """No GPUs were asked for: the launcher decides."""
        return self.count is None and not self.every and not self.ids

    def __str__(self) -> str:
        """As ``--gpus`` takes it: ``2``, ``all``, ``1,3`` (``auto`` when automatic)."""
        if self.count is not None:
            return str(self.count)
        if self.every:
            return "all"
        if self.ids:
            return ",".join(map(str, self.ids)) + ("," if len(self.ids) == 1 else "")
        return "auto"

    @classmethod
    def parse(cls, text: str) -> GpuRequest:
        """Parse ``--gpus``: ``"2"``, ``"all"``, ``"1,3"``, ``"3,"`` (GPU 3), ``"GPU-<uuid>"``, ``"GPU-<uuid>,1"``.

        Raises:
            ConfigurationError: for anything else (zero GPUs included), naming the accepted forms.
        """
        value = text.strip()
        if value.lower() == "all":
            return cls(every=True)
        items = [item.strip() for item in value.split(",")]
        shown = text if len(text) <= 40 else text[:40] + "..."
        if any(item.isdigit() and (len(item) > _MAX_DIGITS or not item.isascii()) for item in items):
            raise ConfigurationError(f"--gpus {shown!r}: a GPU count or index is a whole number of at most "
                                     f"{_MAX_DIGITS} digits (--gpus 2, --gpus 1,3, or --gpus all).")
        if value.isdigit():
            return cls._count(int(value), f"--gpus {text!r}")
        if value.upper().startswith(("GPU-", "MIG-")) and "," not in value:
            return cls(ids=(value,))  # one GPU by UUID (a count needs no comma; a UUID is no count)
        if "," not in value or not any(items):
            raise ConfigurationError(f"Invalid --gpus {shown!r}: expected {_GPU_FORMS}.")
        parsed: list[int | str] = []
        for item in items:
            if not item:
                continue
            if item.isdigit():
                parsed.append(int(item))
            elif item.upper().startswith(("GPU-", "MIG-")):
                parsed.append(item)
            else:
                raise ConfigurationError(f"Invalid GPU {item!r} in --gpus {shown!r}: expected {_GPU_FORMS}.")
        return cls(ids=tuple(parsed))

    @classmethod
    def of(cls, value: GpuRequest | int | str | Sequence[int | str] | None) -> GpuRequest:
        """A ``gpus=`` argument from Python: ``None`` (automatic), a count, ``"all"`` or any
        ``--gpus`` text, or a sequence of GPU indices/UUIDs.

        Raises:
            ConfigurationError: a bool, a count below 1, an empty sequence or text that does not parse.
        """
        if isinstance(value, GpuRequest):
            return value
        if value is None:
            return cls()
        if isinstance(value, bool):
            raise ConfigurationError(f"Invalid gpus={value!r}: expected {_GPU_FORMS}.")
        if isinstance(value, int):
            return cls._count(value, f"gpus={value!r}")
        if isinstance(value, str):
            return cls.parse(value)
        ids = tuple(value)
        if not ids:
            raise ConfigurationError(f"Invalid gpus={value!r}: no GPU given; expected {_GPU_FORMS}.")
        return cls(ids=ids)

    @classmethod
    def _count(cls, count: int, shown: str) -> GpuRequest:
        # the one place a run is refused for asking for no GPU
        if count < 1:
            raise ConfigurationError(
                f"Invalid {shown}: a run needs at least 1 GPU. To run on the CPU use --cpu (cpu=True; "
                f"--nproc N for N processes); otherwise give {_GPU_FORMS}."
            )
        return cls(count=count)
