"""The ``health`` object of a fake GPU: PCIe link, clock-event reasons, ECC and retired memory.

What ``gpukit doctor --gpu`` reads through NVML (:mod:`gpukit.devices._health`), so its verdicts
can be tried without a GPU::

    "health": {"pcie_gen": 3, "pcie_width": 8, "pcie_max_gen": 4, "pcie_max_width": 16,
               "clock_event_reasons": ["sw_power_cap"], "ecc_uncorrected_volatile": 0,
               "ecc_uncorrected_aggregate": 2, "retired_pages_pending": false,
               "remapped_rows_pending": false, "remapped_rows_failure": false,
               "sm_clock_mhz": 1410, "sm_max_clock_mhz": 1980}

A key left out reads as NVML's "Not Supported".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NoReturn, Protocol

from gpukit.devices._health_codes import CLOCK_EVENT_REASONS, PCIE_LANE_GBPS

__all__ = ["FakeHealth", "parse_health", "HEALTH_KEYS"]

_INTS = ("pcie_gen", "pcie_width", "pcie_max_gen", "pcie_max_width", "ecc_uncorrected_volatile",
         "ecc_uncorrected_aggregate", "sm_clock_mhz", "sm_max_clock_mhz")
_BOOLS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")
HEALTH_KEYS = {*_INTS, *_BOOLS, "clock_event_reasons"}
_REASON_BITS = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}


class _SpecContext(Protocol):
    """What the spec parser (``_spec._Ctx``) offers: checked reads and errors that name the field."""

    def fail(self, path: str, problem: str) -> NoReturn: ...

    def unknown_keys(self, path: str, obj: Mapping[str, Any], allowed: set[str]) -> None: ...

    def opt(self, obj: Mapping[str, Any], path: str, key: str, kind: type | tuple[type, ...], **bounds: float) -> Any: ...


@dataclass(frozen=True)
class FakeHealth:
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    clock_event_mask: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    sm_clock_mhz: int | None = None
    sm_max_clock_mhz: int | None = None


def parse_health(ctx: _SpecContext, path: str, raw: Any) -> FakeHealth:
    """Validate a GPU's ``health`` object (``None``: every field "Not Supported")."""
    if raw is None:
        return FakeHealth()
    where = f"{path}.health"
    if not isinstance(raw, dict):
        ctx.fail(where, f"must be an object like {{\"pcie_gen\": 4, \"pcie_width\": 16}}, got {raw!r}")
    ctx.unknown_keys(where, raw, HEALTH_KEYS)
    values: dict[str, Any] = {key: ctx.opt(raw, where, key, int, low=0) for key in _INTS}
    for key in ("pcie_gen", "pcie_max_gen"):
        if values[key] is not None and values[key] not in PCIE_LANE_GBPS:
            ctx.fail(f"{where}.{key}", f"must be a PCIe generation {min(PCIE_LANE_GBPS)}-{max(PCIE_LANE_GBPS)}, "
                                      f"got {values[key]}")
    values.update({key: ctx.opt(raw, where, key, bool) for key in _BOOLS})
    reasons = raw.get("clock_event_reasons")
    mask = None
    if reasons is not None:
        if not isinstance(reasons, list) or any(r not in _REASON_BITS for r in reasons):
            ctx.fail(f"{where}.clock_event_reasons",
                     f"must be a list of {', '.join(_REASON_BITS)}; got {reasons!r}")
        mask = sum({_REASON_BITS[r] for r in reasons})
    return FakeHealth(clock_event_mask=mask, **values)
