"""gpu-check part `nvml`: real NVML through nvidia-ml-py, field by field against nvidia-smi.

`gpukit ls --json` against `nvidia-smi --query-gpu=... --format=csv`, `gpukit select`, a claim of
the real UUID seen by a second process, `gpukit doctor`, and the in-process query latency. In a
dry run the fake 4-GPU spec stands in for the driver and the spec itself for nvidia-smi's rows.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from _common import DRY, ROOT, emit, gpukit_cli, guarded

FIELDS = "index,uuid,name,pci.bus_id,memory.total,memory.used,temperature.gpu,power.limit,compute_mode"
SPEC = ROOT / "examples" / "fake-gpus" / "shared-4gpu.json"


def smi_rows() -> list[dict[str, str]]:
    """nvidia-smi's view, one dict per GPU (the spec's values in a dry run)."""
    if DRY:
        spec = json.loads(SPEC.read_text())["gpus"]
        return [{"index": str(i), "uuid": g["uuid"], "name": g["name"], "pci.bus_id": g["pci_bus_id"],
                 "memory.total": str(g["memory_total_mib"]), "memory.used": str(g["memory_used_mib"]),
                 "temperature.gpu": str(g["temperature_c"]), "power.limit": f"{g['power_limit_w']:.2f}",
                 "compute_mode": g["compute_mode"]} for i, g in enumerate(spec)]
    out = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", f"--query-gpu={FIELDS}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30, check=True)
    keys = FIELDS.split(",")
    return [dict(zip(keys, (c.strip() for c in line.split(",")))) for line in out.stdout.strip().splitlines()]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def compare(ls_gpu: dict, row: dict[str, str]) -> list[tuple[str, bool, str]]:
    """(field, agrees, "gpukit X / nvidia-smi Y") for each field both report."""
    mib = 2**20
    checks = [
        ("index", ls_gpu["index"] == int(row["index"]), f"{ls_gpu['index']} / {row['index']}"),
        ("uuid", ls_gpu["uuid"] == row["uuid"], f"{ls_gpu['uuid']} / {row['uuid']}"),
        ("name", ls_gpu["name"] == row["name"], f"{ls_gpu['name']} / {row['name']}"),
        ("pci_bus_id", (ls_gpu["pci_bus_id"] or "").upper()[-12:] == row["pci.bus_id"].upper()[-12:],
         f"{ls_gpu['pci_bus_id']} / {row['pci.bus_id']}"),
        ("memory_total", ls_gpu["memory_total_bytes"] // mib == int(row["memory.total"]),
         f"{ls_gpu['memory_total_bytes'] // mib} / {row['memory.total']} MiB"),
        # used memory and temperature move between the two reads: a small tolerance
        ("memory_used", abs(ls_gpu["memory_used_bytes"] / mib - int(row["memory.used"])) <= 64,
         f"{ls_gpu['memory_used_bytes'] / mib:.0f} / {row['memory.used']} MiB"),
        ("compute_mode", (ls_gpu["compute_mode"] or "").lower() == row["compute_mode"].lower().replace(" ", "_"),
         f"{ls_gpu['compute_mode']} / {row['compute_mode']}"),
    ]
    temp, limit = _number(row["temperature.gpu"]), _number(row["power.limit"])
    if temp is not None and ls_gpu["temperature_c"] is not None:
        checks.append(("temperature", abs(ls_gpu["temperature_c"] - temp) <= 3, f"{ls_gpu['temperature_c']} / {temp:g} C"))
    if limit is not None and ls_gpu["power_limit_w"] is not None:
        checks.append(("power_limit", abs(ls_gpu["power_limit_w"] - limit) <= 1, f"{ls_gpu['power_limit_w']:g} / {limit:g} W"))
    return checks


def ls_vs_smi(env: dict[str, str]) -> None:
    proc = gpukit_cli("ls", "--json", env=env)
    listed = json.loads(proc.stdout)["gpus"]
    rows = smi_rows()
    emit("gpu count", "ok" if len(listed) == len(rows) else "fail", len(listed), "GPUs", f"nvidia-smi {len(rows)}")
    for gpu, row in zip(listed, rows):
        for field, agrees, said in compare(gpu, row):
            emit(f"ls vs nvidia-smi gpu{gpu['index']} {field}", "ok" if agrees else "fail", detail=said)


def select_and_claim(env: dict[str, str]) -> None:
    from gpukit.devices import claim_gpus, list_gpus

    proc = gpukit_cli("select", env=env)
    emit("gpukit select", "ok" if proc.returncode == 0 and proc.stdout.strip() else "fail",
         detail=f"exit {proc.returncode}: {proc.stdout.strip()[:80]}")
    free = [g for g in list_gpus() if not g.processes and g.usable]
    if not free:
        emit("claim of a real UUID", "skip", detail="every GPU has processes on it")
        return
    with claim_gpus(gpus=[free[0].uuid], claim_dir=env["GPUKIT_CLAIM_DIR"]) as claim:
        held = json.loads(gpukit_cli("ls", "--json", env=env).stdout)["claims"]
        seen = any(free[0].uuid in json.dumps(c) for c in held)
        emit("claim seen by another process", "ok" if seen else "fail", detail=f"{free[0].uuid}: {held!s:.200}")
    after = json.loads(gpukit_cli("ls", "--json", env=env).stdout)["claims"]
    emit("claim released", "ok" if not any(free[0].uuid in json.dumps(c) for c in after) else "fail",
         detail=f"released={claim.released}")


def doctor(env: dict[str, str]) -> None:
    proc = gpukit_cli("doctor", "--json", env=env)
    result = json.loads(proc.stdout)
    bad = [f"{f['name']}: {f['message'][:120]}" for f in result["findings"] if f["status"] in ("warn", "fail")]
    emit("gpukit doctor", "ok" if proc.returncode == 0 else "fail", detail=f"exit {proc.returncode}; " + "; ".join(bad)[:400])


def query_latency() -> None:
    from gpukit.devices import list_gpus

    list_gpus()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        gpus = list_gpus()
        times.append(time.perf_counter() - start)
    per = statistics.median(times) / max(len(gpus), 1)
    emit("list_gpus() latency", "info", statistics.median(times) * 1e6, "us",
         f"{len(gpus)} GPU(s), {per * 1e6:.0f} us per GPU, {sum(len(g.processes) for g in gpus)} process(es)")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-claims-") as claims:
        env = {"GPUKIT_CLAIM_DIR": claims}
        if DRY:
            env["GPUKIT_FAKE_GPUS"] = str(SPEC)
        os.environ.update(env)
        guarded("ls vs nvidia-smi", ls_vs_smi, env)
        guarded("select and claim", select_and_claim, env)
        guarded("gpukit doctor", doctor, env)
        guarded("list_gpus() latency", query_latency)


if __name__ == "__main__":
    main()
