"""The rendezvous of a gpukit launch: where it is, its parameters, its errors in words, and two
costs of torch elastic's dynamic rendezvous that gpukit's launches do not pay.

Measured on one launch of 2 CPU workers (0.83 s in all, cProfile, idle 2-core machine):

- 0.31 s: every rendezvous event names the method that recorded it with
  ``inspect.stack()`` -- twice per event, nine events per launch -- which reads the source
  file of every frame on the stack and scans ``sys.modules`` for each; the more modules a
  process has loaded (a notebook kernel), the slower. The same name comes from the frame
  itself (``sys._getframe``), without reading anything.
- 0.0-0.3 s (random): a node joining for the first time sleeps a random moment so that many
  nodes do not reach the store at once. On one machine there is one node and no crowd.

Both are replaced only for the duration of a gpukit launch, and only where torch still has
them under those names; with another torch the launch simply pays the costs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpukit.cluster import route_addr
from gpukit.errors import LaunchError
from gpukit.launch._topology import Topology

__all__ = ["ELASTIC_LAST_CALL_S", "LOCALHOST", "cheaper_rendezvous", "rendezvous_error", "rendezvous_parameters",
           "fresh_store_per_round", "grow_at_checkpoints", "rendezvous_where"]

LOCALHOST = "127.0.0.1"
#: an elastic rendezvous that has its fewest nodes waits this long for more before it completes (torch's
#: default, 30 s, would be 30 s more of a job stopped after a node died)
ELASTIC_LAST_CALL_S = 5
#: an elastic node's keep-alive: every this many seconds, and the rendezvous forgets a node after
#: ELASTIC_KEEP_ALIVE_MISSES missed ones (torch's defaults: 5 s and 3)
ELASTIC_KEEP_ALIVE_S = 2
ELASTIC_KEEP_ALIVE_MISSES = 3


def _method_name(depth: int = 2) -> str:
    """What ``inspect.stack()[depth].function`` names, read from the frame."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack
        return "no_method_name"


@contextmanager
def cheaper_rendezvous(single_machine: bool) -> Iterator[None]:
    """Within: rendezvous events named from frames; on one machine, no first-join skew."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as module
    except ImportError:
        yield
        return
    saved: dict[str, Any] = {}
    if callable(getattr(module, "get_method_name", None)):
        saved["get_method_name"] = module.get_method_name
        module.get_method_name = _method_name
    delay = getattr(module, "_delay", None)
    if single_machine and callable(delay):
        saved["_delay"] = delay

        def no_skew(seconds: Any) -> None:
            if not isinstance(seconds, tuple):  # a (low, high) range is the first-join skew
                delay(seconds)

        module._delay = no_skew
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def rendezvous_parameters(topology: Topology, run_id: str, min_nodes: int | None = None) -> Any:
    """torch elastic's rendezvous parameters for this node: exactly ``topology.nnodes`` nodes, or (elastic)
    between ``min_nodes`` and that."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    timeout_s = max(1, math.ceil(topology.rdzv_timeout_s))
    if topology.single_machine:
        endpoint, local_addr, is_host = f"{LOCALHOST}:0", LOCALHOST, True
    else:
        addr = str(topology.master_addr)
        endpoint = f"[{addr}]:{topology.master_port}" if ":" in addr else f"{addr}:{topology.master_port}"
        is_host = topology.node_rank == 0
        local_addr = topology.local_addr or (addr if is_host else route_addr(addr, topology.master_port))
    elastic: dict[str, Any] = {}
    if min_nodes is not None and min_nodes < topology.nnodes:
        elastic = {"last_call_timeout": ELASTIC_LAST_CALL_S, "keep_alive_interval": ELASTIC_KEEP_ALIVE_S,
                   "keep_alive_max_attempt": ELASTIC_KEEP_ALIVE_MISSES}
    return RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=topology.nnodes if min_nodes is None else min_nodes,
        max_nodes=topology.nnodes,
        local_addr=local_addr,
        is_host=is_host,
        join_timeout=timeout_s,  # all nodes must arrive within this
        read_timeout=timeout_s,  # reaching the store on node 0
        **elastic,
    )


def fresh_store_per_round(handler: Any) -> Any:
    """``handler`` giving the workers of every rendezvous round a store of their own.

    torch's dynamic rendezvous hosts the workers' store (``MASTER_ADDR:MASTER_PORT``,
    ``TORCHELASTIC_USE_AGENT_STORE``) in rank 0's agent, creates it in the first round and keeps it for
    every later one, with no prefix per round (torch#135712: the restart count that was meant to
    separate rounds differs between agents). The workers of a new round then find the keys the
    previous round's workers left -- among them each gloo rank's listening address. A worker that
    reads its peer's key before the peer has written it again connects to a dead process ("Gloo
    connectFullMesh failed ... Connection refused") and the group fails; the agents restart it, the
    same race runs again. Reproduced here with two ``--nnodes 1:2`` agents: a node lost, then back.

    Forgetting the cached store before each round makes rank 0's agent create a new one (on a port
    the OS picks: nothing to collide with) and publish its address under the round's own keys, where
    every node reads it -- a node joining in a later round included. The old store goes with its
    workers, which the agent stopped before this rendezvous. With a torch that keeps no such cache
    under these names the handler is returned as it is.
    """
    if not (hasattr(handler, "_bootstrap_store_info") and hasattr(handler, "_shared_tcp_store_server")):
        return handler
    inner = handler.next_rendezvous

    def next_rendezvous() -> Any:
        handler._bootstrap_store_info = None
        handler._shared_tcp_store_server = None
        return inner()

    handler.next_rendezvous = next_rendezvous
    return handler


def grow_at_checkpoints(handler: Any, run_dir: str, patience_s: float) -> Any:
    """``handler`` telling torch's agent of nodes waiting to join only once this node's workers have saved
    a checkpoint since they began to wait (or after ``patience_s``, before a joining node's own
    rendezvous times out).

    torch's agent restarts the group the moment a node waits, so every step since the last checkpoint
    would be trained again; at a checkpoint none are. Every node's agent sees its own workers note the
    same (collective) save, so they all restart together.
    """
    import time

    from gpukit.worker import checkpoints_seen

    inner = handler.num_nodes_waiting
    # torch's answer flickers between polls (each one re-reads the rendezvous state): once a node was seen
    # waiting, it is remembered until the next round (the group restarts for it, or for a failure)
    waiting: dict[str, Any] = {"since": None, "seen": None, "count": 0}

    def num_nodes_waiting() -> int:
        count = inner()
        if waiting["since"] is None:
            if count <= 0:
                return count
            waiting.update(since=time.monotonic(), seen=checkpoints_seen(run_dir), count=count)
            return 0
        waiting["count"] = max(waiting["count"], count)
        if checkpoints_seen(run_dir) != waiting["seen"] or time.monotonic() - waiting["since"] > patience_s:
            waiting["since"] = None
            return waiting["count"]
        return 0

    next_round = handler.next_rendezvous

    def next_rendezvous() -> Any:
        # a new round (for the nodes seen waiting, or for a failed worker: then it let them in too): nobody
        # seen before is waiting any more -- remembered, they restarted the grown group once more for nothing
        info = next_round()
        waiting.update(since=None, seen=None, count=0)
        return info

    handler.num_nodes_waiting = num_nodes_waiting
    handler.next_rendezvous = next_rendezvous
    return handler


def rendezvous_where(topology: Topology) -> str:
    if topology.single_machine:
        return "the local rendezvous"
    return (
        f"the rendezvous at {topology.master_addr}:{topology.master_port} "
        f"(this is node {topology.node_rank} of {topology.nnodes})"
    )


def rendezvous_error(exc: BaseException, topology: Topology) -> LaunchError:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    where = rendezvous_where(topology)
    wait = f"{topology.rdzv_timeout_s:g} s"
    if isinstance(exc, RendezvousConnectionError):
        cause = exc.__cause__ or exc
        hint = (
            "Is the port free on node 0? Choose another --master-port."
            if topology.node_rank == 0
            else "Check that node 0 runs `gpukit run` with the same --master-addr/--master-port and is "
            "reachable from here, or raise --rdzv-timeout."
        )
        detail = str(cause).strip().splitlines()[0][:200].rstrip(".") if str(cause).strip() else type(cause).__name__
        return LaunchError(f"Could not reach {where} within {wait}: {detail}. {hint}")
    if isinstance(exc, RendezvousTimeoutError):
        return LaunchError(
            f"Not all {topology.nnodes} nodes joined {where} within {wait}. Start `gpukit run` on every "
            "node with the same --nnodes/--master-addr/--master-port, or raise --rdzv-timeout."
        )
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    if isinstance(exc, RendezvousClosedError):  # node 0 ended the run (it closes its rendezvous as it ends)
        return LaunchError(
            f"The run at {where} has already ended: node 0 closed its rendezvous, so there is nothing to join. "
            "Start every node's `gpukit run` together (or within --rdzv-timeout of node 0), or start a new run.")
    return LaunchError(f"Rendezvous failed at {where}: {type(exc).__name__}: {exc}")
