"""use_gpus() sets CUDA_VISIBLE_DEVICES + CUDA_DEVICE_ORDER, and refuses once CUDA is initialised."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import pytest

from gpukit.devices import claim_gpus, cuda_initialized, list_gpus, select_gpus, use_gpus
from gpukit.errors import ConfigurationError, CudaAlreadyInitializedError, DeviceError


def test_sets_both_variables_from_snapshots(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    result = use_gpus(select_gpus(2, share=True))
    assert result == {"CUDA_VISIBLE_DEVICES": "2,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,1" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_other_forms_and_child_env(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    child: dict[str, str] = {}
    assert use_gpus([3, "0"], env=child)["CUDA_VISIBLE_DEVICES"] == "3,0"
    assert child["CUDA_VISIBLE_DEVICES"] == "3,0" and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert use_gpus("GPU-7c1d", env=child)["CUDA_VISIBLE_DEVICES"] == "GPU-7c1d"
    assert use_gpus([], env=child)["CUDA_VISIBLE_DEVICES"] == ""  # hide every GPU
    with claim_gpus(1) as claim:
        assert use_gpus(claim, env=child)["CUDA_VISIBLE_DEVICES"] == "2"


def test_mig_devices_by_mig_uuid(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    mig = list_gpus()[0].mig_devices[1]
    assert use_gpus([mig], env={})["CUDA_VISIBLE_DEVICES"] == mig.uuid


@pytest.mark.parametrize(
    ("gpus", "error", "pattern"),
    [
        ([9], DeviceError, r"Cannot use GPU 9: there is no such GPU. GPUs here: GPU 0 \(NVIDIA TITAN X"),
        (["GPU-ffff"], DeviceError, r"no GPU has that UUID"),
        ([-1], ConfigurationError, r"indices start at 0"),
        (["cuda:1"], ConfigurationError, r"Cannot use GPU 'cuda:1': give an index as nvidia-smi shows it"),
        ([1, 1], ConfigurationError, r"name a GPU twice"),
        ([True], ConfigurationError, r"Cannot use GPU True"),
    ],
)
def test_bad_gpus(use_spec: Callable[[Any], Any], gpus: list[Any], error: type, pattern: str) -> None:
    use_spec("shared-4gpu")
    with pytest.raises(error, match=pattern):
        use_gpus(gpus, env={})


def test_without_driver(use_spec: Callable[[Any], Any]) -> None:
    use_spec("no-driver")
    with pytest.raises(DeviceError, match=r"no NVIDIA GPU/driver found"):
        use_gpus([0], env={})


def test_cuda_initialized_consults_only_sys_modules(monkeypatch: pytest.MonkeyPatch,
                                                     use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")

    class StubCuda:
        @staticmethod
        def is_initialized() -> bool:
            return True

    monkeypatch.setitem(sys.modules, "torch.cuda", StubCuda)
    assert cuda_initialized()
    with pytest.raises(CudaAlreadyInitializedError, match=r"CUDA is already initialised.*silently ignored"):
        use_gpus([1])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert use_gpus([1], env={})  # preparing a child's environment is still fine


# A stub torch whose CUDA is "initialised": the guard must trigger without a GPU and without real torch.
STUB = r"""
import os, sys, types
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)
sys.modules["torch"] = torch
from gpukit.devices import cuda_initialized, use_gpus
from gpukit.errors import CudaAlreadyInitializedError
assert cuda_initialized()
os.environ["CUDA_VISIBLE_DEVICES"] = "2"
os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
use_gpus([2])  # unchanged value: harmless, allowed
try:
    use_gpus([0, 1])
except CudaAlreadyInitializedError as exc:
    print("refused:", exc)
assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
assert sys.modules["torch"] is torch  # never imported the real torch
"""


def test_guard_in_a_fresh_process_with_stub_torch(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    out = subprocess.run([sys.executable, "-c", STUB], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused: Cannot set CUDA_VISIBLE_DEVICES='0,1'" in out.stdout
    assert "started with CUDA_VISIBLE_DEVICES='2'" in out.stdout


def test_devices_layer_never_imports_torch(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    script = ("import sys\nfrom gpukit.devices import *\n"
              "list_gpus(); select_gpus(1); describe_mapping(); use_gpus([1], env={})\n"
              "assert not cuda_initialized()\nassert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
