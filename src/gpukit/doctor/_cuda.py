"""CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER: what CUDA will see, and whether it is too late to change."""

from __future__ import annotations

from gpukit.devices import VISIBLE_DEVICES_ENV as ENV_VAR
from gpukit.devices import GpuSnapshot, explain_visible, order_may_differ, parse_visible_devices
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["check_visible_devices", "check_device_order", "check_cuda_initialized"]

_ORDER_VAR = "CUDA_DEVICE_ORDER"
_SET_EARLY = ("set it before the first CUDA call: at the top of the script, with gpukit.devices.use_gpus(), "
              "or let `gpukit run --gpus` set it for the workers")


def _visible(ctx: DoctorContext) -> tuple[list[GpuSnapshot], str | None, str | None]:
    value = ctx.env.get(ENV_VAR)
    return explain_visible(value, ctx.gpus)


def _mapping(units: list[GpuSnapshot]) -> str:
    return ", ".join(f"cuda:{i} -> {u.label}" for i, u in enumerate(units)) or "none"


def check_visible_devices(ctx: DoctorContext) -> list[Finding]:
    """Which physical GPU each ``cuda:N`` is, and entries CUDA would ignore."""
    value = ctx.env.get(ENV_VAR)
    shown = "unset" if value is None else repr(value)
    if not ctx.gpus:
        status = "info" if value is None else "warn"
        fix = None if value is None else f"unset {ENV_VAR} or check the driver (`nvidia-smi`)"
        return [Finding("cuda.visible_devices", status,
                        f"{ENV_VAR} is {shown}; no NVIDIA GPU to map ({ctx.nvml_reason or 'NVML lists none'})",
                        fix, {"value": value, "mapping": []})]
    visible, stopped_at, duplicate = _visible(ctx)
    details = {"value": value, "mapping": [{"logical": i, "index": u.index, "uuid": u.uuid}
                                           for i, u in enumerate(visible)]}
    message = f"{ENV_VAR} is {shown}: {_mapping(visible)}"
    if duplicate is not None:
        return [Finding("cuda.visible_devices", "fail",
                        f"{ENV_VAR}={value!r} names {duplicate!r} twice, so CUDA hides every GPU",
                        f"name each GPU once, e.g. {ENV_VAR}={','.join(str(g.index) for g in ctx.gpus[:2])}",
                        details)]
    if not visible and (value or "").strip() in ("", "-1", "NoDevFiles"):  # hiding every GPU on purpose
        return [Finding("cuda.visible_devices", "warn", f"{ENV_VAR}={value!r} hides every GPU: CUDA sees none",
                        f"unset {ENV_VAR} or name GPUs from `gpukit ls`", details)]
    if stopped_at is not None:
        known = ", ".join(str(g.index) for g in ctx.gpus)
        return [Finding("cuda.visible_devices", "fail",
                        f"{message}; {stopped_at!r} is not a GPU here, so CUDA ignores it and every entry after it",
                        f"use physical indices ({known}) or GPU-/MIG- UUIDs from `gpukit ls`", details)]
    if not visible:
        return [Finding("cuda.visible_devices", "warn", f"{ENV_VAR}={value!r} hides every GPU: CUDA sees none",
                        f"unset {ENV_VAR} or name GPUs from `gpukit ls`", details)]
    broken = [u for u in visible if not u.usable]
    if broken:
        return [Finding("cuda.visible_devices", "warn",
                        f"{message}; unusable: {', '.join(f'{u.label} ({u.error})' for u in broken)}",
                        f"leave it out: {ENV_VAR}={','.join(str(u.index) for u in visible if u.usable)}; "
                        "a lost GPU needs a reset (`nvidia-smi -r`) or a reboot", details)]
    return [Finding("cuda.visible_devices", "ok" if value is not None else "info", message, None, details)]


def check_device_order(ctx: DoctorContext) -> list[Finding]:
    """Whether CUDA's numbering matches nvidia-smi's (PCI bus) numbering."""
    order = ctx.env.get(_ORDER_VAR)
    details = {"value": order, "models": sorted({g.name for g in ctx.gpus if g.name})}
    if order not in (None, "PCI_BUS_ID", "FASTEST_FIRST"):
        return [Finding("cuda.device_order", "fail",
                        f"{_ORDER_VAR}={order!r} is not a value CUDA knows (PCI_BUS_ID, FASTEST_FIRST)",
                        f"export {_ORDER_VAR}=PCI_BUS_ID", details)]
    if order_may_differ(ctx.env, ctx.gpus):
        return [Finding("cuda.device_order", "warn",
                        f"{_ORDER_VAR} is {order or 'unset (FASTEST_FIRST)'} and the GPUs are mixed models "
                        f"({', '.join(details['models'])}): cuda:0 may not be nvidia-smi's GPU 0, and indices in "
                        f"{ENV_VAR} may pick other GPUs than `nvidia-smi` shows",
                        f"export {_ORDER_VAR}=PCI_BUS_ID (gpukit.devices.use_gpus and `gpukit run` set it)", details)]
    why = ("no GPU" if not ctx.gpus else "PCI_BUS_ID: CUDA numbers GPUs like nvidia-smi" if order == "PCI_BUS_ID"
           else "one GPU model, so fastest-first order equals PCI bus order")
    return [Finding("cuda.device_order", "ok", f"{_ORDER_VAR} is {order or 'unset'}: {why}", None, details)]


def _plain(uuid: str | None) -> str:
    text = (uuid or "").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def _same_devices(ctx: DoctorContext, seen: list[str], expected: list[GpuSnapshot]) -> bool:
    if len(seen) != len(expected):
        return False
    if any(not _plain(s) for s in seen):  # a torch without device UUIDs: the count is all there is
        return True
    if not order_may_differ(ctx.env, ctx.gpus):
        return [_plain(s) for s in seen] == [_plain(e.uuid) for e in expected]
    # Fastest-first numbering over mixed models: CUDA's order (and what an index in the variable
    # means) may differ from nvidia-smi's, so only the set can be compared, and only without indices.
    entries = parse_visible_devices(ctx.env.get(ENV_VAR))
    if entries is None or all(e.kind != "index" for e in entries):
        return sorted(map(_plain, seen)) == sorted(_plain(e.uuid) for e in expected)
    return True


def check_cuda_initialized(ctx: DoctorContext) -> list[Finding]:
    """CUDA already initialised here with other devices than the environment names.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once; a change after that is silently ignored. Only a
    Python caller can be in that state: ``gpukit doctor`` is a fresh process.
    """
    name = "cuda.initialized"
    if ctx.from_cli:
        return [Finding(name, "info",
                        "`gpukit doctor` is a fresh process, so CUDA is not initialised here; to check a script's "
                        "own CUDA state call gpukit.doctor.run_checks() inside it", None)]
    seen = ctx.cuda_uuids()
    if seen is None:
        return [Finding(name, "ok", f"CUDA is not initialised in this process yet: {ENV_VAR} changes still count",
                        None)]
    expected = _visible(ctx)[0] if ctx.gpus else None
    details = {"cuda_uuids": seen, "expected_uuids": None if expected is None else [u.uuid for u in expected]}
    set_vars = ", ".join(f"{k}={ctx.env[k]!r}" for k in (ENV_VAR, _ORDER_VAR) if k in ctx.env) or "neither set"
    if expected is None:
        return [Finding(name, "info", f"CUDA is initialised with {len(seen)} device(s) ({set_vars}); "
                        "NVML lists no GPU to compare with", None, details)]
    same_devices = _same_devices(ctx, seen, expected)
    if same_devices:
        return [Finding(name, "ok", f"CUDA is initialised with the devices the environment names ({set_vars}); "
                        "changing them now would be ignored", None, details)]
    want = _mapping(expected)
    return [Finding(name, "fail",
                    f"CUDA was initialised before the environment was changed ({set_vars}): it sees {len(seen)} "
                    f"device(s) where the environment means {want}; the change is silently ignored",
                    _SET_EARLY, details)]
