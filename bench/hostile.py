"""The hostile-input battery: every probe of tests/hostile/corpus_*.py, one table of outcomes.

    python bench/hostile.py            # all corpora
    python bench/hostile.py records    # only corpus_records.py

Prints, per reader, how many probes ended in each outcome (see tests/hostile/_probe.py); the
goal is 0 in the "wrong", "traceback", "hang" and "code executed" columns. Paste the table
into bench/RESULTS.md with the machine it ran on.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HOSTILE = Path(__file__).resolve().parents[1] / "tests" / "hostile"
sys.path.insert(0, str(HOSTILE))

from _probe import OUTCOMES, execute  # noqa: E402


def main(argv: list[str]) -> int:
    areas = argv or sorted(p.stem.removeprefix("corpus_") for p in HOSTILE.glob("corpus_*.py"))
    table: dict[str, Counter[str]] = defaultdict(Counter)
    bad: list[str] = []
    started = time.monotonic()
    for area in areas:
        probes = importlib.import_module(f"corpus_{area}").PROBES
        for name in sorted(probes):
            with tempfile.TemporaryDirectory() as tmp:
                run = probes[name](Path(tmp))
                result = execute(run)
            table[run.reader][result.outcome] += 1
            if result.outcome not in ("clean error", "correct"):
                bad.append(f"{area}/{name}: {result.outcome}")
    return print_outcomes("reader", {reader: table[reader] for reader in sorted(table)}, OUTCOMES, started, bad)


def print_outcomes(row: str, table: dict[str, Counter[str]], outcomes: tuple[str, ...], started: float,
                   bad: list[str]) -> int:
    """The markdown table of outcome counts per row (and all rows), the time taken, what was not safe;
    returns the exit status (1 when something was not safe)."""
    print(f"| {row} | probes | " + " | ".join(outcomes) + " |")
    print("|---|---:|" + "---:|" * len(outcomes))
    total: Counter[str] = Counter()
    for name, counts in table.items():
        total.update(counts)
        print(f"| {name} | {sum(counts.values())} | " + " | ".join(str(counts[o]) for o in outcomes) + " |")
    print(f"| **all** | {sum(total.values())} | " + " | ".join(str(total[o]) for o in outcomes) + " |")
    print(f"\n{time.monotonic() - started:.1f} s, load average {os.getloadavg()[0]:.1f}")
    for line in bad:
        print("NOT SAFE:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
