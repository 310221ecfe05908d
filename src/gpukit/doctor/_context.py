"""The facts every check reads, gathered once per ``run_checks()`` (and replaceable in tests)."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from gpukit.cluster import ClusterEnvironment, environment
from gpukit.devices import GpuSnapshot
from gpukit._util.envvars import SHM_PATH_ENV
from gpukit.errors import GpukitError

__all__ = ["DoctorContext", "TorchBuild", "torch_build", "cuda_device_uuids", "SHM_PATH_ENV"]


@dataclass(frozen=True)
class TorchBuild:
    """torch as installed: ``version`` ``None`` without torch; ``cuda`` ``None`` for a CPU/ROCm build."""

    version: str | None
    cuda: str | None
    imported: bool


def torch_build() -> TorchBuild:
    """torch's version and the CUDA version it was built with, without importing torch.

    An imported torch is asked directly; otherwise ``torch/version.py`` (plain assignments
    written at build time) is read, which costs milliseconds instead of a torch import.
    """
    torch = sys.modules.get("torch")
    version_mod = getattr(torch, "version", None) if torch is not None else None
    if version_mod is not None:
        return TorchBuild(getattr(torch, "__version__", None), getattr(version_mod, "cuda", None), True)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild(None, None, False)
    values: dict[str, Any] = {}
    for location in spec.submodule_search_locations:
        try:
            tree = ast.parse((Path(location) / "version.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
                node.target if isinstance(node, ast.AnnAssign) else None)
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                values[target.id] = value.value
        break
    version = values.get("__version__")
    cuda = values.get("cuda")
    return TorchBuild(version if isinstance(version, str) else None, cuda if isinstance(cuda, str) else None, False)


def cuda_device_uuids() -> list[str] | None:
    """UUIDs of the devices CUDA numbers ``cuda:0, cuda:1, ...`` in this process, as torch sees them.

    ``None`` when this process has not initialised CUDA: asking would initialise it (and fix
    ``CUDA_VISIBLE_DEVICES`` for the rest of the process), so nothing is asked.
    """
    from gpukit.devices import cuda_initialized

    if not cuda_initialized():
        return None
    torch = sys.modules["torch"]
    uuids = []
    # torch.cuda.get_device_properties checks the index against that changed count too (2.11
    # raised "Invalid device id"); the function CUDA's initialisation defines does not.
    properties = getattr(torch.cuda, "_get_device_properties", torch.cuda.get_device_properties)
    for index in range(_initialised_device_count(torch)):
        props = properties(index)
        uuids.append(str(getattr(props, "uuid", "")))
    return uuids


def _initialised_device_count(torch: Any) -> int:
    """The devices the CUDA runtime of this process numbers, not what the environment says now.

    ``torch.cuda.device_count()`` of torch <= 2.11 counts through NVML with the *current*
    ``CUDA_VISIBLE_DEVICES`` until its cache is filled, so after a late change it reports the
    changed count although the initialised runtime still uses the old devices (seen on an H100
    with torch 2.11: 0 where CUDA had 1). The runtime's own count is the truth here.
    """
    runtime_count = getattr(torch._C, "_cuda_getDeviceCount", None)
    return int(runtime_count()) if runtime_count is not None else int(torch.cuda.device_count())


@dataclass
class DoctorContext:
    """What the checks look at.

    Attributes:
        env: the environment (``os.environ`` by default).
        gpus: NVML snapshots (``[]`` without a driver).
        driver_version: the NVIDIA driver, ``None`` without one.
        nvml_reason: why NVML is unavailable, ``None`` when it works.
        torch: the installed torch build.
        from_cli: ``True`` for ``gpukit doctor`` (a fresh process, so CUDA cannot be initialised).
        shm_path: the shared-memory filesystem to measure.
        shm_source: where ``shm_path`` came from: ``"--shm-path"``, ``"GPUKIT_SHM_PATH"`` or
            ``"default"`` (only the default may be missing without a failure: a container without it).
        cuda_uuids: returns the UUIDs CUDA sees here, or ``None`` when CUDA is not initialised.
        cluster: where the job runs (:func:`gpukit.cluster.environment`); ``None`` when its
            variables are contradictory (``cluster_error`` says how).
        cluster_error: the detector's error message, else ``None``.
        extra: room for checks to share facts with the report.
    """

    env: Mapping[str, str]
    gpus: list[GpuSnapshot]
    driver_version: str | None
    nvml_reason: str | None
    torch: TorchBuild
    from_cli: bool = False
    shm_path: str = "/dev/shm"
    shm_source: str = "default"
    cuda_uuids: Callable[[], list[str] | None] = cuda_device_uuids
    cluster: ClusterEnvironment | None = None
    cluster_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def gather(cls, *, env: Mapping[str, str] | None = None, from_cli: bool = False,
               shm_path: str | os.PathLike[str] | None = None, shm_source: str | None = None) -> DoctorContext:
        """Read the machine once: NVML snapshots, driver, torch build, the environment."""
        from gpukit.devices import driver_version, list_gpus, unavailable_reason

        env = os.environ if env is None else env
        gpus = list_gpus()
        cluster, cluster_error = None, None
        try:
            cluster = environment(env)
        except GpukitError as exc:  # contradictory launcher/SLURM variables: a finding, not a crash
            cluster_error = str(exc)
        return cls(
            env=env, gpus=gpus, driver_version=driver_version(), nvml_reason=unavailable_reason(),
            torch=torch_build(), from_cli=from_cli, cluster=cluster, cluster_error=cluster_error,
            shm_path=os.fspath(shm_path) if shm_path is not None else env.get(SHM_PATH_ENV) or "/dev/shm",
            shm_source=shm_source or ("shm_path" if shm_path is not None else
                                      SHM_PATH_ENV if env.get(SHM_PATH_ENV) else "default"),
        )
