"""The multi-user battery: a second, unfriendly user against gpukit's claims and queue (issue 26).

    sudo python bench/multiuser.py      # needs root: creates two unprivileged users with useradd

Runs every probe of tests/hostile/claims_attacks.py (each one attack, seen by one or more of the
victim's commands) and prints, per attack, how many of those commands ended in each outcome; the
goal is 0 in the "wrong", "hang", "traceback", "file changed" and "claim stolen" columns. Paste
the table into bench/RESULTS.md with the machine and load it ran on.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS / "hostile"))
sys.path.insert(0, str(TESTS / "devices"))

from claims_attacks import OUTCOMES, PROBES, SAFE, run_probe  # noqa: E402
from other_users import unprivileged_users  # noqa: E402


def main(argv: list[str]) -> int:
    users = unprivileged_users()
    if isinstance(users, str):
        print(f"cannot run: {users}", file=sys.stderr)
        return 2
    alice, bob = users
    names = argv or sorted(PROBES)
    total: Counter[str] = Counter()
    bad: list[str] = []
    started = time.monotonic()
    print("| attack | probes | " + " | ".join(OUTCOMES) + " |")
    print("|---|---:|" + "---:|" * len(OUTCOMES))
    for name in names:
        results = run_probe(name, alice, bob)
        counts = Counter(outcome for _, outcome in results)
        total.update(counts)
        bad += [f"{name} / {reader}: {outcome}" for reader, outcome in results if outcome not in SAFE]
        print(f"| {name.replace('_', ' ')} | {len(results)} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    print(f"| **all** | {sum(total.values())} | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    print(f"\n{time.monotonic() - started:.1f} s, load average {os.getloadavg()[0]:.1f}")
    for line in bad:
        print("NOT SAFE:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
