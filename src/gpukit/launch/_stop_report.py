"""How a stopped run ended (:func:`interrupted_outcome`), and node 0 of several requeuing only
after every node reported its stop (:func:`report_stop`).

``scontrol requeue`` ends every process of the job on every node. Node 0's ``gpukit run`` used
to requeue as soon as its own workers had exited, while node 1's could still be saving. Now
every node's launcher, once its workers have stopped, writes one key into the rendezvous
store -- the TCP store node 0's launcher hosts for the run, which every node already reaches
(no shared file system needed) -- and node 0 waits for all of them (at most ``--grace`` +
60 s: a node that never answers is gone, and a requeued job is better than a lost one) before
it requeues -- in an elastic run, for the nodes of its last rendezvous round only (a node lost
before it never answers: waiting for it was ``--grace`` + 60 s of a preempted job's warning).
Each report carries the signal that node's launcher received, so a preemption warning that
reached only another node still requeues.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gpukit.launch._signals import RunInterruptedError, _ignore, _stop_signals_handled_by
from gpukit.worker import BEFORE_START, COMPLETED, PREEMPTED_EXIT_CODE, read_markers

__all__ = ["NodeReports", "exchange_stop_reports", "interrupted_outcome", "report_stop", "training_completed",
           "REPORT_WAIT_EXTRA_S"]

#: Node 0 waits for the other nodes' reports at most ``grace_s`` + this.
REPORT_WAIT_EXTRA_S = 60.0
_PUBLISH_TIMEOUT_S = 10.0
_POLL_S = 0.1


@dataclass
class NodeReports:
    """What node 0 learnt: each node's launcher signal and whether its workers stopped cleanly."""

    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    waited_s: float = 0.0

    @property
    def signals(self) -> set[str]:
        """Signal names the nodes' launchers received (empty strings left out)."""
        return {str(r.get("signal")) for r in self.reports.values() if r.get("signal")}


def _key(run_id: str, node_rank: int) -> str:
    return f"gpukit/stop/{run_id}/{node_rank}"


def exchange_stop_reports(
    store: Any,
    *,
    run_id: str,
    node_rank: int,
    nnodes: int,
    signal_name: str | None,
    clean: bool,
    wait_s: float,
    echo: Callable[[str], None] | None = None,
    publish_timeout_s: float = _PUBLISH_TIMEOUT_S,
    round_size: int | None = None,
    in_a_round: bool = True,
    given_up: Callable[[], bool] | None = None,
) -> NodeReports | None:
    """Publish this node's report; on node 0, also wait for every other node's.

    Args:
        store: The rendezvous store (a ``torch.distributed.Store``); ``None``: no exchange.
        run_id, node_rank, nnodes: The run and this node's place in it.
        signal_name: The signal this node's launcher received (``None``: none, its workers
            were stopped by their Sessions' agreement).
        clean: Whether this node's workers stopped cleanly.
        wait_s: How long node 0 waits for the others.
        echo: Where node 0 says that it is waiting / that a node did not answer.
        publish_timeout_s: How long writing this node's report may take (node 0 gone: no one reads it).
        round_size: Nodes in node 0's last rendezvous round (an elastic run's may be fewer than
            ``nnodes``, its most): node 0 waits for no more reports from nodes that were in a round
            than this. ``None``: ``nnodes``.
        in_a_round: Whether this node's workers ever joined a round (``False``: a node still waiting to
            join; it has nothing to save, and its report does not count toward ``round_size``).
        given_up: Polled while node 0 waits: true ends the wait at once (a further stop signal).

    Returns:
        On node 0: the reports (its own included); elsewhere ``None``. Never raises: a store
        that cannot be reached means the other side is gone.
    """
    if store is None or nnodes <= 1:
        return None
    report = json.dumps({"signal": signal_name or "", "clean": bool(clean), "round": bool(in_a_round)})
    try:
        store.set_timeout(timedelta(seconds=publish_timeout_s))
        store.set(_key(run_id, node_rank), report)
    except Exception:  # noqa: BLE001 - node 0 (and its store) is gone: nobody is waiting
        return None
    if node_rank != 0:
        return None
    found = NodeReports()
    pending = set(range(nnodes))
    started = time.monotonic()
    expected = nnodes if round_size is None else max(1, min(round_size, nnodes))
    if echo is not None and expected > 1:
        # not "before requeuing": a stop without the preemption signal (scancel, a time limit) requeues nothing
        echo(f"gpukit: waiting for the other {expected - 1} node(s) to report their stop")

    def waiting() -> bool:  # a node lost from an elastic run's last round never reports: not waited for
        return bool(pending) and sum(1 for r in found.reports.values() if r.get("round", True)) < expected

    while waiting() and time.monotonic() - started < wait_s and not (given_up and given_up()):
        for node in sorted(pending):
            try:
                if store.check([_key(run_id, node)]):
                    found.reports[node] = json.loads(store.get(_key(run_id, node)))
                    pending.discard(node)
            except Exception:  # noqa: BLE001 - a malformed or unreadable report counts as missing
                pass
        if waiting():
            time.sleep(_POLL_S)
    found.missing = sorted(pending) if waiting() else []
    found.waited_s = time.monotonic() - started
    if found.missing and echo is not None:
        within = f"{found.waited_s:.1f}" if given_up and given_up() else f"{wait_s:g}"
        echo(f"gpukit: node(s) {', '.join(map(str, found.missing))} did not report their stop within "
             f"{within} s; going on without them")
    return found


def training_completed(agent: Any, run_dir: str, nproc: int) -> bool:
    """Every worker of this node had ended its script by itself, no stop asked for (``completed``
    markers), and exited 0: a stop signal that came then came after the training -- the run is
    finished, not preempted (a requeue would only start it again to find nothing to do)."""
    markers = read_markers(run_dir)
    return (len(markers) >= nproc and all(marker.state == COMPLETED for marker in markers.values())
            and bool(agent.exit_codes) and all(code == 0 for code in agent.exit_codes.values()))


def interrupted_outcome(signum: int, agent: Any, run_dir: str, nproc: int, grace_s: float) -> RunInterruptedError:
    """How the launcher's stop went: clean when no worker had started yet, when every worker
    exited 0/75, when a worker was stopped before its Session joined the process group (no step
    could complete), or when every worker had finished its stop (marker) before it was killed."""
    if agent.attempts == 0:
        return RunInterruptedError(signum, preempted=True, grace_s=grace_s,
                                   detail="no worker had started yet, nothing to save")
    if agent.stopped_cleanly():
        return RunInterruptedError(signum, preempted=True, grace_s=grace_s)
    markers = read_markers(run_dir)
    if any(marker.state == BEFORE_START for marker in markers.values()):
        # a rank that never joined the process group: no step of this attempt could complete,
        # so whatever its peers did when they found it gone (an error, a kill), nothing is lost
        return RunInterruptedError(signum, preempted=True, grace_s=grace_s,
                                   detail="a worker had not started its Session yet, nothing was trained to save")
    done = {rank for rank, marker in markers.items() if marker.done}
    if len(done) >= nproc:
        slow = sum(1 for code in agent.exit_codes.values() if code not in (0, PREEMPTED_EXIT_CODE))
        detail = "every worker finished its stop"
        if slow:
            detail += f" ({slow} still tearing down after --grace {grace_s:g} s were killed then)"
        return RunInterruptedError(signum, preempted=True, grace_s=grace_s, detail=detail)
    return RunInterruptedError(signum, preempted=False, grace_s=grace_s)


def _last_round(agent: Any) -> tuple[int | None, bool]:
    """The size of the agent's last rendezvous round (``None``: not known) and whether it joined one.
    ``get_worker_group`` is the agent's public API; its group's sizes stay ``None`` until a round completes."""
    try:
        group = agent.get_worker_group()
        size, rank = group.group_world_size, group.group_rank
    except Exception:  # noqa: BLE001 - no agent, or another torch: wait for every node, as before
        return None, True
    return (size if isinstance(size, int) and size > 0 else None), rank is not None


def report_stop(interrupted: RunInterruptedError, handler: Any, topology: Any, run_id: str,
                signal_name: str | None, grace_s: float, echo: Callable[[str], None] | None = None,
                agent: Any = None, preempt: int | None = None) -> None:
    """Several nodes: tell node 0 how this node stopped; node 0 waits for the word of every node of
    the last rendezvous round (``agent``'s: an elastic run that lost a node does not wait for it) and
    keeps the other nodes' signals in ``interrupted.other_signals``.

    Meanwhile the preemption signal ``preempt`` again changes nothing, and a further stop signal
    (SIGTERM, Ctrl-C) ends the wait at once: the run's outcome stays ``interrupted`` -- before, either
    escaped as an exception from the wait (a traceback, exit 1, and no requeue; or, for a repeated
    warning, "no worker had started yet" and a requeue while another node still saved)."""
    if topology.nnodes <= 1:
        return
    round_size, in_a_round = _last_round(agent)
    again: list[int] = []

    def stop_waiting(signum: int, frame: Any) -> None:
        if not again:
            os.write(2, f"gpukit: {signal.Signals(signum).name} again: not waiting for the other nodes\n".encode())
        again.append(signum)

    with _stop_signals_handled_by(stop_waiting, preempt, _ignore):
        reports = exchange_stop_reports(
            getattr(handler, "_store", None), run_id=run_id, node_rank=topology.node_rank, nnodes=topology.nnodes,
            signal_name=signal_name, clean=interrupted.preempted, wait_s=grace_s + REPORT_WAIT_EXTRA_S,
            echo=echo, round_size=round_size, in_a_round=in_a_round, given_up=lambda: bool(again),
        )
    if reports is not None:
        interrupted.other_signals = reports.signals
