"""docs/doctor.md's "try it" prints what the page says it prints (issue 41.17): on the torch installed here
-- a CPU-only build, as `make demo` installs, or a CUDA build -- every line the page quotes for that build."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "doctor.md").read_text()


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None


def test_try_it_prints_the_lines_the_page_quotes_for_this_torch(tmp_path: Path) -> None:
    try_it = re.search(r"`(GPUKIT_FAKE_GPUS=(\S+) gpukit doctor)`", PAGE)
    assert try_it, "docs/doctor.md has no `GPUKIT_FAKE_GPUS=... gpukit doctor` to try"
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(ROOT / try_it.group(2)), "GPUKIT_SHM_PATH": str(tmp_path)}
    env.pop("CUDA_DEVICE_ORDER", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-m", "gpukit", "doctor"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT).stdout
    blocks = re.findall(r"^```\n(.*?)^```", PAGE, re.M | re.S)
    quoted = next(b for b in blocks if "CPU-only build" in b)  # the block after "with a CPU-only torch"
    if _cpu_only_torch():
        import torch

        quoted = re.sub(r"torch \S+\+cpu", f"torch {torch.__version__}", quoted)  # the page names 2.13's
    else:  # a CUDA build: the driver line of the page's first example instead (its torch named there)
        quoted = re.sub(r"WARN driver\.cuda: .*", "FAIL driver.cuda: NVIDIA driver 470.82.01 is too old for torch", quoted)
    for line in quoted.splitlines():
        if not line.startswith(("WARN ", "FAIL ")):
            continue
        shown = line.split("...")[0].strip()  # the page shortens long lines with "..."
        assert shown in out, f"docs/doctor.md quotes:\n{shown}\n`gpukit doctor` printed:\n{out}"
