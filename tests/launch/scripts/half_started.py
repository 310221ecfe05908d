"""The stop finds the ranks at different points of their start (1 trial in 5 under load): rank 0's
Session handler is in place -- its gloo set-up returned first -- while rank 1 is still inside its
set-up, so rank 1 leaves at once and rank 0's next collective fails for want of its peer.

    half_started.py OUT
"""

import os
import pathlib
import sys
import time

from gpukit.launch import install_preemption_handler, stop_requested

out = pathlib.Path(sys.argv[1])
rank = os.environ["RANK"]
if rank == "0":
    install_preemption_handler()  # what its Session installs, first of the two
(out / f".starting-{rank}").write_text(str(os.getpid()))
os.replace(out / f".starting-{rank}", out / f"starting-{rank}")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if rank == "0" and stop_requested():
        # the all-reduce of should_stop, with rank 1 gone
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    time.sleep(0.05)
sys.exit("half_started.py: never stopped")
