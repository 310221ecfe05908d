"""Resume any checkpoint at any size, mid-epoch included (issue 39): real `gpukit run --cpu` jobs.

One chain of launches, each resuming the checkpoint the one before saved mid-epoch, at another world
size, with the same script (its ``accumulate_grad_batches`` is the one the first launch chose):

    full  2 ranks, uninterrupted, saves at step 2        (the reference; seed_per_rank: own streams)
    B     3 ranks: resumes full's step 2  (2 -> 3), saves at step 3   (seed_per_rank)
    C     2 ranks: resumes B's step 3     (3 -> 2), saves at step 5   (seed_per_rank)
    D     1 rank:  resumes C's step 5     (2 -> 1), saves at step 6
    E     4 ranks: resumes D's step 6     (1 -> 4), saves at step 7
    F     1 rank:  resumes E's step 7     (4 -> 1)

The global batch (24 samples, micro-batches of 2) is kept by the accumulation, and the rest of each epoch
is cut over the new ranks, so every step of every launch trains on the same samples as the uninterrupted
run's step of that number: each launch ends with its weights and Adam state (to float rounding: the
sums run in another order) and every sample is seen once per epoch across all the switches.
bench/elastic_resume_grid.py runs the full 1..4 grid with the same worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("elastic_resume_worker.py")
sys.path.insert(0, str(WORKER.parent))
import elastic_resume_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = worker.SAMPLES // worker.GLOBAL_BATCH
FIRST_ACCUMULATE = worker.GLOBAL_BATCH // (worker.MICRO_BATCH * 2)  # what the 2-rank launch chose
#: (tag, world size, resumes from, saves at, seed_per_rank)
#: 2 -> 3 (grow, streams of their own), 3 -> 1 (shrink, re-derived into one), 1 -> 4 (one stream continued).
#: bench/elastic_resume_grid.py runs every N -> M of the sizes it is given with the same worker.
CHAIN = [("full", 2, None, 2, True), ("B", 3, "full", 4, True), ("D", 1, "B", 6, False),
         ("E", 4, "D", None, False)]


def launch(out: Path, tag: str, world: int, source: str | None, save_at: int | None, per_rank: bool,
           strategy: str = "ddp") -> None:
    """One `gpukit run --cpu --nproc world` of the worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", str(world), str(WORKER), str(out), tag,
           strategy, str(FIRST_ACCUMULATE)]
    if source is not None:
        cmd += ["--resume", str(out / f"ckpt-{source}")]
    if save_at is not None:
        cmd += ["--save", f"{out / f'ckpt-{tag}'}:{save_at}"]
    if per_rank:
        cmd.append("--seed-per-rank")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def reports(out: Path, tag: str, world: int) -> list[dict]:
    return [json.loads((out / f"{tag}-{rank}.json").read_text()) for rank in range(world)]


def step_ids(ranks: list[dict]) -> dict[int, list[int]]:
    """Every optimizer step's sample ids over all ranks (sorted)."""
    steps: dict[int, list[int]] = {}
    for report in ranks:
        for step, ids in report["steps"].items():
            steps.setdefault(int(step), []).extend(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("elastic")
    for tag, world, source, save_at, per_rank in CHAIN:
        launch(out, tag, world, source, save_at, per_rank)
    return out


def test_every_launch_trains_on_the_uninterrupted_runs_global_batches_and_ends_with_its_weights(chain: Path) -> None:
    full = step_ids(reports(chain, "full", 2))
    total = worker.EPOCHS * STEPS_PER_EPOCH
    assert sorted(full) == list(range(1, total + 1))
    for epoch in range(worker.EPOCHS):  # the reference itself: each sample once per epoch
        seen = sum((full[s] for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)), [])
        assert sorted(seen) == list(range(worker.SAMPLES))
    reference = torch.load(chain / "full.pt")
    live: dict[int, str] = {}  # which launch ran each step in the chain of switches
    for index, (tag, world, source, _, _) in enumerate(CHAIN[1:], 1):
        ranks = reports(chain, tag, world)
        start = CHAIN[index - 1][3]
        assert all(r["resumed_at"] == start for r in ranks)
        mine = step_ids(ranks)
        assert sorted(mine) == list(range(start + 1, total + 1)), tag
        for step, ids in mine.items():  # the same samples in the same optimizer step: none lost, none twice
            assert ids == full[step], (tag, step)
        end = CHAIN[index][3] or total
        live.update({step: tag for step in range(start + 1, end + 1)})
        # the global batch kept by the accumulation; Adam's step count, moments and the LR schedule carried
        assert {r["accumulate"] for r in ranks} == {worker.GLOBAL_BATCH // (worker.MICRO_BATCH * world)}, tag
        assert {r["lr"] for r in ranks} == {reports(chain, "full", 2)[0]["lr"]}
        found = torch.load(chain / f"{tag}.pt")
        for key, value in reference["weights"].items():
            torch.testing.assert_close(found["weights"][key], value, rtol=1e-4, atol=1e-6, msg=f"{tag} {key}")
        for mine_t, ref_t in zip(found["moments"], reference["moments"]):
            torch.testing.assert_close(mine_t, ref_t, rtol=1e-4, atol=1e-6, msg=tag)
    assert sorted(live) == list(range(3, total + 1)) and set(live.values()) == {"B", "D", "E"}


def test_random_streams_continue_where_shared_and_are_rederived_per_rank_where_not(chain: Path) -> None:
    # streams of their own on each rank when saved (seed_per_rank): every new rank gets a new, distinct one
    for saver, world, resumer, new_world in (("full", 2, "B", 3),):
        saved = {r["save_probe"] for r in reports(chain, saver, world)}
        resumed = {r["resume_probe"] for r in reports(chain, resumer, new_world)}
        assert len(saved) == world and len(resumed) == new_world and not saved & resumed, (saver, resumer)
    # one stream on every rank when saved (here: one rank): every new rank continues it exactly
    assert {r["resume_probe"] for r in reports(chain, "E", 4)} == {reports(chain, "D", 1)[0]["save_probe"]}
