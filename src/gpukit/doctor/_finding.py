"""What one check found: a :class:`Finding` with a status, what was seen and a one-line fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Finding", "Status", "STATUSES", "worst"]

Status = Literal["ok", "warn", "fail", "info"]
#: statuses from best to worst; ``info`` is a fact that needs no action
STATUSES: tuple[Status, ...] = ("ok", "info", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """One result of ``gpukit doctor``.

    Attributes:
        name: the check, dotted by group (``"cuda.visible_devices"``, ``"network.port"``).
        status: ``"ok"``, ``"info"`` (a fact), ``"warn"`` (likely trouble) or ``"fail"``
            (this will break a run).
        message: what was found, with the numbers.
        fix: one line saying how to fix it; ``None`` when there is nothing to fix.
        details: machine-readable facts behind the message (for ``--json``).
    """

    name: str
    status: Status
    message: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Finding status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return asdict(self)


def worst(findings: list[Finding]) -> Status:
    """The worst status among ``findings`` (``"ok"`` for none)."""
    return max((f.status for f in findings), key=STATUSES.index, default="ok")
