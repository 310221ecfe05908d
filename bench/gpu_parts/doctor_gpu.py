"""gpu-check part `doctor_gpu`: `gpukit doctor --gpu --json`, every active finding as a result.

In a dry run the unhealthy fake spec stands in (NVML facts judged, nothing measured): its
findings are recorded as `info`, since their warnings and failures are the spec's, by design.
"""

from __future__ import annotations

import json
import re
import tempfile

from _common import DRY, ROOT, emit, gpukit_cli

SPEC = ROOT / "examples" / "fake-gpus" / "unhealthy-2gpu.json"
ACTIVE = re.compile(r"gpu(\d+|s)\.|gpu\.active$")  # gpu3.matmul, gpus.allreduce, gpu.active


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-claims-") as claims:
        env = {"GPUKIT_CLAIM_DIR": claims, **({"GPUKIT_FAKE_GPUS": str(SPEC)} if DRY else {})}
        proc = gpukit_cli("doctor", "--gpu", "--json", timeout_s=300, env=env)
    findings = json.loads(proc.stdout)["findings"]
    active = [f for f in findings if ACTIVE.match(f["name"])]
    for f in active:
        details = f.get("details") or {}
        value = details.get("share_of_peak") or details.get("share")
        status = "info" if DRY else {"ok": "ok", "info": "info", "warn": "warn", "fail": "fail"}[f["status"]]
        emit(f["name"], status, None if value is None else 100 * value, None if value is None else "% of peak",
             f["message"][:300])
    emit("gpukit doctor --gpu", "ok" if active else "fail", len(active), "findings", f"exit {proc.returncode}")


if __name__ == "__main__":
    main()
