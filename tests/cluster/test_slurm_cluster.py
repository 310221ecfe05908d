"""gpukit on a real SLURM cluster (2 nodes in one machine, see conftest.py): no gpukit flags,
DDP across nodes equal to one process, preemption with requeue, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from launch_helpers import assert_none_survive, catches, poll, processes_with_marker
from slurm_helpers import SRC, TRAIN, SlurmCluster, job_script, steps_gone

# The first test's set-up may install the slurm packages (apt-get) before the cluster starts.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PYTHON = sys.executable


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same training in one plain process: what every cluster run must end with."""
    out = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    subprocess.run([PYTHON, str(TRAIN), str(out)], env={**env, "PYTHONPATH": str(SRC)}, check=True,
                   capture_output=True, timeout=120)
    return json.loads((out / "result.json").read_text())


def _same_weights(got: dict, want: dict) -> None:
    assert got["steps"] == want["steps"]
    for mine, theirs in zip(got["params"], want["params"]):
        assert mine == pytest.approx(theirs, abs=1e-5)


@dataclass
class Job:
    cluster: SlurmCluster  # with the job's environment
    marker: str  # in every process of the job
    out: Path  # train.py's output directory
    job_id: str
    log: Path

    def wait_held(self) -> None:
        """Until train.py --hold-at waits for its stop request."""
        held = self.out / "held"
        poll(lambda: held.exists() or self.cluster.state(self.job_id) == "", 240, "the job to reach its hold step")
        assert held.exists(), self.log.read_text()


def _sbatch_gpukit_run(slurm_cluster: SlurmCluster, tmp_path: Path, nproc: int, *train_args: str,
                       options: tuple[str, ...] = ()) -> Job:
    """sbatch -N2 of the documented job script running `gpukit run --cpu --nproc N train.py OUT ...`
    (no node flags)."""
    marker = uuid.uuid4().hex
    cluster = slurm_cluster.for_job(marker)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sbatch"
    # the batch shell holds --signal=B:USR2 and passes it to srun, which forwards it to every gpukit run
    script.write_text(job_script(f"srun {PYTHON} -m gpukit run --cpu --nproc {nproc} {TRAIN} {out} {' '.join(train_args)}"))
    log = tmp_path / "job.out"
    result = cluster.run("sbatch", "--parsable", "--export=ALL", "--open-mode=append", "-o", str(log), "-N2",
                         *options, str(script), check=False)
    assert result.returncode == 0, result.stderr
    return Job(cluster, marker, out, result.stdout.strip().split(";")[0], log)


def test_sbatch_srun_gpukit_run_needs_no_flags(slurm_cluster: SlurmCluster, reference: dict, tmp_path: Path) -> None:
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 2)
    job.cluster.wait_gone(job.job_id, 240)
    output = job.log.read_text()
    assert (job.out / "result.json").exists(), output
    result = json.loads((job.out / "result.json").read_text())
    assert result["world"] == 4
    _same_weights(result, reference)
    assert f"SLURM job {job.job_id}" in output and "master node1:" in output
    assert "node 0 of 2" in output and "node 1 of 2" in output
    assert sorted(p.name for p in job.out.glob("rank-*")) == [f"rank-{r}-attempt-0" for r in range(4)]
    assert_none_survive(job.marker)


def test_srun_python_with_a_session_needs_no_launcher(slurm_cluster: SlurmCluster, reference: dict,
                                                      tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    cluster = slurm_cluster.for_job(marker)
    result = cluster.run("srun", "-N2", "--ntasks-per-node=2", PYTHON, str(TRAIN), str(tmp_path),
                         timeout_s=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    trained = json.loads((tmp_path / "result.json").read_text())
    assert trained["world"] == 4
    _same_weights(trained, reference)
    starts = [json.loads((tmp_path / f"rank-{r}-attempt-0").read_text()) for r in range(4)]
    assert {s["kind"] for s in starts} == {"slurm"}
    assert result.stderr.count("gpukit: SLURM job") == 1  # detected, said once, by rank 0
    assert_none_survive(marker)


def test_scancel_leaves_no_process_on_either_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 1, "--ckpt", str(tmp_path / "ckpt"), "--hold-at", "2")
    job.wait_held()
    job.cluster.run("scancel", job.job_id)
    job.cluster.wait_gone(job.job_id, 60)
    assert_none_survive(job.marker, timeout_s=30)
    # issue 41.11: a plain scancel is one clear line per node, no tracebacks, no signal nobody sent
    # (a collective the others' stop broke is that rank's one line; torch elastic's "Received 15 death
    # signal" was a log line of the agent's, at WARNING)
    output = job.log.read_text()
    assert "Traceback" not in output and "death signal" not in output, output
    assert all("stopped by SIGTERM; a collective ended" in line
               for line in output.splitlines() if "Connection reset by peer" in line), output


def _restarts(cluster: SlurmCluster, job_id: str) -> int:
    shown = cluster.run("scontrol", "show", "job", job_id, check=False).stdout
    return int(shown.split("Restarts=")[1].split()[0]) if "Restarts=" in shown else -1


def _requeued_then_finished(job: Job) -> str:
    """Wait for the job's requeue (Restarts=1, PENDING), start it at once, wait for it to end;
    returns the job's output."""
    cluster, job_id = job.cluster, job.job_id
    poll(lambda: _restarts(cluster, job_id) == 1 and cluster.state(job_id) == "PENDING"
         or (cluster.state(job_id) in ("", "FAILED", "COMPLETED") and _restarts(cluster, job_id) == 0), 180,
         "the job to be requeued")
    assert _restarts(cluster, job_id) == 1, f"not requeued ({cluster.state(job_id)}):\n{job.log.read_text()}"
    # SLURM keeps a requeued job from starting for ~2 minutes; the test need not wait for that,
    # only for the first run's step daemons to be gone on both nodes
    poll(lambda: steps_gone(job_id), 60, "the first run's slurmstepd to exit")
    # slurmd refuses a credential created in the same second as the job's revocation (its times
    # are whole seconds): a release within that second kills the second run as "non-startable"
    revoked_by = time.time()
    poll(lambda: time.time() >= revoked_by + 2, 10, "a credential second after the revocation")
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    cluster.wait_gone(job_id, 240)
    output = job.log.read_text()
    assert f"SLURM job {job_id} requeued (requeue 1 of at most 10)" in output, output
    assert "requeued 1x" in output  # the second attempt saw SLURM_RESTART_COUNT
    return output


def test_preempted_job_saves_requeues_and_resumes_to_the_same_weights(
    slurm_cluster: SlurmCluster, reference: dict, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 1, "--ckpt", str(ckpt), "--hold-at", "2",
                             options=("--requeue",))
    out = job.out
    job.wait_held()
    job.cluster.run("scancel", "--signal=USR2", "--batch", job.job_id)  # what --signal=B:USR2@90 sends
    output = _requeued_then_finished(job)
    # srun's forward reaches each node's step separately: a rank may stop with the others (the Session's
    # agreement) before its own SIGUSR2 comes, and then see it, its launcher's SIGTERM, or neither (under load
    # one node's came 0.4 s late: "rank 0: SIGTERM received" -- the flake of issue 41). What is certain: the
    # warning, both ranks saved at the same next step, and node 0 requeued once both nodes had reported.
    assert "SIGUSR2 received, stopping at the next step boundary" in output, output
    assert "did not report their stop" not in output, output
    assert "waiting for the other 1 node(s) to report their stop" in output
    assert [int((out / f"stopped-rank-{r}").read_text()) for r in (0, 1)] == [2, 2]  # saved at the next step
    assert (ckpt / "step_00000002").is_dir()
    resumed = [json.loads((out / f"rank-{r}-attempt-1").read_text()) for r in (0, 1)]
    assert [r["start_step"] for r in resumed] == [2, 2]
    result = json.loads((out / "result.json").read_text())
    assert result["world"] == 2
    _same_weights(result, reference)
    assert_none_survive(job.marker)


def test_a_job_that_starts_within_its_warning_is_requeued_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Issue 41.8: SLURM sends --signal's warning once, at its first check (every 30 s) that finds the time left
    within the lead + 30 s; one sent as the job starts, before the batch shell exists, is lost, and the job ran into
    its time limit. The job script reads its time left: a job that starts within its `--signal=B:USR2@90` (here
    --time=1) is requeued at once, exactly once, without starting its step (and SLURM's own warning, should it
    still come, finds the job gone)."""
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 1, "--ckpt", str(tmp_path / "ckpt"),
                             options=("--requeue", "--time=1"))
    poll(lambda: _restarts(job.cluster, job.job_id) != 0 or job.cluster.state(job.job_id) == "", 120,
         "the job to be requeued")
    restarts = _restarts(job.cluster, job.job_id)
    job.cluster.run("scancel", job.job_id)  # its next start (after SLURM's ~2 min BeginTime) would be requeued too
    job.cluster.wait_gone(job.job_id, 60)
    output = job.log.read_text()
    assert restarts == 1, output
    assert output.count("job script: the job starts with") == 1 and "(--signal ...@90" in output, output
    assert "; requeuing" in output and "gpukit:" not in output, output  # the step never started
    assert not list(job.out.iterdir()), output  # nothing trained
    assert_none_survive(job.marker)


def _launchers(marker: str) -> list[int]:
    found = []
    for proc in processes_with_marker(marker):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if cmdline[1:4] == ["-m", "gpukit", "run"]:  # python -m gpukit run (not srun, not workers)
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("moment", ["launcher-starting", "workers-starting"])
def test_preempted_while_starting_requeues_and_trains_from_scratch(
    slurm_cluster: SlurmCluster, reference: dict, tmp_path: Path, moment: str
) -> None:
    """The signal before anything could be saved: still requeued (the job restarts from scratch)."""
    ckpt = tmp_path / "ckpt"
    hold = ("--hold-start",) if moment == "workers-starting" else ()
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 1, "--ckpt", str(ckpt), *hold, options=("--requeue",))
    if moment == "launcher-starting":  # both nodes' gpukit run hold the signal, still importing
        poll(lambda: len(pids := _launchers(job.marker)) == 2 and all(catches(p, signal.SIGUSR2) for p in pids),
             120, "both launchers to start")
    else:  # both workers wait before their Session exists
        poll(lambda: all((job.out / f"starting-{r}").exists() for r in (0, 1)), 240, "the workers to start")
    job.cluster.run("scancel", "--signal=USR2", "--batch", job.job_id)
    output = _requeued_then_finished(job)
    if moment == "workers-starting":
        assert output.count("Session started: nothing to save") == 2, output
    resumed = [json.loads((job.out / f"rank-{r}-attempt-1").read_text()) for r in (0, 1)]
    assert [r["start_step"] for r in resumed] == [0, 0]
    _same_weights(json.loads((job.out / "result.json").read_text()), reference)
    assert_none_survive(job.marker)


def _node_processes(marker: str, node: str) -> list[psutil.Process]:
    """The job's task on ``node`` (its gpukit run), the step daemon above it and its workers."""
    found = []
    for proc in processes_with_marker(marker):
        try:
            if proc.environ().get("SLURMD_NODENAME") == node and proc.cmdline()[1:4] == ["-m", "gpukit", "run"]:
                found += [proc, proc.parent(), *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return [p for p in found if p is not None]


def test_a_dead_node_ends_the_job_within_a_bound(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # node2's slurmd, step daemon, launcher and worker die at once (a machine gone): node2 never
    # reports its task's end, and srun -- with --kill-on-bad-exit=1 too -- waited for it until
    # SLURM gave node2 up (SlurmdTimeout=300 s here): the job stayed RUNNING for minutes.
    job = _sbatch_gpukit_run(slurm_cluster, tmp_path, 1, "--ckpt", str(tmp_path / "ckpt"), "--hold-at", "2")
    job.wait_held()
    doomed = _node_processes(job.marker, "node2")
    assert len(doomed) >= 3, doomed  # launcher, its slurmstepd, its worker
    slurmd = int((slurm_cluster.directory / "slurmd-node2.pid").read_text())
    try:
        for pid in [slurmd, *(p.pid for p in doomed)]:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        poll(lambda: job.cluster.state(job.job_id) not in ("RUNNING", "UNKNOWN"), 150, "the job to leave RUNNING")
        took_s = time.monotonic() - killed
    finally:
        slurm_cluster.run("slurmd", "-N", "node2")  # node2 comes back; the job's cleanup completes
    output = job.log.read_text()
    print(f"the job left RUNNING {took_s:.0f} s after node2 died")
    assert took_s < 150, output
    assert "gpukit: rank 1" in output or "no task of the step left on this node" in output, output
    job.cluster.wait_gone(job.job_id, 240)
    poll(lambda: "idle" in slurm_cluster.run("sinfo", "-h", "-n", "node2", "-o", "%T").stdout, 120, "node2 idle again")
    assert_none_survive(job.marker, timeout_s=30)
