"""The process-wide count of what gpukit's own code asked of a device that the host may wait for."""

from __future__ import annotations

__all__ = ["SYNC_COUNTS", "SyncCounts"]


class SyncCounts:
    """What gpukit's own code asked of a device that the host may wait for: host
    synchronisations (``synchronize``, reading a device value) and device events (creating,
    recording, querying, timing one). One process-wide counter (:data:`SYNC_COUNTS`): the
    rule "no sync and no event in a steady-state step" is checked by reading it around steps.

    Attributes:
        syncs: host synchronisations issued through an :class:`Accelerator`.
        events: device-event operations issued through an :class:`Accelerator`.
    """

    __slots__ = ("syncs", "events")

    def __init__(self) -> None:
        self.syncs = 0
        self.events = 0

    def total(self) -> int:
        """Syncs and events together."""
        return self.syncs + self.events

    def __repr__(self) -> str:
        return f"SyncCounts(syncs={self.syncs}, events={self.events})"


#: the process's count of gpukit's syncs and device events (every accelerator adds to it)
SYNC_COUNTS = SyncCounts()
