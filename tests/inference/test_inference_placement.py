"""The placement rules (pure arithmetic): the cases where Accelerate's device map went wrong (issue 40)."""

from __future__ import annotations

import pytest

from gpukit.inference import DeviceBudget
from gpukit.inference._placement import UnitCost, device_peak, pinned_bytes, place

MIB = 2**20


def _model(layers: int, layer_mib: float, head_mib: float = 0, kv_mib: float = 0, act_mib: float = 0,
           tied: bool = False) -> list[UnitCost]:
    units = [UnitCost("embed", int(head_mib * MIB), 0, 0, 0, int(act_mib * MIB))]
    units += [UnitCost(f"layers.{i}", int(layer_mib * MIB), int(kv_mib * MIB) // 2, int(kv_mib * MIB), 0,
                       int(act_mib * MIB)) for i in range(layers)]
    units.append(UnitCost("lm_head", 0 if tied else int(head_mib * MIB), 0, 0, 0, int(act_mib * MIB),
                          "embed" if tied else None))
    return units


def _gpus(*mib: float) -> list[DeviceBudget]:
    return [DeviceBudget(f"cuda:{i}", "gpu", int(m * MIB)) for i, m in enumerate(mib)]


def test_the_kv_cache_and_activations_are_budgeted_not_only_weights() -> None:
    # 766 MiB of weights "fit" a 1 GiB GPU by weights alone; 24 layers x 16 MiB of KV cache do not
    units = _model(24, 26, head_mib=70, kv_mib=16, act_mib=40)
    assert place(units, _gpus(1024)) is None
    placed = place(units, [*_gpus(1024), DeviceBudget("cpu", "cpu", 4096 * MIB)])
    assert placed is not None and placed.offloaded  # some layers go to the CPU: the cache must fit
    assert max(placed.peak_bytes.values()) <= 4096 * MIB and placed.peak_bytes["cuda:0"] <= 1024 * MIB


def test_nothing_is_offloaded_when_the_model_fits_and_no_listed_gpu_is_left_empty() -> None:
    units = _model(12, 25, head_mib=125)  # 550 MiB: fits 2 x 400 MiB
    placed = place(units, [*_gpus(400, 400), DeviceBudget("cpu", "cpu", 8192 * MIB)])
    assert placed is not None and placed.offloaded == ()
    assert {placed.device_of[u.name] for u in units} == {"cuda:0", "cuda:1"}
    four = place(_model(30, 26, head_mib=70), [*_gpus(200, 200, 200, 200), DeviceBudget("cpu", "cpu", 8192 * MIB)])
    assert four is not None and four.offloaded
    assert {four.device_of[n] for n in four.device_of} >= {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}


def test_ranges_are_contiguous_and_balanced() -> None:
    units = _model(16, 10)
    placed = place(units, _gpus(1000, 1000))
    assert placed is not None
    order = [placed.device_of[u.name] for u in units]
    assert order == sorted(order)  # cuda:0's range, then cuda:1's
    assert abs(order.count("cuda:0") - order.count("cuda:1")) <= 2


def test_disk_is_used_only_when_listed() -> None:
    units = _model(8, 100)
    assert place(units, [*_gpus(300), DeviceBudget("cpu", "cpu", 300 * MIB)]) is None
    placed = place(units, [*_gpus(300), DeviceBudget("cpu", "cpu", 300 * MIB), DeviceBudget("disk", "disk", None)])
    assert placed is not None and "disk" in placed.device_of.values()
    assert placed.device_of["layers.0"] == "cuda:0" and placed.execution_device == "cuda:0"


def test_tied_weights_sit_together_and_count_once() -> None:
    units = _model(4, 10, head_mib=50, tied=True)
    placed = place(units, _gpus(60, 60))
    assert placed is not None and placed.device_of["lm_head"] == placed.device_of["embed"]
    cpu_only = place(units, [DeviceBudget("cpu", "cpu", 95 * MIB), DeviceBudget("disk", "disk", None)])
    assert cpu_only is not None and cpu_only.device_of["lm_head"] == cpu_only.device_of["embed"] == "cpu"


def test_streamed_units_reserve_their_buffers_on_the_execution_device() -> None:
    units = _model(6, 40)
    placed = place(units, [DeviceBudget("cpu", "cpu", 130 * MIB), DeviceBudget("disk", "disk", None)], prefetch=2)
    assert placed is not None and placed.offloaded
    resident = [u for u in units if placed.device_of[u.name] == "cpu"]
    streamed = [u for u in units if u.name in placed.offloaded]
    assert placed.peak_bytes["cpu"] == device_peak(resident, resident + streamed, 3 * 40 * MIB)
    assert placed.peak_bytes["cpu"] <= 130 * MIB


@pytest.mark.parametrize("prefetch", [1, 3])
def test_peak_grows_with_prefetch_depth(prefetch: int) -> None:
    units = _model(10, 10)
    placed = place(units, [DeviceBudget("cpu", "cpu", 80 * MIB), DeviceBudget("disk", "disk", None)], prefetch)
    assert placed is not None
    held = sum(u.weights_bytes for u in units if placed.device_of[u.name] == "cpu")
    assert placed.peak_bytes["cpu"] == held + (prefetch + 1) * 10 * MIB


def test_units_pinned_for_a_gpu_are_planned_as_torch_allocates_them() -> None:
    """torch's pinned host allocator rounds each buffer up to a power of two: a 100 MiB layer kept in CPU RAM for
    a GPU takes 128 MiB (a 605 MiB Llama-2-13B layer 1 GiB), and so does each staging buffer of its disk reads.
    Counted at 100 MiB, 8 layers and 2 staging buffers "fit" 1000 MiB and took 1280."""
    assert [pinned_bytes(n) for n in (0, 1, 3, MIB, MIB + 1, 605 * MIB)] == [0, 1, 4, MIB, 2 * MIB, 1024 * MIB]
    units = _model(12, 100)
    placed = place(units, [*_gpus(250), DeviceBudget("cpu", "cpu", 1000 * MIB), DeviceBudget("disk", "disk", None)])
    assert placed is not None and "disk" in placed.device_of.values()
    on_cpu = sum(1 for name, n in placed.device_of.items() if n == "cpu" and name.startswith("layers."))
    assert on_cpu == 5  # 5 x 128 MiB + 2 x 128 MiB of staging; 8 when each was counted at 100 MiB
    assert placed.peak_bytes["cpu"] == (on_cpu + 2) * 128 * MIB <= 1000 * MIB
