"""What loader tuning measures and decides: settings, trials, the result (with its cache entry)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpukit.data._loader_settings import LoaderSettings
from gpukit.data._tune_cache import RETUNE_ENV, _forget_cache, cache_file

__all__ = ["DEFAULT_TUNE_BUDGET_S", "Trial", "TuneResult"]

#: total measuring time of one tuning (worker start-ups add to it); GPUKIT_TUNE_BUDGET_S sets it
DEFAULT_TUNE_BUDGET_S = 6.0


@dataclass(frozen=True)
class Trial:
    """One measured candidate: batches/s after start-up (``None``: no batch came in time);
    ``measured_s``: the time spent measuring it after its first batch (what the budget counts)."""

    settings: LoaderSettings
    batches_per_s: float | None
    startup_s: float
    batches: int
    measured_s: float = 0.0


@dataclass(frozen=True)
class TuneResult:
    """What tuning tried and chose.

    Attributes:
        settings: the chosen settings.
        trials: every measured candidate, in the order tried (empty when from the cache).
        elapsed_s: time tuning took.
        from_cache: the settings came from an earlier run's tuning on this machine.
        key: the cache key (dataset fingerprint, batch size, machine).
        complete: every candidate the search wanted was measured. ``False`` when the time
            budget ran out first: the best measured is used for this run and not cached.
        budget_s: the measuring budget it ran under.
        batches_per_s: the loader speed the chosen settings were measured at (``None``: unknown).
    """

    settings: LoaderSettings
    trials: tuple[Trial, ...]
    elapsed_s: float
    from_cache: bool
    key: str
    complete: bool = True
    budget_s: float = DEFAULT_TUNE_BUDGET_S
    batches_per_s: float | None = None

    @property
    def cache_path(self) -> Path:
        """The cache file the result was read from or written to."""
        return cache_file()

    def forget(self) -> None:
        """Drop this result's cache entry, so the next run measures again."""
        _forget_cache(self.key)

    def report(self) -> str:
        """Lines for the user: each trial, then the choice (and where it is cached)."""
        if self.from_cache:
            return (f"gpukit: loader settings from the tuning cache ({self.cache_path}): {self.settings} "
                    f"(measured on an earlier run; {RETUNE_ENV}=1 measures again)")
        lines = [f"gpukit: loader tuning ({self.elapsed_s:.1f} s):"]
        for t in self.trials:
            rate = f"{t.batches_per_s:8.1f} batches/s" if t.batches_per_s else "  no batches in time"
            lines.append(f"  {rate}  start-up {t.startup_s:5.2f} s  {t.settings.short()}")
        if not self.complete:
            lines.append(
                f"  incomplete: the {self.budget_s:g} s budget ran out before every candidate was measured "
                f"(a busy machine, or slow batches); using the best measured for this run only, not "
                f"cached. Give it more time: GPUKIT_TUNE_BUDGET_S={max(4 * self.budget_s, 30):g}"
            )
            lines.append(f"  using {self.settings}")
        else:
            lines.append(f"  chose {self.settings} (cached in {self.cache_path}; {RETUNE_ENV}=1 measures again)")
        return "\n".join(lines)
