"""The warning at a random moment, in both documented ways, on the real 2-node cluster: a few of
the trials bench/preemption.py runs 20+ of per way (tests/cluster/slurm_trials.py).

Each draws a moment (start-up, worker start, training, save, teardown) and a time within it;
``GPUKIT_TRIAL_SEED`` repeats a draw (the seed is printed). Whatever the moment, the job ends
COMPLETED with weights bit-identical to the same job never signalled (both ways give the same
weights: 4 ranks, the same reductions), requeued once if the warning came before the training
ended and never after, and leaves no process behind.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from slurm_helpers import SlurmCluster
from slurm_trials import MOMENTS, SPREAD_S, WAYS, Cluster, as_expected, reference, trial

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def unsignalled(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return reference(Cluster(slurm_cluster.env), "gpukit run", tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("way", WAYS)
def test_a_warning_at_a_random_moment_loses_nothing(slurm_cluster: SlurmCluster, unsignalled: dict,
                                                    tmp_path: Path, way: str) -> None:
    seed = int(os.environ.get("GPUKIT_TRIAL_SEED") or random.SystemRandom().randrange(1_000_000))
    rng = random.Random(f"{seed} {way}")
    moment = rng.choice(MOMENTS)
    delay_s = round(rng.uniform(0, SPREAD_S[moment]), 2)
    result = trial(Cluster(slurm_cluster.env), way, moment, delay_s, unsignalled, tmp_path)
    print(f"GPUKIT_TRIAL_SEED={seed}: {way}, {moment} +{delay_s} s, landed: {result['landed']}, "
          f"requeues {result['requeues']}, {result['state']}, bit-exact {result['exact']}, left {result['left']}")
    assert as_expected(result), f"GPUKIT_TRIAL_SEED={seed}: {result}"


def test_srun_python_with_its_requeues_used_up_ends_75(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Issue 41.9: the bound used up, rank 0 exits 75 and --kill-on-bad-exit SIGTERMs the other tasks in
    their finalization; the job ended FAILED 143 and the job script said the warning was lost."""
    env = {**slurm_cluster.env, "GPUKIT_MAX_REQUEUES": "0"}
    result = trial(Cluster(env), "srun python", "training", 0.5, {"params": None}, tmp_path)
    assert result["requeues"] == 0 and result["state"] == "FAILED 75:0", result
    assert "not requeuing. The checkpoint is saved" in result["tail"], result
    assert "could not take it" not in result["tail"], result
