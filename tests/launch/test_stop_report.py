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
    assert reports.reports == {0: {"signal": "", "clean": True}, 1: {"signal": "SIGUSR2", "clean": False}}
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
    assert server.get("gpukit/stop/r3/1") == b'{"signal": "SIGTERM", "clean": true}'
    del server  # node 0 and its store are gone
    assert exchange_stop_reports(client, run_id="r4", node_rank=1, nnodes=2, signal_name="SIGTERM", clean=True,
                                 wait_s=1, publish_timeout_s=1) is None
