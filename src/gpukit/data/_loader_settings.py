"""The DataLoader settings loader tuning chooses among (measured by ``_tune``, cached by ``_tune_cache``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LoaderSettings"]


@dataclass(frozen=True)
class LoaderSettings:
    """DataLoader settings tuning chooses among."""

    num_workers: int
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader``."""
        kwargs: dict[str, Any] = dict(num_workers=self.num_workers, pin_memory=self.pin_memory)
        if self.num_workers:
            kwargs["prefetch_factor"] = self.prefetch_factor or 2
            kwargs["persistent_workers"] = self.persistent_workers
        return kwargs

    def short(self) -> str:
        """The measured part of the settings (persistence changes start-ups, not batches/s)."""
        text = f"num_workers={self.num_workers}"
        if self.num_workers:
            text += f", prefetch_factor={self.prefetch_factor or 2}"
        return text + (", pin_memory=True" if self.pin_memory else "")

    def __str__(self) -> str:
        text = f"num_workers={self.num_workers}, pin_memory={self.pin_memory}"
        if self.num_workers:
            text += (f", prefetch_factor={self.prefetch_factor or 2}, "
                     f"persistent_workers={self.persistent_workers}")
        return text
