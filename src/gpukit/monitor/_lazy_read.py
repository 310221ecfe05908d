"""Logged values read back from the device without waiting for it.

``session.log(loss=loss)`` and the loss ``session.backward`` logs keep the tensor; the run record
and the trackers need numbers. Reading a GPU tensor (``float(t)``, ``.item()``, ``.tolist()``) makes
the host wait until the GPU has run everything queued before it -- with the training thread
blocked, the GPU then idles until new work comes. :class:`LazyRead` instead stacks the logged
tensors of each device into one, starts an asynchronous copy into host memory, records an event
after it, and fills in the numbers once the device has passed that event (asked, never waited for):
the values arrive a flush later, and the step issues nothing. Only :meth:`LazyRead.finish` (at
close) waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the doctor loads monitor/ (through worker/) without torch: imported where a read starts
    from gpukit.accelerators import Accelerator

__all__ = ["LazyRead", "is_tensor"]


def is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "numel")


class LazyRead:
    """Replace ``container[key]`` by a float for every slot holding a tensor, without a wait.

    Host tensors are read at once; the tensors on each device are stacked and copied to host
    memory asynchronously (one copy and one event per device). Numbers are kept as they are.

    Args:
        slots: ``(container, key)`` pairs.
        accelerator: the accelerator of tensors on its device type (the session's; a test's fake);
            others are read through the accelerator of their device.

    Raises:
        RuntimeError: from torch, for a tensor on a device that is gone.
    """

    def __init__(self, slots: list[tuple[Any, Any]], accelerator: Accelerator | None = None) -> None:
        from gpukit.accelerators import get_accelerator

        own = accelerator.device().type if accelerator is not None else None
        on_device: dict[Any, tuple[Accelerator, list[tuple[Any, Any]]]] = {}
        host: set[Any] = set()
        for container, key in slots:
            value = container[key]
            if not is_tensor(value):
                continue
            device = value.device
            if device in host:
                container[key] = float(value)
                continue
            if device not in on_device:
                reader = accelerator if device.type == own else get_accelerator(device)
                if reader.is_host:  # nothing to wait for: read now
                    host.add(device)
                    container[key] = float(value)
                    continue
                on_device[device] = (reader, [])
            on_device[device][1].append((container, key))
        self._copies: list[tuple[Any, Any, Any, list[tuple[Any, Any]]]] = []
        if not on_device:
            return
        import torch

        for accelerator, group in on_device.values():  # type: ignore[assignment]
            stacked = torch.stack([c[k].reshape(()).float() for c, k in group])
            host, event = accelerator.to_host_async(stacked)
            self._copies.append((accelerator, host, event, group))

    def done(self) -> bool:
        """Whether every value is a number now (fills in the copies the device has finished)."""
        while self._copies:
            accelerator, host, event, group = self._copies[-1]
            if event is not None and not accelerator.event_done(event):
                return False
            self._fill(host, group)
            self._copies.pop()
        return True

    def finish(self) -> None:
        """Wait for the copies still running (at close: a sync, counted) and fill in their values."""
        for accelerator, host, event, group in self._copies:
            if event is not None and not accelerator.event_done(event):
                accelerator.wait_event(event)
            self._fill(host, group)
        self._copies = []

    @staticmethod
    def _fill(host: Any, group: list[tuple[Any, Any]]) -> None:
        for (container, key), number in zip(group, host.tolist()):
            container[key] = number
