"""CPU affinity and cgroup quota, MIG mode and persistence mode (fake NVML)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukit._util.cpu import usable_cpu_count
from gpukit.devices import FakeNvml
from gpukit.devices._spec import parse_spec
from gpukit.doctor._system import (cgroup_cpu_limit, check_cpu_load, check_cpus, check_mig, check_persistence,
                                   check_versions)
from gpukit.errors import FakeSpecError

_GPU = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "memory_used_mib": 0}


def test_cgroup_quota_v2_and_v1(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(str(v1)) == 2.0


def test_quota_below_affinity_warns_with_thread_and_worker_fix(tmp_path: Path, make_ctx):
    (tmp_path / "cpu.max").write_text("10000 100000\n")  # 0.1 CPU, below any affinity
    [finding] = check_cpus(make_ctx(), cgroup_root=str(tmp_path))
    assert finding.status == "warn" and "0.1 CPUs" in finding.message
    assert "OMP_NUM_THREADS=1" in finding.fix
    (tmp_path / "cpu.max").write_text("max 100000\n")
    [finding] = check_cpus(make_ctx({"OMP_NUM_THREADS": "2"}), cgroup_root=str(tmp_path))
    assert finding.status in ("ok", "info") and finding.details["affinity"] == usable_cpu_count()
    assert "OMP_NUM_THREADS=2" in finding.message


def test_busy_cpus_warn_that_default_threads_oversubscribe_them(make_ctx):
    # issue 41.13: a shared, busy machine; torch's default one thread per core competes with the other work
    usable = usable_cpu_count()
    [busy] = check_cpu_load(make_ctx(), loadavg=(3.0 * usable, 2.0 * usable, usable))
    assert busy.status == "warn" and "oversubscribes" in busy.message and "OMP_NUM_THREADS unset" in busy.message
    assert "export OMP_NUM_THREADS=1" in busy.fix  # no core is free: one thread
    [quiet] = check_cpu_load(make_ctx({"OMP_NUM_THREADS": "1"}), loadavg=(0.1, 0.1, 0.1))
    assert quiet.status == "ok" and quiet.details["omp_num_threads"] == "1"
    # threads already set to what other work leaves free: said, not warned; more than that: warned
    [fits] = check_cpu_load(make_ctx({"OMP_NUM_THREADS": "1"}), loadavg=(3.0 * usable, 2.0 * usable, usable))
    assert fits.status == "info" and "OMP_NUM_THREADS=1 fits" in fits.message
    [many] = check_cpu_load(make_ctx({"OMP_NUM_THREADS": "64"}), loadavg=(3.0 * usable, 2.0 * usable, usable))
    assert many.status == "warn" and "OMP_NUM_THREADS=64" in many.message


def test_mig_enabled_without_instances_warns(use_spec, make_ctx):
    use_spec({"gpus": [dict(_GPU, mig_mode=True), dict(_GPU, mig_mode=False)]})
    [finding] = check_mig(make_ctx())
    assert finding.status == "warn" and "GPU 0" in finding.message and "-mig 0" in finding.fix
    use_spec("mig-a100")
    [finding] = check_mig(make_ctx())
    assert finding.status == "info" and "3g.20gb" in finding.message
    use_spec("shared-4gpu")
    assert check_mig(make_ctx())[0].status == "ok"


def test_persistence_mode_off_is_reported_with_the_command(use_spec, make_ctx):
    use_spec("old-driver")
    [finding] = check_persistence(make_ctx())
    assert finding.status == "info" and "GPU 0,1" in finding.message and "nvidia-smi -i 0,1 -pm 1" in finding.fix
    use_spec({"gpus": [dict(_GPU, persistence_mode=True), _GPU]})
    [finding] = check_persistence(make_ctx())
    assert finding.status == "ok" and finding.details["persistence_mode"] == {"0": True, "1": None}


def test_fake_persistence_mode_behaves_like_nvml():
    import pynvml

    with FakeNvml({"gpus": [dict(_GPU, persistence_mode=False), _GPU]}) as fake:
        fake.nvmlInit()
        assert fake.nvmlDeviceGetPersistenceMode(fake.nvmlDeviceGetHandleByIndex(0)) == pynvml.NVML_FEATURE_DISABLED
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetPersistenceMode(fake.nvmlDeviceGetHandleByIndex(1))
    with pytest.raises(FakeSpecError, match=r"gpus\[0\].persistence_mode.*true or false"):
        parse_spec({"gpus": [dict(_GPU, persistence_mode="on")]})


def test_versions_name_torch_and_driver(use_spec, make_ctx):
    use_spec("old-driver")
    [finding] = check_versions(make_ctx(torch_version="2.4.0", torch_cuda="12.1"))
    assert finding.status == "info"
    assert {"torch": "2.4.0", "torch_cuda": "12.1", "nvidia_driver": "470.82.01"}.items() <= finding.details.items()
