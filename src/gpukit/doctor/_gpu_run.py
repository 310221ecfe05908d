"""``gpukit doctor --gpu``: measure each GPU in a child process and judge what was measured.

What it measures, per GPU (about 5-10 s each, most of it starting CUDA): copy bandwidth host <->
device from pinned and pageable memory against the PCIe link's peak (generation and width from
NVML, read under load), a large bf16 (or fp16) matrix product against the data sheet's peak with
NVML's clock-event reasons when it falls short, the memory one process can allocate against what
NVML reports free, and ECC / retired-memory state; with two or more GPUs, an all-reduce's bus
bandwidth between them (NCCL). The model: DCGM's ``dcgmi diag`` and nccl-tests, which no training
library ships.

On a shared machine it keeps out of other people's way: a GPU another gpukit job has claimed is
not measured, and where other processes run, memory is not filled (figures then include their work).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

from gpukit.devices import GpuSnapshot
from gpukit.doctor._finding import Finding

__all__ = ["run_gpu_checks"]

_PROBE = "gpukit.doctor._gpu_probe"
_MIB = 2**20


def _targets(gpus: list[GpuSnapshot], indices: list[int] | None) -> list[GpuSnapshot]:
    from gpukit.devices import resolve_visible

    if indices is not None:
        return [g for g in gpus if g.index in set(indices)]
    return [g for g in resolve_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus) if not g.is_mig]


def _probe(args: list[str], uuids: list[str], timeout_s: float) -> tuple[dict | None, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        proc = subprocess.run([sys.executable, "-m", _PROBE, *args], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"no result within {timeout_s:g} s (a hung GPU, or a much slower one than expected)"
    lines = proc.stdout.strip().splitlines()
    said = _json(lines[-1]) if lines else None
    if said is not None and "error" in said:
        return None, str(said["error"])
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"the measuring process exited with status {proc.returncode}: {tail}"
    if said is None:
        return None, f"the measuring process printed no result: {lines[-1][:200]!r}"
    return said, ""


def _json(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run_gpu_checks(indices: list[int] | None = None, *, timeout_s: float = 120.0,
                   progress: Callable[[str], None] | None = None) -> list[Finding]:
    """Measure the GPUs this process would use (``CUDA_VISIBLE_DEVICES``), or the NVML ``indices`` given.

    Returns findings named ``gpu<N>.pcie_link``, ``.copy_bandwidth``, ``.matmul``, ``.memory``,
    ``.errors`` per GPU, and ``gpus.allreduce`` with two or more; one ``gpu.active`` finding when
    there is nothing to measure.
    """
    from gpukit.devices import claim_holders, gpu_health, is_fake_backend, list_gpus, unavailable_reason
    from gpukit.doctor._gpu_verdicts import judge_allreduce, judge_gpu, judge_nvml_facts

    say = progress or (lambda text: None)
    gpus = list_gpus()
    if not gpus:
        return [Finding("gpu.active", "info", f"no NVIDIA GPU: nothing to measure ({unavailable_reason() or 'NVML lists none'})",
                        None)]
    targets = _targets(gpus, indices)
    if not targets:
        return [Finding("gpu.active", "warn", "no GPU to measure: CUDA_VISIBLE_DEVICES hides them all, or the indices "
                        f"given ({indices}) are not GPUs here", "name GPUs from `gpukit ls`")]
    if is_fake_backend():
        say("fake GPUs (GPUKIT_FAKE_GPUS): judging NVML's facts, measuring nothing")
        return [f for g in targets for f in judge_nvml_facts(g.label, g.index, gpu_health(g.index), None)]
    held = claim_holders([g.uuid for g in targets if g.uuid])
    findings: list[Finding] = []
    measured: list[GpuSnapshot] = []
    for gpu in targets:
        prefix = f"gpu{gpu.index}"
        if gpu.uuid in held:
            findings.append(Finding(f"{prefix}.active", "info", f"{gpu.label}: not measured: claimed by another gpukit "
                                    f"job (pid {held[gpu.uuid]}), which the measurements would disturb", None))
            continue
        if not gpu.usable or gpu.mig_enabled:
            why = gpu.error if not gpu.usable else "MIG mode is on (measure its instances' jobs instead)"
            findings.append(Finding(f"{prefix}.active", "warn" if not gpu.usable else "info",
                                    f"{gpu.label}: not measured: {why}", None))
            continue
        others = len(gpu.processes)
        args = ["gpu", "--index", str(gpu.index)]
        if not others and gpu.memory_free_bytes:
            args += ["--alloc-limit-mib", str(gpu.memory_free_bytes // _MIB)]
        say(f"measuring {gpu.label}: copies, a matrix product{', memory' if not others else ''}...")
        probe, error = _probe(args, [gpu.uuid or str(gpu.index)], timeout_s)
        if probe is None:
            findings.append(Finding(f"{prefix}.active", "fail", f"{gpu.label}: {error}",
                                    "run `gpukit doctor` (no --gpu) and `nvidia-smi`; a GPU that hangs needs a reset"))
            continue
        findings.extend(judge_gpu(gpu.label, gpu.index, gpu.name, gpu_health(gpu.index), probe, others))
        measured.append(gpu)
    if len(measured) >= 2:
        say(f"measuring an all-reduce over {len(measured)} GPUs...")
        result, error = _probe(["allreduce", "--world", str(len(measured))], [g.uuid or str(g.index) for g in measured],
                               timeout_s)
        findings.append(judge_allreduce(result, [gpu_health(g.index) for g in measured]) if result is not None
                        else Finding("gpus.allreduce", "fail", f"all-reduce over {len(measured)} GPUs: {error}",
                                     "run `NCCL_DEBUG=INFO gpukit doctor --gpu` and read NCCL's own lines"))
    return findings
