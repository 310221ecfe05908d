"""gpu-check part `doctor_gpu`: `gpukit doctor --gpu --json`, every active finding as a result.

A finding judged against a per-model floor (copies, matmul, device memory bandwidth) is a result
with a goal: its sustained minimum, the floor, met or not (the message names the floor missed).

In a dry run the unhealthy fake spec stands in (NVML facts judged, nothing measured): its
findings are recorded as `info`, since their warnings and failures are the spec's, by design.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

from _common import DRY, ROOT, emit, gpukit_cli, judged

SPEC = ROOT / "examples" / "fake-gpus" / "unhealthy-2gpu.json"
ACTIVE = re.compile(r"gpu(\d+|s)\.|gpu\.active$")  # gpu3.matmul, gpus.allreduce, gpu.active


# finding -> (its sustained figure in details, unit, the floor's key in details): the per-model floors
FLOORS = {"copy_bandwidth": (("h2d_pinned_min_gbps", "d2h_pinned_min_gbps"), "GB/s", "floor_gbps"),
          "matmul": (("tflops_min",), "TFLOP/s", "floor_tflops"),
          "memory_bandwidth": (("min_gbps",), "GB/s", "floor_gbps")}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-claims-") as claims:
        env = {"GPUKIT_CLAIM_DIR": claims, **({"GPUKIT_FAKE_GPUS": str(SPEC)} if DRY else {})}
        # within the part's own limit: killed by the driver first, the part would write nothing at all
        limit_s = float(os.environ.get("GPUKIT_CHECK_PART_LIMIT_S", 90))
        try:
            proc = gpukit_cli("doctor", "--gpu", "--json", timeout_s=max(10.0, limit_s - 10), env=env)
        except subprocess.TimeoutExpired:
            emit("doctor --gpu", "fail", detail=f"did not finish within {max(10.0, limit_s - 10):.0f} s "
                 f"(the part's limit is {limit_s:.0f} s)")
            return
    findings = json.loads(proc.stdout)["findings"]
    active = [f for f in findings if ACTIVE.match(f["name"])]
    for f in active:
        details = f.get("details") or {}
        kind = f["name"].split(".", 1)[-1]
        if kind in FLOORS and details.get(FLOORS[kind][2]) is not None:
            keys, unit, floor_key = FLOORS[kind]
            sustained = min(details[k] for k in keys if details.get(k) is not None)
            judged(f["name"], sustained, unit, f"sustained minimum >= {details[floor_key]:.4g} {unit}",
                   f["status"] == "ok", f["message"][:300])
            continue
        value = details.get("share_of_peak") or details.get("share")
        status = "info" if DRY else {"ok": "ok", "info": "info", "warn": "warn", "fail": "fail"}[f["status"]]
        emit(f["name"], status, None if value is None else 100 * value, None if value is None else "%",
             f["message"][:300])
    emit("gpukit doctor --gpu", "ok" if active else "fail", len(active), "findings", f"exit {proc.returncode}")


if __name__ == "__main__":
    main()
