"""Fake-GPU specs: load a JSON spec, validate it field by field, fill in deterministic defaults.

The spec format is documented in ``docs/devices.md`` (the fake NVML) and in :class:`gpukit.devices.FakeNvml`.
Every problem is a :class:`~gpukit.errors.FakeSpecError` that names the file, the field path
(``gpus[1].memory_used_mib``), what was given and what is allowed.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Mapping, NoReturn

from gpukit.devices._spec_health import FakeHealth, parse_health
from gpukit.errors import FakeSpecError

#: largest spec file read (a spec for 64 GPUs with processes is a few KiB)
MAX_SPEC_BYTES = 4 << 20

__all__ = ["FakeSpec", "FakeGpu", "FakeMigDevice", "FakeProcess", "load_spec", "parse_spec", "COMPUTE_MODES"]

MIB = 1024**2

#: spec spelling -> NVML compute-mode code (``pynvml.NVML_COMPUTEMODE_*``)
COMPUTE_MODES: dict[str, int] = {"Default": 0, "Exclusive_Thread": 1, "Prohibited": 2, "Exclusive_Process": 3}


@dataclass(frozen=True)
class FakeProcess:
    pid: int
    user: str | None
    command: str | None
    used_memory_bytes: int | None


@dataclass(frozen=True)
class FakeMigDevice:
    profile: str
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    gpu_instance_id: int
    compute_instance_id: int
    processes: tuple[FakeProcess, ...]


@dataclass(frozen=True)
class FakeGpu:
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    compute_mode: int | None = None
    lost: bool = False
    #: number of successful per-device queries before the GPU "falls off the bus" (None: never)
    lost_after_calls: int | None = None
    processes: tuple[FakeProcess, ...] = ()
    #: None: MIG not supported; False: supported, disabled; True: enabled
    mig_mode: bool | None = None
    mig_devices: tuple[FakeMigDevice, ...] = ()
    #: None: not supported (as on Windows); else whether persistence mode is on
    persistence_mode: bool | None = None
    #: PCIe link, clock-event reasons, ECC, retired memory (``gpukit doctor --gpu``)
    health: FakeHealth = field(default_factory=FakeHealth)


@dataclass(frozen=True)
class FakeSpec:
    driver_version: str = "535.104.05"
    no_driver: bool = False
    gpus: tuple[FakeGpu, ...] = ()
    source: str = "<dict>"
    extra: dict[str, Any] = field(default_factory=dict)


_TOP_KEYS = {"driver_version", "gpus", "no_driver", "comment"}
_GPU_KEYS = {
    "name", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib", "utilization_gpu_pct",
    "utilization_memory_pct", "temperature_c", "power_draw_w", "power_limit_w", "compute_mode",
    "lost", "lost_after_calls", "processes", "mig_mode", "mig_devices", "persistence_mode", "health", "comment",
}
_PROC_KEYS = {"pid", "user", "command", "used_memory_mib"}
_MIG_KEYS = {
    "profile", "uuid", "memory_total_mib", "memory_used_mib", "gpu_instance_id",
    "compute_instance_id", "processes",
}


def load_spec(path: str | os.PathLike[str]) -> FakeSpec:
    """Read and validate a spec file (the file ``GPUKIT_FAKE_GPUS`` names).

    Raises:
        FakeSpecError: the file is missing or unreadable, is not valid JSON (with line and
            column), or does not follow the spec format.
    """
    where = os.fspath(path)
    try:
        info = os.stat(where)
        if not stat.S_ISREG(info.st_mode):  # before open(): opening a FIFO waits for a writer forever
            raise FakeSpecError(f"Fake-GPU spec {where!r} is not a regular file (a directory, FIFO or device). Point "
                                "GPUKIT_FAKE_GPUS at a JSON spec file, e.g. one of examples/fake-gpus/*.json.")
        if info.st_size > MAX_SPEC_BYTES:
            raise FakeSpecError(f"Fake-GPU spec {where!r} is {info.st_size:,} bytes; a spec is at most "
                                f"{MAX_SPEC_BYTES:,} bytes. Point GPUKIT_FAKE_GPUS at a JSON spec file.")
        with open(where, encoding="utf-8") as fh:
            text = fh.read(MAX_SPEC_BYTES + 1)
    except UnicodeDecodeError as exc:
        raise FakeSpecError(f"Fake-GPU spec {where!r} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    except FileNotFoundError:
        raise FakeSpecError(
            f"Fake-GPU spec {where!r} does not exist. Point GPUKIT_FAKE_GPUS at a JSON spec file, "
            f"e.g. one of examples/fake-gpus/*.json, or unset it to use the real GPUs."
        ) from None
    except OSError as exc:
        raise FakeSpecError(f"Cannot read fake-GPU spec {where!r}: {exc.strerror or exc}.") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise FakeSpecError(f"Fake-GPU spec {where!r} nests JSON too deeply to be a spec.") from None
    except json.JSONDecodeError as exc:
        raise FakeSpecError(
            f"Fake-GPU spec {where!r} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}."
        ) from None
    return parse_spec(data, source=where)


def parse_spec(data: Any, *, source: str = "<dict>") -> FakeSpec:
    """Validate a spec given as a Python mapping and fill in defaults.

    Raises:
        FakeSpecError: naming the field path, the given value and what is allowed.
    """
    ctx = _Ctx(source)
    if not isinstance(data, Mapping):
        ctx.fail("", f"the spec must be a JSON object with a 'gpus' list, got {type(data).__name__}")
    ctx.unknown_keys("", data, _TOP_KEYS)
    driver_version = ctx.opt(data, "", "driver_version", str) or "535.104.05"
    no_driver = bool(ctx.opt(data, "", "no_driver", bool))
    raw_gpus = data.get("gpus", [])
    if not isinstance(raw_gpus, list):
        ctx.fail("gpus", f"must be a list of GPU objects, got {type(raw_gpus).__name__}")
    if "gpus" not in data and not no_driver:
        ctx.fail("gpus", "is missing: give a list of GPU objects (an empty list means a driver with no GPUs)")
    gpus = tuple(_parse_gpu(ctx, f"gpus[{i}]", i, raw) for i, raw in enumerate(raw_gpus))
    _check_unique(ctx, "uuid", [(f"gpus[{i}]", g.uuid) for i, g in enumerate(gpus)]
                  + [(f"gpus[{i}].mig_devices[{j}]", m.uuid) for i, g in enumerate(gpus)
                     for j, m in enumerate(g.mig_devices)])
    _check_unique(ctx, "pci_bus_id", [(f"gpus[{i}]", g.pci_bus_id) for i, g in enumerate(gpus)])
    return FakeSpec(driver_version=driver_version, no_driver=no_driver, gpus=gpus, source=source)


class _Ctx:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> NoReturn:
        where = f" field {path!r}" if path else ""
        raise FakeSpecError(f"Invalid fake-GPU spec {self.source!r}:{where} {problem}.")

    def unknown_keys(self, path: str, obj: Mapping[str, Any], allowed: set[str]) -> None:
        unknown = sorted(set(obj) - allowed)
        if unknown:
            self.fail(path, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}")

    def opt(self, obj: Mapping[str, Any], path: str, key: str, kind: type | tuple[type, ...],
            *, low: float | None = None, high: float | None = None) -> Any:
        if key not in obj or obj[key] is None:
            return None
        value = obj[key]
        where = f"{path}.{key}" if path else key
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass; a number field given `true` is a typo, not 1
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            self.fail(where, f"must be {_kind_name(kinds)}, got {value!r} ({type(value).__name__})")
        number: Any = value
        if low is not None and number < low or high is not None and number > high:
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            self.fail(where, f"must be {bounds}, got {value!r}")
        return value

    def req(self, obj: Mapping[str, Any], path: str, key: str, kind: type | tuple[type, ...], **bounds: float) -> Any:
        if key not in obj or obj[key] is None:
            self.fail(f"{path}.{key}", "is required")
        return self.opt(obj, path, key, kind, **bounds)


_NUM = (int, float)
_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", float: "a number"}


def _kind_name(kinds: tuple[type, ...]) -> str:
    return "a number" if float in kinds else " or ".join(_KIND_NAMES[k] for k in kinds)


def _parse_processes(ctx: _Ctx, path: str, raw: Any) -> tuple[FakeProcess, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        ctx.fail(path, f"must be a list of process objects, got {type(raw).__name__}")
    procs = []
    for i, p in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(p, Mapping):
            ctx.fail(where, f"must be an object like {{\"pid\": 123, \"used_memory_mib\": 500}}, got {p!r}")
        ctx.unknown_keys(where, p, _PROC_KEYS)
        used = ctx.opt(p, where, "used_memory_mib", _NUM, low=0)
        procs.append(FakeProcess(
            pid=ctx.req(p, where, "pid", int, low=1),
            user=ctx.opt(p, where, "user", str),
            command=ctx.opt(p, where, "command", str),
            used_memory_bytes=None if used is None else int(used * MIB),
        ))
    return tuple(procs)


def _parse_memory(ctx: _Ctx, path: str, raw: Mapping[str, Any], procs: tuple[FakeProcess, ...]) -> tuple[int, int]:
    total = int(ctx.req(raw, path, "memory_total_mib", _NUM, low=1) * MIB)
    used = int(ctx.req(raw, path, "memory_used_mib", _NUM, low=0) * MIB)
    if used > total:
        ctx.fail(f"{path}.memory_used_mib", f"is {used // MIB} MiB, more than memory_total_mib {total // MIB} MiB")
    by_procs = sum(p.used_memory_bytes or 0 for p in procs)
    if by_procs > used:
        ctx.fail(f"{path}.processes",
                 f"use {by_procs // MIB} MiB together, more than memory_used_mib {used // MIB} MiB")
    return total, used


def _parse_gpu(ctx: _Ctx, path: str, index: int, raw: Any) -> FakeGpu:
    if not isinstance(raw, Mapping):
        ctx.fail(path, f"must be an object with at least 'name', 'memory_total_mib' and 'memory_used_mib', got {raw!r}")
    ctx.unknown_keys(path, raw, _GPU_KEYS)
    name = ctx.req(raw, path, "name", str)
    uuid = ctx.opt(raw, path, "uuid", str) or _make_uuid("GPU", f"{index}:{name}")
    if not uuid.startswith("GPU-"):
        ctx.fail(f"{path}.uuid", f"must start with 'GPU-' like nvidia-smi prints it, got {uuid!r}")
    pci = ctx.opt(raw, path, "pci_bus_id", str) or f"00000000:{index + 1:02X}:00.0"
    procs = _parse_processes(ctx, f"{path}.processes", raw.get("processes"))
    total, used = _parse_memory(ctx, path, raw, procs)
    mode_name = ctx.opt(raw, path, "compute_mode", str)
    if mode_name is not None and mode_name not in COMPUTE_MODES:
        ctx.fail(f"{path}.compute_mode", f"must be one of {', '.join(COMPUTE_MODES)}, got {mode_name!r}")
    power = {k: ctx.opt(raw, path, k, _NUM, low=0) for k in ("power_draw_w", "power_limit_w")}
    mig_devices = _parse_mig_devices(ctx, path, uuid, raw.get("mig_devices"), total)
    mig_mode = ctx.opt(raw, path, "mig_mode", bool)
    if mig_devices and mig_mode is False:
        ctx.fail(f"{path}.mig_mode", "is false but mig_devices are given; drop one of them")
    if mig_devices and procs:
        ctx.fail(f"{path}.processes", "must be empty on a MIG-enabled GPU: list processes under its mig_devices")
    return FakeGpu(
        name=name, uuid=uuid, pci_bus_id=pci, memory_total_bytes=total, memory_used_bytes=used,
        utilization_gpu_pct=ctx.opt(raw, path, "utilization_gpu_pct", int, low=0, high=100),
        utilization_memory_pct=ctx.opt(raw, path, "utilization_memory_pct", int, low=0, high=100),
        temperature_c=ctx.opt(raw, path, "temperature_c", int, low=0),
        power_draw_w=power["power_draw_w"], power_limit_w=power["power_limit_w"],
        compute_mode=None if mode_name is None else COMPUTE_MODES[mode_name],
        lost=bool(ctx.opt(raw, path, "lost", bool)),
        lost_after_calls=ctx.opt(raw, path, "lost_after_calls", int, low=0),
        processes=procs,
        mig_mode=True if mig_devices else mig_mode,
        mig_devices=mig_devices,
        persistence_mode=ctx.opt(raw, path, "persistence_mode", bool),
        health=parse_health(ctx, path, raw.get("health")),
    )


def _parse_mig_devices(ctx: _Ctx, path: str, parent_uuid: str, raw: Any,
                       parent_total: int) -> tuple[FakeMigDevice, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        ctx.fail(f"{path}.mig_devices", f"must be a list of MIG device objects, got {type(raw).__name__}")
    out = []
    for slot, m in enumerate(raw):
        where = f"{path}.mig_devices[{slot}]"
        if not isinstance(m, Mapping):
            ctx.fail(where, f"must be an object with 'profile', 'memory_total_mib', 'memory_used_mib', got {m!r}")
        ctx.unknown_keys(where, m, _MIG_KEYS)
        profile = ctx.req(m, where, "profile", str)
        uuid = ctx.opt(m, where, "uuid", str) or _make_uuid("MIG", f"{parent_uuid}/{slot}")
        if not uuid.startswith("MIG-"):
            ctx.fail(f"{where}.uuid", f"must start with 'MIG-', got {uuid!r}")
        procs = _parse_processes(ctx, f"{where}.processes", m.get("processes"))
        total, used = _parse_memory(ctx, where, m, procs)
        gi = ctx.opt(m, where, "gpu_instance_id", int, low=0)
        ci = ctx.opt(m, where, "compute_instance_id", int, low=0)
        out.append(FakeMigDevice(profile=profile, uuid=uuid, memory_total_bytes=total, memory_used_bytes=used,
                                 gpu_instance_id=slot + 1 if gi is None else gi,
                                 compute_instance_id=0 if ci is None else ci, processes=procs))
    if sum(m.memory_total_bytes for m in out) > parent_total:
        ctx.fail(f"{path}.mig_devices", "have more memory together than the GPU's memory_total_mib")
    return tuple(out)


def _check_unique(ctx: _Ctx, what: str, items: list[tuple[str, str]]) -> None:
    seen: dict[str, str] = {}
    for path, value in items:
        if value in seen:
            ctx.fail(f"{path}.{what}", f"{value!r} is already used by {seen[value]}; each must be unique")
        seen[value] = path


def _make_uuid(prefix: str, seed: str) -> str:
    """A stable UUID-shaped id, so a spec without uuids names the same GPUs on every run."""
    import hashlib  # lazily: only specs without uuids need it

    h = hashlib.sha1(seed.encode()).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
