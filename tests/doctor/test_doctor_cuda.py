"""CUDA_VISIBLE_DEVICES mapping, CUDA_DEVICE_ORDER, and CUDA initialised before the environment changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpukit.doctor._cuda import check_cuda_initialized, check_device_order, check_visible_devices

SHARED = ["GPU-5a9b0c3e-1f2d-4e6a-8b7c-0d1e2f3a4b5c", "GPU-6b0c1d4f-2a3e-4f7b-9c8d-1e2f3a4b5c6d",
          "GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e", "GPU-8d2e3f6b-4c5a-4b9d-9e0f-3a4b5c6d7e8f"]


def test_mapping_names_the_physical_gpu_of_each_logical_device(use_spec, make_ctx):
    use_spec("shared-4gpu")
    [finding] = check_visible_devices(make_ctx({"CUDA_VISIBLE_DEVICES": "2,3"}))
    assert finding.status == "ok"
    assert "cuda:0 -> GPU 2" in finding.message and "cuda:1 -> GPU 3" in finding.message
    assert [(m["logical"], m["index"]) for m in finding.details["mapping"]] == [(0, 2), (1, 3)]


def test_unknown_entry_fails_and_says_what_cuda_ignores(use_spec, make_ctx):
    use_spec("shared-4gpu")
    [finding] = check_visible_devices(make_ctx({"CUDA_VISIBLE_DEVICES": "1,9,0"}))
    assert finding.status == "fail"
    assert "'9' is not a GPU here" in finding.message and "cuda:0 -> GPU 1" in finding.message
    assert "0, 1, 2, 3" in finding.fix


def test_duplicate_entry_hides_every_gpu(use_spec, make_ctx):
    use_spec("shared-4gpu")
    [finding] = check_visible_devices(make_ctx({"CUDA_VISIBLE_DEVICES": "1,1"}))
    assert finding.status == "fail" and "hides every GPU" in finding.message


def test_empty_value_hides_every_gpu(use_spec, make_ctx):
    use_spec("shared-4gpu")
    [finding] = check_visible_devices(make_ctx({"CUDA_VISIBLE_DEVICES": ""}))
    assert finding.status == "warn" and finding.fix


def test_lost_gpu_in_the_mapping_is_flagged(use_spec, make_ctx):
    use_spec("lost-gpu")
    [finding] = check_visible_devices(make_ctx({}))
    assert finding.status == "warn" and "unusable" in finding.message


def test_mixed_models_without_pci_bus_id_order_warn(use_spec, make_ctx):
    use_spec("old-driver")  # GTX 1080 Ti + RTX 3090
    [finding] = check_device_order(make_ctx({}))
    assert finding.status == "warn" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in finding.fix
    [finding] = check_device_order(make_ctx({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert finding.status == "ok"


def test_same_models_need_no_order_and_bad_order_value_fails(use_spec, make_ctx):
    use_spec("shared-4gpu")
    assert check_device_order(make_ctx({}))[0].status == "ok"
    [finding] = check_device_order(make_ctx({"CUDA_DEVICE_ORDER": "PCI"}))
    assert finding.status == "fail" and "PCI_BUS_ID, FASTEST_FIRST" in finding.message


def test_cuda_initialised_with_other_devices_than_the_environment_names_fails(use_spec, make_ctx):
    use_spec("shared-4gpu")
    # torch saw every GPU when it initialised CUDA; CUDA_VISIBLE_DEVICES=2,3 was set afterwards
    ctx = make_ctx({"CUDA_VISIBLE_DEVICES": "2,3"}, cuda_uuids=[u[4:] for u in SHARED])
    [finding] = check_cuda_initialized(ctx)
    assert finding.status == "fail"
    assert "silently ignored" in finding.message and "before the first CUDA call" in finding.fix


def test_cuda_initialised_with_the_named_devices_is_ok(use_spec, make_ctx):
    use_spec("shared-4gpu")
    ctx = make_ctx({"CUDA_VISIBLE_DEVICES": "2,3"}, cuda_uuids=[SHARED[2], SHARED[3]])
    assert check_cuda_initialized(ctx)[0].status == "ok"


def test_cuda_not_initialised_and_fresh_cli_process(use_spec, make_ctx):
    use_spec("shared-4gpu")
    assert check_cuda_initialized(make_ctx({"CUDA_VISIBLE_DEVICES": "2"}, cuda_uuids=None))[0].status == "ok"
    [finding] = check_cuda_initialized(make_ctx({}, from_cli=True))
    assert finding.status == "info" and "fresh process" in finding.message


def test_real_predicate_never_imports_torch_and_says_not_initialised():
    code = ("import sys; from gpukit.doctor._context import cuda_device_uuids; "
            "print(cuda_device_uuids(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "False"]


@pytest.mark.requires_gpu
def test_real_cuda_initialised_then_environment_changed_fails():
    script = textwrap.dedent("""
        import json, os, torch
        torch.cuda.init()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # too late: CUDA already sees its devices
        from gpukit.doctor import run_checks
        [f] = [f for f in run_checks().findings if f.name == "cuda.initialized"]
        # the runtime's own count: torch.cuda.device_count() of torch <= 2.11 re-reads the changed variable
        print(json.dumps([f.status, torch._C._cuda_getDeviceCount()]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    status, count = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert count >= 1 and status == "fail"


def test_fastest_first_order_over_mixed_models_is_not_mistaken_for_late_initialisation(use_spec, make_ctx):
    use_spec("old-driver")  # GTX 1080 Ti at PCI 02, RTX 3090 at 65: CUDA's fastest-first puts the 3090 first
    gtx, rtx = "GPU-0b1c2d3e-4f5a-4b6c-8d7e-9f0a1b2c3d4e", "GPU-1c2d3e4f-5a6b-4c7d-9e8f-0a1b2c3d4e5f"
    assert check_cuda_initialized(make_ctx({}, cuda_uuids=[rtx, gtx]))[0].status == "ok"
    ordered = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert check_cuda_initialized(make_ctx(ordered, cuda_uuids=[rtx, gtx]))[0].status == "fail"
    assert check_cuda_initialized(make_ctx(dict(ordered, CUDA_VISIBLE_DEVICES="1"), cuda_uuids=[rtx]))[0].status == "ok"
