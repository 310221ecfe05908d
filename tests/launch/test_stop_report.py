"""Node 0 requeues only after every node reported its stop: the exchange over a real TCPStore
(the rendezvous store node 0 hosts), with a node that reports and one that never does."""

from __future__ import annotations

import threading
from datetime import timedelta

from torch.distributed import TCPStore

from gpukit.launch._stop_report import exchange_stop_reports


def _stores() -> tuple[TCPStore, TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    return server, client


def test_node_0_waits_for_every_node_and_learns_their_signals() -> None:
    server, client = _stores()
    lines: list[str] = []
    # node 1 reports while node 0 already waits
    late = threading.Timer(0.3, lambda: exchange_stop_reports(
        client, run_id="r", node_rank=1, nnodes=2, signal_name="SIGUSR2", clean=False, wait_s=5))
    late.start()
    reports = exchange_stop_reports(server, run_id="r", node_rank=0, nnodes=2, signal_name=None, clean=True,
                                    wait_s=30, echo=lines.append)
    late.join()
    assert reports is not None and not reports.missing
    assert reports.reports == {0: {"signal": "", "clean": True, "round": True},
                               1: {"signal": "SIGUSR2", "clean": False, "round": True}}
    assert reports.signals == {"SIGUSR2"}  # the warning reached node 1 only: node 0 still requeues
    assert lines == ["gpukit: waiting for the other 1 node(s) to report their stop"]


def test_a_node_that_never_reports_is_waited_for_then_named() -> None:
    server, _ = _stores()
    lines: list[str] = []
    reports = exchange_stop_reports(server, run_id="r2", node_rank=0, nnodes=3, signal_name="SIGUSR2", clean=True,
                                    wait_s=0.5, echo=lines.append)
    assert reports is not None and reports.missing == [1, 2] and reports.waited_s >= 0.5
    assert "node(s) 1, 2 did not report their stop within 0.5 s; going on without them" in lines[-1]


def test_other_nodes_only_publish_and_a_gone_node_0_is_no_error() -> None:
    server, client = _stores()
    assert exchange_stop_reports(client, run_id="r3", node_rank=1, nnodes=2, signal_name="SIGTERM", clean=True,
                                 wait_s=1) is None
    assert server.get("gpukit/stop/r3/1") == b'{"signal": "SIGTERM", "clean": true, "round": true}'
    del server  # node 0 and its store are gone
    assert exchange_stop_reports(client, run_id="r4", node_rank=1, nnodes=2, signal_name="SIGTERM", clean=True,
                                 wait_s=1, publish_timeout_s=1) is None


def test_node_0_waits_for_the_nodes_of_its_last_round_only() -> None:
    # an elastic run (--nnodes 1:3) whose last round had 2 nodes: node 2 was lost and never reports, and a
    # node still waiting to join (no round yet) does not stand in for a member of the round
    server, client = _stores()
    exchange_stop_reports(client, run_id="r5", node_rank=2, nnodes=3, signal_name="SIGUSR2", clean=True,
                          wait_s=1, in_a_round=False)
    late = threading.Timer(0.5, lambda: exchange_stop_reports(
        client, run_id="r5", node_rank=1, nnodes=3, signal_name=None, clean=True, wait_s=1))
    late.start()
    lines: list[str] = []
    reports = exchange_stop_reports(server, run_id="r5", node_rank=0, nnodes=3, signal_name="SIGUSR2", clean=True,
                                    wait_s=30, echo=lines.append, round_size=2)
    late.join()
    # node 0 read node 2's report at once, and went on waiting for node 1's
    assert reports is not None and sorted(reports.reports) == [0, 1, 2] and reports.reports[2]["round"] is False
    assert reports.missing == [] and reports.waited_s < 10  # not the 30 s
    assert lines == ["gpukit: waiting for the other 1 node(s) to report their stop"]
    # stopped before any round completed (no round known): every node's report is waited for, and counts
    exchange_stop_reports(client, run_id="r8", node_rank=1, nnodes=2, signal_name="SIGUSR2", clean=True,
                          wait_s=1, in_a_round=False)
    early = exchange_stop_reports(server, run_id="r8", node_rank=0, nnodes=2, signal_name="SIGUSR2", clean=True,
                                  wait_s=30, in_a_round=False)
    assert early is not None and sorted(early.reports) == [0, 1] and early.waited_s < 10
    alone = exchange_stop_reports(server, run_id="r6", node_rank=0, nnodes=3, signal_name="SIGUSR2", clean=True,
                                  wait_s=30, echo=lines.append, round_size=1)
    assert alone is not None and alone.missing == [] and alone.waited_s < 10 and len(lines) == 1


def test_signals_while_node_0_waits_neither_escape_nor_cut_the_wait_short_by_a_repeated_warning() -> None:
    # node 0's launcher waits for node 1's report with its own stop handlers in place (a signal raises in its main
    # thread); SLURM may send the warning again, and its SIGTERM follows: the warning changes nothing, SIGTERM
    # ends the wait -- neither escapes (before: a traceback and exit 1 without the requeue, or a repeated
    # warning read as "no worker had started yet" and a requeue while node 1 still saved)
    import os
    import signal
    import time
    from types import SimpleNamespace

    from gpukit.launch._signals import RunInterruptedError, _raise_stop, _stop_signals_handled_by
    from gpukit.launch._stop_report import report_stop
    from gpukit.launch._topology import Topology

    server, _ = _stores()
    interrupted = RunInterruptedError(signal.SIGUSR2, preempted=True, grace_s=30)
    lines: list[str] = []
    node0 = Topology(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=server.port)
    warning = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2))
    term = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    with _stop_signals_handled_by(_raise_stop, signal.SIGUSR2):  # the launcher's handlers (gpukit.launch._signals)
        start = time.monotonic()
        warning.start()
        term.start()
        try:
            report_stop(interrupted, SimpleNamespace(_store=server), node0, "r7", "SIGUSR2", 30, lines.append,
                        preempt=signal.SIGUSR2)
            took = time.monotonic() - start
        finally:
            warning.join()
            term.join()
    assert 0.9 < took < 10, took  # past the repeated warning, ended by SIGTERM, not by the 90 s wait
    assert lines[0] == "gpukit: waiting for the other 1 node(s) to report their stop"
    assert "node(s) 1 did not report their stop within" in lines[-1]
    assert interrupted.exit_code == 75


def test_a_node_that_comes_after_the_run_ended_is_told_so() -> None:
    """Node 0 closes its rendezvous as the run ends; a node started later got "Rendezvous failed ...:
    RendezvousClosedError" (exit 2), as if something had broken."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from gpukit.launch._rendezvous import rendezvous_error
    from gpukit.launch._topology import Topology

    error = rendezvous_error(RendezvousClosedError(), Topology(nnodes=2, node_rank=1, master_addr="gpu-07"))
    assert "has already ended" in str(error) and "nothing to join" in str(error)
    assert "Rendezvous failed" not in str(error)
