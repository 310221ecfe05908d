"""A node of a SLURM job dies, the job goes on with the other (issue 39, item 4): the real 2-node cluster.

The job (``sbatch -N2 --no-kill``, docs/clusters.md's script) runs one ``gpukit run --nnodes 1:2`` per node,
each in its own one-node step (``srun -N1 -w nodeX``): a step that loses its node ends alone, where one ``srun`` over both nodes
would wait for the dead node's slurmd until ``SlurmdTimeout`` (docs/clusters.md). Mid-epoch, node2's
slurmd, its step's slurmstepd and everything that step runs are SIGKILLed -- the node is gone as a
crashed machine is. Node1's workers lose their peer, its agent re-forms the group alone, they resume the
last complete checkpoint at one rank and finish; the batch script's first step ends 0. Every sample is
trained once per epoch across the switch. node2's slurmd is started again afterwards (the cluster is the
session's).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from elastic_helpers import SAVE_EVERY, assert_each_sample_once_per_epoch, events, script_args, steps_of
from launch_helpers import poll
from slurm_helpers import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job_script(out: Path, port: int) -> str:
    """docs/clusters.md's job script ("Going on without a dead node"), with this test's script and logs."""
    run = (f"{sys.executable} -m gpukit run --cpu --nproc 1 --nnodes 1:2 --node-rank $rank --master-addr \"$master\" "
           f"--master-port {port} --rdzv-timeout 60 --grace 2 {' '.join(script_args(out))}")
    return f"""#!/bin/bash
master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
rank=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun -N1 -n1 -w "$node" --export=ALL,GLOO_SOCKET_IFNAME=lo {run} > {out}/node$rank.log 2>&1 &
  pids[$rank]=$!; rank=$((rank + 1))
done
wait ${{pids[0]}}; rc=$?
kill -9 "${{pids[@]:1}}" 2>/dev/null   # a lost node's srun would wait for SlurmdTimeout
echo "first step: $rc"
exit $rc
"""


def _node2(marker: str) -> list[psutil.Process]:
    """What the job runs on node2, and the slurmstepd that runs it."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("GPUKIT_TEST_MARKER") == marker and env.get("SLURMD_NODENAME") == "node2":
            found.append(proc)
            parent = proc.parent()
            if parent is not None and parent.name().startswith("slurmstepd"):
                found.append(parent)
    return found


def _restart_slurmd(cluster: SlurmCluster, node: str) -> None:
    env = {**cluster.env, "PATH": cluster.env.get("PATH", "") + ":/usr/sbin:/sbin"}
    subprocess.run(["slurmd", "-N", node], env=env, capture_output=True, timeout=60, check=True)
    poll(lambda: "idle" in cluster.run("sinfo", "-h", "-n", node, "-o", "%t", check=False).stdout, 120,
         f"{node} idle again")


def test_a_job_goes_on_with_one_node_when_the_other_dies(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    cluster = slurm_cluster.for_job(marker)
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.sh"
    script.write_text(_job_script(out, port))
    log = tmp_path / "job.out"
    job = cluster.run("sbatch", "--parsable", "-N2", "--no-kill", "--export=ALL", "-o", str(log),
                      str(script)).stdout.strip().split(";")[0]
    slurmd2 = int((slurm_cluster.directory / "slurmd-node2.pid").read_text())
    node2_killed = False
    try:
        node_logs = lambda: "".join((out / f"node{r}.log").read_text()[-2000:]  # noqa: E731
                                    for r in (0, 1) if (out / f"node{r}.log").exists())
        poll(lambda: any(e["step"] >= SAVE_EVERY + 2 for e in steps_of(events(out), 2)), 300,
             "both nodes training past a checkpoint")
        before = {e["step"] for e in steps_of(events(out), 2)}
        victims = [psutil.Process(slurmd2), *_node2(marker)]
        assert len(victims) >= 4, victims  # slurmd, slurmstepd, gpukit run, its worker
        killed_at = time.time()
        for proc in victims:
            proc.kill()
        node2_killed = True
        alone = poll(lambda: [e for e in events(out) if e["event"] == "start" and e["world"] == 1], 120,
                     "node1 re-formed alone")[0]
        trained = poll(lambda: steps_of(events(out), 1), 60, "training again on node1")[0]
        redone = max(before) - alone["resumed"]
        print(f"\nSLURM node lost: re-formed {alone['process_start'] - killed_at:.1f} s, training again "
              f"{trained['t'] - killed_at:.1f} s after the kill; {redone} step(s) redone")
        assert alone["resumed"] > 0 and alone["resumed"] % SAVE_EVERY == 0 and 0 <= redone <= SAVE_EVERY
        assert trained["t"] - killed_at < 60  # the bound
        poll(lambda: "first step:" in (log.read_text() if log.exists() else ""), 300, "the job's first step to end")
        assert "first step: 0" in log.read_text(), log.read_text() + node_logs()
    finally:
        if not node2_killed:
            cluster.run("scancel", job, check=False)
        else:
            _restart_slurmd(slurm_cluster, "node2")
        slurm_cluster.wait_gone(job, 120)
    assert_each_sample_once_per_epoch(events(out))
