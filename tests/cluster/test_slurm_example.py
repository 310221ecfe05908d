"""examples/slurm/train.sbatch: valid bash, and the two lines preemption depends on."""

from __future__ import annotations

import subprocess
from pathlib import Path

SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"


def test_example_job_script_parses_and_passes_the_signal_on() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    lines = [line.split("#", 1)[0].strip() if not line.startswith("#SBATCH") else line.split(" #")[0].strip()
             for line in SBATCH.read_text().splitlines()]
    assert "#SBATCH --signal=B:USR2@90" in lines and "#SBATCH --requeue" in lines
    # --signal=B: reaches only the batch shell: exec makes srun that shell, and srun forwards it
    assert "exec srun gpukit run train.py" in lines
