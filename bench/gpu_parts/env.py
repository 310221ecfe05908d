"""gpu-check part `env`: what the machine is, so every figure can be read against it."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess
import sys

from _common import DRY, emit, guarded

PACKAGES = ("torch", "nvidia-ml-py", "accelerate", "lightning", "transformers", "psutil", "filelock", "rich",
            "click", "numpy", "safetensors", "pytest", "pytest-timeout", "scikit-learn", "tensorboard",
            "selenium", "nbclient", "ipykernel", "mlflow", "wandb")


def torch_facts() -> None:
    import torch

    emit("torch", "info", detail=f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
                                 f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})")
    if DRY:
        emit("cuda device", "skip", detail="dry run: the CPU")
        return
    props = torch.cuda.get_device_properties(0)
    emit("cuda device", "info", detail=f"{torch.cuda.device_count()} x {props.name}, capability "
                                       f"{props.major}.{props.minor}, {props.multi_processor_count} SMs, "
                                       f"{props.total_memory / 2**30:.1f} GiB, bf16 {torch.cuda.is_bf16_supported()}")


def driver_facts() -> None:
    from gpukit.devices import driver_version, unavailable_reason

    version = driver_version()
    emit("driver", "info" if version else ("skip" if DRY else "fail"), detail=version or str(unavailable_reason()))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        emit("nvidia-smi", "skip", detail="not on PATH")
        return
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    emit("nvidia-smi -L", "info", detail=out.stdout.strip().replace("\n", "; "))


def main() -> None:
    emit("python", "info", detail=f"{sys.version.split()[0]} on {platform.machine()}, {platform.platform()}")
    guarded("torch", torch_facts)
    guarded("driver", driver_facts)
    for name in PACKAGES:
        try:
            emit(f"package {name}", "info", detail=importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            emit(f"package {name}", "skip", detail="not installed: the checks that need it skip")


if __name__ == "__main__":
    main()
