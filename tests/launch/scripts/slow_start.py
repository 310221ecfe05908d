"""A gpukit script still starting when the stop comes: writes OUT/starting-RANK, then (before any
Session exists, as a worker importing torch for 20 s would be) waits until it is stopped.

    slow_start.py OUT
"""

import os
import pathlib
import sys
import time

import gpukit  # noqa: F401 - a Session script (its Session would come after the slow start)

out = pathlib.Path(sys.argv[1])
rank = os.environ["RANK"]
(out / f".starting-{rank}").write_text(str(os.getpid()))
os.replace(out / f".starting-{rank}", out / f"starting-{rank}")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # the stop ends this process; nothing here could save
    time.sleep(0.05)
sys.exit("slow_start.py: never stopped")
