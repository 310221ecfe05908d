"""Helpers shared by the commands (no torch import: ``ls`` and ``select`` use them).

Every option is read by one validator per kind, so a bad value is one usage line
(``gpukit: error: Invalid value for '--grace': ...``, exit 2) before anything starts:

* numbers: :class:`FiniteFloatRange` (``nan`` and ``inf`` pass click's own ``FloatRange``, since
  every comparison with NaN is false) and ``click.IntRange`` with both bounds (huge integers would
  reach torch or ``time.sleep`` and fail there with a traceback);
* durations: :class:`FiniteFloatRange` in seconds, and :func:`parse_wait_seconds` for ``--wait``;
* paths: :class:`NonEmptyPath` (``--record ''`` would record into the current directory);
* names: :class:`Name` (``--signal ''`` would silently mean the default) and :class:`HostName`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import click

from gpukit._util.units import parse_size
from gpukit.errors import ConfigurationError

__all__ = [
    "FiniteFloatRange",
    "given_options",
    "NonEmptyPath",
    "Name",
    "HostName",
    "WAIT_NO_LIMIT",
    "MAX_DURATION_S",
    "MAX_NPROC",
    "MAX_SEED",
    "MAX_BATCH",
    "parse_size_option",
    "parse_wait_seconds",
]

#: longest duration an option accepts (~116 days); beyond it ``time.sleep`` and friends overflow
MAX_DURATION_S = 10_000_000
#: torch.manual_seed takes 64-bit seeds; 2**63 - 1 keeps seed + rank / + epoch in range
MAX_SEED = 2**63 - 1
#: largest batch dimension or batch size an option accepts (torch indexes with int64)
MAX_BATCH = 2**31 - 1
#: bound on process and GPU counts, so huge integers never reach the launcher (whose own cap,
#: ``GPUKIT_MAX_NPROC``, relates --nproc to the machine)
MAX_NPROC = 1 << 20
#: what a bare ``--wait`` (no TIMEOUT) stands for; a NUL cannot come from the command line
WAIT_NO_LIMIT = "\x00no-limit"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class FiniteFloatRange(click.FloatRange):
    """A ``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which ``FloatRange`` lets through)."""

    def __init__(self, min: float | None = None, max: float | None = MAX_DURATION_S, *,
                 min_open: bool = False, unit: str = "seconds") -> None:
        super().__init__(min=min, max=max, min_open=min_open)
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of {self.unit}; give a number in the range "
                      f"{self._describe_range()}.", param, ctx)
        return super().convert(number, param, ctx)


def parse_size_option(option: str, value: str | None) -> int | None:
    """``--min-free 8GiB`` -> bytes; a bad value is an error that names the option."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{option}: {exc}") from None


def parse_wait_seconds(value: str) -> float:
    """``--wait TIMEOUT`` -> seconds; :data:`WAIT_NO_LIMIT` (a bare ``--wait``) -> ``inf``.

    A TIMEOUT must be a finite number of seconds from 0 to :data:`MAX_DURATION_S`: ``inf``,
    ``1e309``, NaN, negatives and absurd values are usage errors that say which.
    """
    if value == WAIT_NO_LIMIT:
        return math.inf
    fix = f"give seconds from 0 to {MAX_DURATION_S:,} (e.g. --wait 600), or --wait alone to wait without limit."
    try:
        seconds = float(value)
    except ValueError:
        raise click.UsageError(f"--wait {value!r} is not a number of seconds: {fix}") from None
    if math.isnan(seconds) or math.isinf(seconds):
        raise click.UsageError(f"--wait {value!r}: a timeout must be a finite number; {fix}")
    if seconds < 0:
        raise click.UsageError(f"--wait {value!r}: a timeout cannot be negative; {fix}")
    if seconds > MAX_DURATION_S:
        raise click.UsageError(f"--wait {value!r}: {seconds:.3g} s is longer than any run (at most "
                               f"{MAX_DURATION_S:,} s, ~116 days); {fix}")
    return seconds


class NonEmptyPath(click.Path):
    """A ``click.Path`` that refuses an empty or blank value (``--record ''`` is a typo, not ``.``)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and (not value.strip() or _CONTROL.search(value)):
            self.fail(f"{value!r} is not a path: give a {'directory' if not self.file_okay else 'file'} name, "
                      "e.g. runs/exp1.", param, ctx)
        return super().convert(value, param, ctx)


class Name(click.ParamType):
    """A name (signal, module, ...): not empty, at most ``max_chars``, no control characters.

    ``pattern`` (optional) says what the name must look like; ``example`` is shown on error.
    """

    name = "name"

    def __init__(self, example: str, pattern: str | None = None, max_chars: int = 256) -> None:
        self.example = example
        self.pattern = re.compile(pattern) if pattern else None
        self.max_chars = max_chars

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value)
        shown = repr(text if len(text) <= 60 else text[:60] + "...")
        if not text.strip():
            self.fail(f"{shown} is empty; give a name, e.g. {self.example}.", param, ctx)
        if len(text) > self.max_chars or _CONTROL.search(text) or (self.pattern and not self.pattern.match(text)):
            self.fail(f"{shown} is not a valid name here; give e.g. {self.example}.", param, ctx)
        return text.strip()


class HostName(click.ParamType):
    """An IP address or RFC 1123 host name (``gpukit.cluster.check_host``)."""

    name = "address"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from gpukit.cluster import check_host

        try:
            return check_host(str(value), param.opts[0] if param is not None else "address")
        except ConfigurationError as exc:
            self.fail(str(exc), param, ctx)


def given_options() -> set[str]:
    """The current command's options given on the command line (or from the environment), not left at
    their defaults."""
    ctx = click.get_current_context()
    return {name for name in ctx.params
            if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)}
