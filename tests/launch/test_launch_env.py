"""Workers get what torchrun gives them, and two runs side by side never collide on a port."""

from __future__ import annotations

import json

import pytest
from launch_helpers import BEHAVE, SCRIPTS, assert_none_survive

pytestmark = pytest.mark.slow


def test_two_runs_side_by_side_script_and_module(start_run):
    # Started together, both bind their rendezvous on port 0: no "address already in use".
    a = start_run("--cpu", "--nproc", "2", "--grace", "3", str(BEHAVE), "env", "{out}", "extra-arg")
    b = start_run("--cpu", "--nproc", "2", "-m", "behave", "env", "{out}", cwd=SCRIPTS)
    assert a.wait(timeout_s=120) == 0, a.output()
    assert b.wait(timeout_s=120) == 0, b.output()

    envs = {}
    for run in (a, b):
        for rank in (0, 1):
            data = json.loads((run.out / f"env-{rank}.json").read_text())
            env = data["env"]
            assert data["sum"] == 3.0  # gloo all_reduce of rank+1 over 2 ranks
            assert data["name"] == "__main__"
            assert data["cuda"] is False
            assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
                str(rank), str(rank), "2", "2")
            assert env["MASTER_ADDR"] == "127.0.0.1"
            assert env["GPUKIT_LAUNCHER_PID"] == str(run.proc.pid)
            assert env["GPUKIT_CPU"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
            assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
            assert env["OMP_NUM_THREADS"].isdigit()
            envs[(run.marker, rank)] = env
    assert envs[(a.marker, 0)]["GPUKIT_GRACE_S"] == "3"
    assert json.loads((a.out / "env-0.json").read_text())["argv"][1:] == ["env", str(a.out), "extra-arg"]
    assert envs[(a.marker, 0)]["GPUKIT_RUN_ID"] != envs[(b.marker, 0)]["GPUKIT_RUN_ID"]
    assert "2 worker processes" in a.output() and "CPU (gloo)" in a.output()
    for run in (a, b):
        assert_none_survive(run.marker)


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.requires_gpu),
                                  pytest.param(2, marks=pytest.mark.requires_gpus(2))])
def test_real_gpus_claimed_and_numbered_like_nvidia_smi(start_run, gpus: int):
    run = start_run("--gpus", str(gpus), str(BEHAVE), "env", "{out}")
    assert run.wait(timeout_s=180) == 0, run.output()
    data = json.loads((run.out / "env-0.json").read_text())
    env = data["env"]
    assert data["cuda"] is True and data["sum"] == {1: 1.0, 2: 3.0}[gpus]  # an all-reduce of rank + 1
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and len(env["CUDA_VISIBLE_DEVICES"].split(",")) == gpus
    physical = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert f"cuda:0 -> GPU {physical[0]}" in run.output()
    assert_none_survive(run.marker)
