"""A second, unfriendly user of the machine against the claim store and the queue (claims_attacks.py).

Runs as two real unprivileged users, created with useradd when the suite runs as root (as in CI);
skipped, with the reason, otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devices"))

from claims_attacks import PROBES, SAFE, run_probe  # noqa: E402
from other_users import unprivileged_users  # noqa: E402


@pytest.fixture(scope="module")
def users():
    found = unprivileged_users()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.mark.parametrize("name", sorted(PROBES))
def test_attack_on_claims(name: str, users) -> None:
    alice, bob = users
    results = run_probe(name, alice, bob)
    assert results, "the probe ran nothing"
    bad = [(reader, outcome) for reader, outcome in results if outcome not in SAFE]
    assert not bad, f"{name}: {bad} (all: {results})"
