"""Helpers for the SLURM tests: the running cluster and the paths its jobs use.

Named slurm_helpers (not conftest/_helpers) so it cannot clash with another test folder's module.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "launch"))
from launch_helpers import MARKER_ENV, poll  # noqa: E402

SCRIPT = HERE / "slurm_cluster.sh"
TRAIN = HERE / "scripts" / "train.py"
SRC = HERE.parent.parent / "src"
EXAMPLE_JOB = HERE.parent.parent / "examples" / "slurm" / "train.sbatch"
EXAMPLE_STEP = "srun gpukit run train.py"


def job_script(step: str) -> str:
    """The documented job script (examples/slurm/train.sbatch) with ``step`` for its srun line
    (``srun gpukit run train.py``; the other documented way is ``srun --kill-on-bad-exit=1 python
    train.py``); its ``#SBATCH`` lines go (callers give sbatch their own options) but ``--signal``,
    which the script reads (the warning's lead), and everything that handles the warning stays as
    users have it."""
    text = EXAMPLE_JOB.read_text()
    assert text.count(EXAMPLE_STEP) == 1, f"{EXAMPLE_JOB} no longer runs `{EXAMPLE_STEP}` once"
    lines = [line for line in text.replace(EXAMPLE_STEP, step).splitlines()
             if not line.startswith("#SBATCH") or line.startswith("#SBATCH --signal=")]
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` points sinfo/srun/sbatch at it."""

    directory: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout_s: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s,
                              check=check)

    def for_job(self, marker: str) -> SlurmCluster:
        """This cluster with a job's environment: gpukit's source on the path, and a marker to
        find the job's processes by (jobs inherit it: sbatch/srun --export=ALL)."""
        return SlurmCluster(self.directory, {**self.env, "PYTHONPATH": str(SRC), MARKER_ENV: marker})

    def state(self, job_id: str) -> str:
        """The job's state (``""`` once it has left the queue; ``"UNKNOWN"`` while squeue fails,
        e.g. slurmctld too busy to answer in time on a loaded machine)."""
        result = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False)
        return result.stdout.strip() if result.returncode == 0 else "UNKNOWN"

    def wait_gone(self, job_id: str, timeout_s: float) -> None:
        poll(lambda: self.state(job_id) == "", timeout_s, f"SLURM job {job_id} to finish")


def steps_gone(job_id: str) -> bool:
    """No ``slurmstepd: [JOB.*]`` left on this machine (both nodes run here): every node's slurmd
    has processed the job's end. Releasing a requeued job before that (``StartTime=now``) races
    the credential revocation: "Killing non-startable batch JobId=6: Job credential revoked"."""
    prefix = f"slurmstepd: [{job_id}."
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and cmdline[0].startswith(prefix):
            return False
    return True
