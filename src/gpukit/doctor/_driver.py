"""The NVIDIA driver against the CUDA version torch was built with.

Sources: NVIDIA's CUDA Compatibility guide ("Minor Version Compatibility", table "CUDA Toolkit
11.x, 12.x, and 13.x Driver Version Ranges") and the CUDA Toolkit Release Notes (table
"CUDA Toolkit and Corresponding Driver Versions"), Linux x86_64.

* Below the minimum of the CUDA *major* version, CUDA cannot start at all ("CUDA driver version
  is insufficient for CUDA runtime version").
* At or above it but below the driver the toolkit *minor* version shipped with, CUDA runs
  through minor version compatibility, without the newer features; PTX that the runtime
  compiles (e.g. for a GPU newer than the wheel's kernels) can fail with "the provided PTX was
  compiled with an unsupported toolchain".
"""

from __future__ import annotations

from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["MAJOR_MINIMUM_DRIVER", "TOOLKIT_DRIVER", "check_driver", "required_driver"]

#: CUDA major -> minimum Linux driver for any toolkit of that major (minor version compatibility)
MAJOR_MINIMUM_DRIVER: dict[int, str] = {
    11: "450.80.02",
    12: "525.60.13",
    13: "580.65.06",  # the guide says ">= 580"; 580.65.06 is the first R580 release (CUDA 13.0 GA)
}

#: CUDA major.minor -> the Linux driver that toolkit's GA release shipped with (all of its features)
TOOLKIT_DRIVER: dict[tuple[int, int], str] = {
    (11, 0): "450.51.05", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01",
    (11, 4): "470.42.01", (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}


def _parse(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in version.strip().split("."))
    except ValueError:
        return None


def required_driver(cuda_version: str) -> tuple[str | None, str | None]:
    """``(minimum for the major version, driver of that exact toolkit)`` for ``"12.4"``; ``None`` if unknown."""
    parts = _parse(cuda_version)
    if not parts or len(parts) < 2:
        return None, None
    major, minor = parts[0], parts[1]
    exact = TOOLKIT_DRIVER.get((major, minor))
    if exact is None:  # a minor release newer than the table: the newest known of that major
        known = [v for (ma, mi), v in TOOLKIT_DRIVER.items() if ma == major and mi <= minor]
        exact = known[-1] if known else None
    return MAJOR_MINIMUM_DRIVER.get(major), exact


def _older(version: str, than: str) -> bool:
    a, b = _parse(version), _parse(than)
    return a is not None and b is not None and a < b


def check_driver(ctx: DoctorContext) -> list[Finding]:
    """Whether the installed driver can run the CUDA that torch was built with."""
    name = "driver.cuda"
    driver, cuda = ctx.driver_version, ctx.torch.cuda
    details = {"driver_version": driver, "torch_cuda": cuda, "torch_version": ctx.torch.version}
    if ctx.torch.version is None:
        return [Finding(name, "warn", f"torch is not installed (driver {driver or 'n/a'})",
                        "pip install torch (https://pytorch.org/get-started/locally/ picks the CUDA build)", details)]
    if cuda is None:
        if driver is not None:
            return [Finding(name, "warn",
                            f"torch {ctx.torch.version} is a CPU-only build but NVIDIA driver {driver} and "
                            f"{len(ctx.gpus)} GPU(s) are here: training will not use them",
                            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)", details)]
        return [Finding(name, "info", f"torch {ctx.torch.version} is a CPU-only build; no NVIDIA driver here",
                        None, details)]
    if driver is None:
        return [Finding(name, "info" if not ctx.gpus else "warn",
                        f"torch {ctx.torch.version} is built with CUDA {cuda}, but there is no NVIDIA driver here "
                        f"({ctx.nvml_reason or 'NVML unavailable'}): torch runs on the CPU",
                        None if not ctx.gpus else "install the NVIDIA driver", details)]
    minimum, exact = required_driver(cuda)
    details.update({"minimum_driver": minimum, "toolkit_driver": exact})
    if minimum is None:
        return [Finding(name, "info", f"driver {driver}, torch built with CUDA {cuda} (no table entry to compare)",
                        None, details)]
    if _older(driver, minimum):
        return [Finding(name, "fail",
                        f"NVIDIA driver {driver} is too old for torch {ctx.torch.version} (CUDA {cuda}): CUDA "
                        f"{cuda.split('.')[0]}.x needs driver >= {minimum}, so torch.cuda.is_available() is False "
                        "(\"driver version is insufficient\")",
                        f"upgrade the driver to >= {exact or minimum}, or install a torch build for an older CUDA "
                        "(https://pytorch.org/get-started/previous-versions/)", details)]
    if exact is not None and _older(driver, exact):
        return [Finding(name, "warn",
                        f"NVIDIA driver {driver} is older than CUDA {cuda}'s own ({exact}): torch runs through "
                        "minor version compatibility, but runtime-compiled PTX (e.g. on a GPU newer than the "
                        "wheel's kernels) may fail with \"unsupported toolchain\"",
                        f"upgrade the driver to >= {exact} when you can", details)]
    return [Finding(name, "ok", f"NVIDIA driver {driver} runs torch {ctx.torch.version}'s CUDA {cuda}"
                    f" (needs >= {exact or minimum})", None, details)]
