"""CUDA_VISIBLE_DEVICES: one parser with CUDA's rules, and the logical -> physical mapping."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from gpukit.devices import (
    VisibleEntry, describe_mapping, list_gpus, logical_to_physical, parse_visible_devices, resolve_visible,
)

SHARED = ["GPU-5a9b0c3e-1f2d-4e6a-8b7c-0d1e2f3a4b5c", "GPU-6b0c1d4f-2a3e-4f7b-9c8d-1e2f3a4b5c6d",
          "GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e", "GPU-8d2e3f6b-4c5a-4b9d-9e0f-3a4b5c6d7e8f"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
        ("0,2", [0, 2]),
        (" 1 , 2 ", [1, 2]),
        ("1gpu,2ampere", [1, 2]),  # strtoul: leading digits count
        ("0,2,-1,1", [0, 2]),  # stops at the first invalid entry
        ("3,foo,1", [3]),
        ("0,0", []),  # a repeated device hides every device
        ("2,1,2", []),
    ],
)
def test_parse_indices(value: str | None, expected: list[int] | None) -> None:
    parsed = parse_visible_devices(value)
    assert (None if parsed is None else [e.value for e in parsed]) == expected


def test_parse_uuid_and_mig_entries() -> None:
    assert parse_visible_devices("GPU-8932f937,MIG-aa11,1") == [
        VisibleEntry("uuid", "GPU-8932f937", "GPU-8932f937"),
        VisibleEntry("mig", "MIG-aa11", "MIG-aa11"),
        VisibleEntry("index", 1, "1"),
    ]
    assert parse_visible_devices("GPU-,1") == []  # "GPU-" alone names nothing


def _uuids(value: str | None, gpus: list[Any]) -> list[str | None]:
    return [u.uuid for u in resolve_visible(value, gpus)]


def test_resolve_indices_and_uuids(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    gpus = list_gpus()
    assert _uuids(None, gpus) == SHARED
    assert _uuids("2,3", gpus) == [SHARED[2], SHARED[3]]
    assert _uuids(SHARED[3], gpus) == [SHARED[3]]  # full UUID
    assert _uuids("GPU-7c1d,0", gpus) == [SHARED[2], SHARED[0]]  # unique prefix, mixed with an index
    assert _uuids("GPU-7C1D", gpus) == [SHARED[2]]  # hex case does not matter
    assert _uuids("1,GPU-ffff,3", gpus) == [SHARED[1]]  # unknown UUID stops parsing
    assert _uuids("1,GPU-,3", gpus) == [SHARED[1]]
    assert _uuids("1,9,2", gpus) == [SHARED[1]]  # index past the last GPU stops parsing
    assert _uuids("2,GPU-7c1d", gpus) == []  # the same GPU twice, by index and UUID
    assert _uuids("", gpus) == []


def test_ambiguous_prefix_is_invalid(use_spec: Callable[[Any], Any]) -> None:
    use_spec({"gpus": [{"name": "a", "uuid": "GPU-abc1", "memory_total_mib": 1, "memory_used_mib": 0},
                       {"name": "b", "uuid": "GPU-abc2", "memory_total_mib": 1, "memory_used_mib": 0}]})
    gpus = list_gpus()
    assert _uuids("GPU-abc", gpus) == []
    assert _uuids("GPU-abc2,GPU-abc", gpus) == ["GPU-abc2"]


def test_resolve_mig(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    gpus = list_gpus()
    migs = [m.uuid for m in gpus[0].mig_devices]
    assert _uuids("MIG-bb22", gpus) == [migs[1]]
    assert _uuids(f"MIG-{gpus[0].uuid}/13/0", gpus) == [migs[2]]  # legacy MIG-GPU-<uuid>/<gi>/<ci>
    assert _uuids(f"MIG-{gpus[0].uuid}/99/0", gpus) == []
    assert _uuids("0", gpus) == migs  # a MIG-enabled GPU shows up as its MIG devices
    assert _uuids("1,MIG-cc33", gpus) == [gpus[1].uuid, migs[2]]
    assert _uuids(None, gpus) == [*migs, gpus[1].uuid]


def test_logical_to_physical_and_description(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    mapping = logical_to_physical(env)
    assert [(n, g.index) for n, g in mapping] == [(0, 2), (1, 3)]
    text = describe_mapping(env)
    assert text.splitlines() == [
        "CUDA_VISIBLE_DEVICES='2,3' (CUDA_DEVICE_ORDER=PCI_BUS_ID)",
        "  cuda:0 -> GPU 2 NVIDIA TITAN X (Pascal) (GPU-7c1d2e5a…)",
        "  cuda:1 -> GPU 3 NVIDIA TITAN X (Pascal) (GPU-8d2e3f6b…)",
    ]
    ignored = describe_mapping({"CUDA_VISIBLE_DEVICES": "1,GPU-dead,2"})
    assert "cuda:0 -> GPU 1" in ignored and "'GPU-dead' is not a GPU here" in ignored and "cuda:1" not in ignored
    assert "named twice" in describe_mapping({"CUDA_VISIBLE_DEVICES": "0,0"})
    assert "no GPU is visible" in describe_mapping({"CUDA_VISIBLE_DEVICES": ""})


def test_logical_mapping_reads_os_environ(use_spec: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec("shared-4gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SHARED[1][:12] + ",0")
    assert [g.index for _, g in logical_to_physical()] == [1, 0]


def test_mixed_models_warn_about_device_order(use_spec: Callable[[Any], Any]) -> None:
    use_spec({"gpus": [{"name": "A", "memory_total_mib": 1, "memory_used_mib": 0},
                       {"name": "B", "memory_total_mib": 1, "memory_used_mib": 0}]})
    assert "fastest first" in describe_mapping({})
    assert "may differ from nvidia-smi" in describe_mapping({})
    assert "may differ" not in describe_mapping({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


def test_mapping_without_driver(use_spec: Callable[[Any], Any]) -> None:
    use_spec("no-driver")
    assert logical_to_physical({}) == []
    assert "no NVIDIA GPU/driver found" in describe_mapping({})
