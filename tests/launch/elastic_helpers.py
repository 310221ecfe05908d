"""What the lost-node tests share (tests/launch/test_launch_elastic.py, tests/cluster/test_slurm_node_lost.py):
the training script they run under `gpukit run --nnodes 1:2`, its settings, and readers of the events its
ranks write (see scripts/elastic_train.py).

Named elastic_helpers (not _helpers) so it cannot clash with another test folder's module.
"""

from __future__ import annotations

import json
from pathlib import Path

from launch_helpers import SCRIPTS

SCRIPT = SCRIPTS / "elastic_train.py"
STEPS, SAVE_EVERY, STEP_S = 120, 5, 0.04
SAMPLES, GLOBAL_BATCH = 240, 8  # the script's


def script_args(out: Path) -> list[str]:
    """The script and its arguments: events into ``out``, checkpoints into ``out/ckpt``."""
    return [str(SCRIPT), str(out), str(out / "ckpt"), str(STEPS), str(SAVE_EVERY), str(STEP_S)]


def events(out: Path) -> list[dict]:
    """Every rank's events in ``out``, by time; each names its file (one per worker process)."""
    found = []
    for path in sorted(out.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                event["file"] = path.name
                found.append(event)
    return sorted(found, key=lambda e: e["t"])


def steps_of(events: list[dict], world: int, after: float = 0.0) -> list[dict]:
    """The steps trained at ``world`` ranks after time ``after``."""
    return [e for e in events if e["event"] == "step" and e["world"] == world and e["t"] > after]


def assert_each_sample_once_per_epoch(events: list[dict]) -> None:
    """The steps that count: each attempt's (one group start: its ranks' files) up to the step the
    next attempt resumed from -- what the uninterrupted run would have trained."""
    attempt_of: dict[str, tuple[int, int]] = {}  # events file -> (resumed step, world size) of its start
    first_t: dict[tuple[int, int], float] = {}
    for e in events:
        if e["event"] == "start":
            key = (e["resumed"], e["world"])
            attempt_of[e["file"]] = key
            first_t[key] = min(first_t.get(key, e["t"]), e["t"])
    attempts = sorted(first_t, key=first_t.__getitem__)
    until = {key: nxt[0] for key, nxt in zip(attempts, attempts[1:])}
    counted: dict[int, list[int]] = {}
    for e in events:
        if e["event"] == "step":
            key = attempt_of[e["file"]]
            if e["step"] <= until.get(key, STEPS):
                counted.setdefault(e["step"], []).extend(e["ids"])
    assert sorted(counted) == list(range(1, STEPS + 1))
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch_start in range(0, STEPS - per_epoch + 1, per_epoch):
        ids = sum((counted[s] for s in range(epoch_start + 1, epoch_start + per_epoch + 1)), [])
        assert sorted(ids) == list(range(SAMPLES)), epoch_start  # none lost, none twice
