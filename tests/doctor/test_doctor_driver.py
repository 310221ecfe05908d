"""The NVIDIA driver against the CUDA torch was built with (fake drivers, controlled torch builds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.doctor._driver import check_driver, required_driver


@pytest.mark.parametrize("cuda, expected", [
    ("11.8", ("450.80.02", "520.61.05")),
    ("12.4", ("525.60.13", "550.54.14")),
    ("12.7", ("525.60.13", "560.28.03")),  # no 12.7 release: the newest known 12.x before it
    ("13.0", ("580.65.06", "580.65.06")),
    ("10.2", (None, None)),
    ("garbage", (None, None)),
])
def test_required_driver_table(cuda, expected):
    assert required_driver(cuda) == expected


def test_old_driver_fails_and_names_the_driver_needed(use_spec, make_ctx):
    use_spec("old-driver")  # driver 470.82.01
    [finding] = check_driver(make_ctx(torch_cuda="12.4"))
    assert finding.status == "fail"
    assert "470.82.01" in finding.message and ">= 525.60.13" in finding.message
    assert ">= 550.54.14" in finding.fix
    assert finding.details["minimum_driver"] == "525.60.13"


def test_driver_of_the_right_major_but_older_minor_warns(use_spec, make_ctx):
    use_spec("shared-4gpu")  # driver 535.104.05
    [finding] = check_driver(make_ctx(torch_cuda="12.4"))
    assert finding.status == "warn" and "minor version compatibility" in finding.message
    [finding] = check_driver(make_ctx(torch_cuda="13.0"))
    assert finding.status == "fail" and ">= 580.65.06" in finding.message


def test_new_enough_driver_is_ok(use_spec, make_ctx):
    use_spec("shared-4gpu")
    assert check_driver(make_ctx(torch_cuda="12.1"))[0].status == "ok"
    assert check_driver(make_ctx(torch_cuda="11.8"))[0].status == "ok"


def test_cpu_only_torch_with_gpus_warns_and_without_gpus_is_info(use_spec, make_ctx):
    use_spec("old-driver")
    [finding] = check_driver(make_ctx(torch_cuda=None))
    assert finding.status == "warn" and "CPU-only build" in finding.message
    use_spec("no-driver")
    assert check_driver(make_ctx(torch_cuda=None))[0].status == "info"


def test_torch_build_is_read_without_importing_torch(tmp_path: Path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    (fake / "version.py").write_text("from typing import Optional\n__version__ = '2.4.0+cu121'\n"
                                     "cuda: Optional[str] = '12.1'\nhip = None\n")
    code = "import sys; from gpukit.doctor._context import torch_build; print(torch_build(), 'torch' in sys.modules)"
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{tmp_path}:{src}", "PATH": "/usr/bin:/bin"}).stdout
    assert "version='2.4.0+cu121', cuda='12.1', imported=False" in out and out.strip().endswith("False")
