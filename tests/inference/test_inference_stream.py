"""UnitStreamer on its own: the GPU path (pinned host units, disk reads staged then copied on a side
stream) run with FakeCUDAAccelerator, whose copies and events behave as CUDA's on the host."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from gpukit.accelerators import CPUAccelerator, FakeCUDAAccelerator
from gpukit.inference._stream import StreamedTensor, StreamedUnit, UnitStreamer


def _stream(model: nn.Sequential, accelerator: object, prefetch: int, from_host: set[int]) -> UnitStreamer:
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    readers: set[str] = set()

    def read(key: str, view: torch.Tensor) -> None:
        readers.add(threading.current_thread().name)
        view.copy_(weights[key])

    units = []
    for index, layer in enumerate(model):
        parts = []
        for attr in ("weight", "bias"):
            tensor = getattr(layer, attr)
            parts.append(StreamedTensor(f"{index}.{attr}", tuple(tensor.shape), tensor.dtype, holders=[(layer, attr, True)]))
            layer._parameters[attr] = nn.Parameter(torch.empty(tensor.shape, device="meta"), requires_grad=False)
        unit = StreamedUnit(str(index), layer, parts)
        if index in from_host:
            size = unit.layout()
            unit.host = accelerator.pinned_empty((size,), torch.uint8)  # type: ignore[attr-defined]
            for part in parts:
                read(part.key, unit.host[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape))
        units.append(unit)
    streamer = UnitStreamer(units, torch.device("cpu"), accelerator, read, prefetch)  # type: ignore[arg-type]
    streamer.readers = readers  # type: ignore[attr-defined]
    return streamer


@pytest.mark.parametrize("accelerator", [CPUAccelerator(), FakeCUDAAccelerator()], ids=["cpu", "fake-cuda"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_streamed_layers_compute_what_the_resident_model_does(accelerator: object, prefetch: int) -> None:
    torch.manual_seed(0)
    whole = nn.Sequential(*[nn.Linear(32, 32) for _ in range(7)]).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = whole(x)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(7)]).eval()
    model.load_state_dict(whole.state_dict())
    streamer = _stream(model, accelerator, prefetch, from_host={1, 4})
    assert len(streamer.slots) == prefetch + 1
    with torch.no_grad():
        for _ in range(3):  # every pass streams every layer again, ahead of its use
            assert torch.equal(model(x), want)
    layer_bytes = 32 * 33 * 4  # weight and bias
    for slot in streamer.slots:  # the read-ahead runs on the reader thread: let the last one finish
        if slot.ready is not None:
            slot.ready.result()
    assert streamer.bytes_streamed == (3 * 7 + prefetch) * layer_bytes  # and the next pass's first, read ahead
    assert all(layer.weight.is_meta for layer in model)  # nothing stays bound between passes
    assert any(name.startswith("gpukit-offload") for name in streamer.readers)  # disk reads off the compute thread
    assert (streamer.slots[0].staging is not None) == (not accelerator.is_host)  # type: ignore[attr-defined]
    streamer.close()


def test_a_layer_run_out_of_order_is_filled_when_it_starts() -> None:
    torch.manual_seed(0)
    whole = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)]).eval()
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)]).eval()
    model.load_state_dict(whole.state_dict())
    streamer = _stream(model, CPUAccelerator(), 1, from_host=set())
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model[3](x), whole[3](x))
        assert torch.equal(model[0](x), whole[0](x))
        assert torch.equal(model(x), whole(x))
    streamer.close()


class _OrderedCopies(FakeCUDAAccelerator):
    """FakeCUDA whose compute events are numbered in the order recorded, and which logs, for each copy
    into a slot, the compute event it was told to wait for (on CUDA the side stream waits for it)."""

    def __init__(self) -> None:
        self.recorded = 0
        self.timeline: list[tuple[str, int, int | None]] = []  # ("copy", dest ptr, after) / ("read", ptr, event)

    def compute_event(self, device: torch.device) -> int:
        self.recorded += 1
        return self.recorded

    def copy_on_stream(self, dest: torch.Tensor, source: torch.Tensor, stream: object,
                       after: object = None) -> None:
        self.timeline.append(("copy", dest.data_ptr(), after))  # type: ignore[arg-type]
        return super().copy_on_stream(dest, source, stream, after)  # type: ignore[arg-type]


@pytest.mark.parametrize("from_host", [{0, 1, 2, 3, 4}, set()], ids=["pinned-host", "disk"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_copy_into_a_slot_waits_for_the_last_compute_that_read_it(from_host: set[int], prefetch: int) -> None:
    # 5 units over 2 (or 3) slots: the unit a slot holds is not its index modulo the slots, so the
    # event that frees a slot must be put on the slot the unit was bound to. On a GPU a copy that waits
    # for an older event overwrites weights the compute stream is still reading.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)]).eval()
    accelerator = _OrderedCopies()
    streamer = _stream(model, accelerator, prefetch, from_host=from_host)
    bound: dict[int, int] = {}

    def slot_of(pointer: int) -> int:
        return next(i for i, s in enumerate(streamer.slots)
                    if s.device.data_ptr() <= pointer < s.device.data_ptr() + streamer.slot_bytes)

    for index, layer in enumerate(model):  # after the streamer's hooks: the weights are bound, then unbound
        layer.register_forward_pre_hook(lambda m, a, index=index: bound.__setitem__(index, m.weight.data_ptr()))
        layer.register_forward_hook(lambda m, a, o, index=index: accelerator.timeline.append(
            ("read", bound[index], accelerator.recorded)))  # the event the streamer's leave just recorded
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(2, 8))
    for slot in streamer.slots:
        if slot.ready is not None:
            slot.ready.result()
    streamer.close()
    last_read: dict[int, int] = {}
    copies = 0
    for kind, pointer, event in accelerator.timeline:
        slot = slot_of(pointer)
        if kind == "read":
            last_read[slot] = event  # type: ignore[assignment]
        elif slot not in last_read:  # its first fill: after the work queued before the slot was allocated
            assert event == 1, f"the first copy into slot {slot} waits for {event}, not the streamer's first event"
        else:
            copies += 1
            assert event is not None and event >= last_read[slot], (
                f"a copy into slot {slot} waits for compute event {event}, but the compute that last read "
                f"the slot ended at event {last_read[slot]}")
    assert copies >= 3 * 5 - prefetch  # every pass after the first refills every slot


def test_the_staging_buffers_hold_the_largest_disk_unit_not_the_largest_unit() -> None:
    # the plan counts (prefetch + 1) x the largest *disk* unit of pinned host memory for the GPU's disk
    # reads; a larger unit in pinned CPU RAM is copied from its own buffer and never staged
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 8)).eval()
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 8)).eval()
    model.load_state_dict(whole.state_dict())
    streamer = _stream(model, FakeCUDAAccelerator(), 1, from_host={0})
    disk_largest = max(u.layout() for u in streamer.units[1:])
    assert streamer.slot_bytes == streamer.units[0].layout() > disk_largest
    assert [s.staging.numel() for s in streamer.slots] == [disk_largest] * 2  # type: ignore[union-attr]
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), whole(x))
    streamer.close()
