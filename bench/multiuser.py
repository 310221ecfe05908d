"""The multi-user battery: a second, unfriendly user against gpukit's claims and queue (issue 26).

    sudo python bench/multiuser.py      # needs root: creates two unprivileged users with useradd

Runs every probe of tests/hostile/claims_attacks.py (each one attack, seen by one or more of the
victim's commands) and prints, per attack, how many of those commands ended in each outcome; the
goal is 0 in the "wrong", "hang", "traceback", "file changed" and "claim stolen" columns. Paste
the table into bench/RESULTS.md with the machine and load it ran on.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS / "hostile"))
sys.path.insert(0, str(TESTS / "devices"))

from claims_attacks import OUTCOMES, PROBES, SAFE, run_probe  # noqa: E402
from other_users import unprivileged_users  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile import print_outcomes  # noqa: E402


def main(argv: list[str]) -> int:
    users = unprivileged_users()
    if isinstance(users, str):
        print(f"cannot run: {users}", file=sys.stderr)
        return 2
    alice, bob = users
    names = argv or sorted(PROBES)
    table: dict[str, Counter[str]] = {}
    bad: list[str] = []
    started = time.monotonic()
    for name in names:
        results = run_probe(name, alice, bob)
        table[name.replace("_", " ")] = Counter(outcome for _, outcome in results)
        bad += [f"{name} / {reader}: {outcome}" for reader, outcome in results if outcome not in SAFE]
    return print_outcomes("attack", table, OUTCOMES, started, bad)

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
