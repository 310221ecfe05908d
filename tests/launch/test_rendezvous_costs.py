"""gpukit's launches skip two costs of torch's dynamic rendezvous, and leave torch as it was."""

from __future__ import annotations

import inspect
import socket
import signal
import time

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from gpukit.launch._rendezvous import _method_name, cheaper_rendezvous


def _recorder() -> tuple[str, str]:
    return _method_name(), dynamic_rendezvous.get_method_name()


def test_the_recorded_method_name_is_the_one_torch_would_name() -> None:
    def _record_event() -> tuple[str, str]:  # like DynamicRendezvousHandler._record
        return _recorder()

    ours, torch_s = _record_event()
    assert ours == torch_s == "_record_event"  # two frames up, as torch counts
    assert inspect.stack()[0].function == _method_name(1)


def test_one_machine_skips_the_join_skew_only_and_torch_is_restored() -> None:
    original_name, original_delay = dynamic_rendezvous.get_method_name, dynamic_rendezvous._delay
    with cheaper_rendezvous(single_machine=True):
        assert dynamic_rendezvous.get_method_name is _method_name
        start = time.monotonic()
        for _ in range(20):
            dynamic_rendezvous._delay(seconds=(0.2, 0.3))  # the skew: skipped
        assert time.monotonic() - start < 0.2
        start = time.monotonic()
        dynamic_rendezvous._delay(seconds=0.05)  # a real wait (e.g. polling): kept
        assert time.monotonic() - start >= 0.04
    assert dynamic_rendezvous.get_method_name is original_name
    assert dynamic_rendezvous._delay is original_delay
    with cheaper_rendezvous(single_machine=False):  # several nodes: the skew stays
        assert dynamic_rendezvous._delay is original_delay


def _two_rounds(wrap: bool) -> tuple[object, object, bool]:
    """Two rounds of a real one-node c10d rendezvous; whether a key the first round's workers left in
    their store is still there for the second round's."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import registry

    from gpukit.launch._rendezvous import fresh_store_per_round, rendezvous_parameters
    from gpukit.launch._topology import Topology

    handler = registry.get_rendezvous_handler(rendezvous_parameters(Topology(rdzv_timeout_s=30), "rounds"))
    if wrap:
        handler = fresh_store_per_round(handler)
    wait = timedelta(seconds=10)
    try:
        with cheaper_rendezvous(single_machine=True):  # no first-join skew
            first = handler.next_rendezvous().bootstrap_store_info
            worker = dist.TCPStore(first.master_addr, first.master_port, is_master=False, timeout=wait)
            worker.set("default_pg/0//cpu/rank_1", "a dead worker's address")  # what gloo leaves there
            second = handler.next_rendezvous().bootstrap_store_info  # a restart: the next round
            reader = dist.TCPStore(second.master_addr, second.master_port, is_master=False, timeout=wait)
            return first, second, reader.check(["default_pg/0//cpu/rank_1"])
    finally:
        handler.shutdown()


def test_each_rendezvous_round_gives_the_workers_an_empty_store() -> None:
    # torch alone: one store for every round, the last round's keys in it (torch#135712) -- the cause of the
    # grown group's "connectFullMesh ... Connection refused". A torch that fixes it makes this fail: drop
    # fresh_store_per_round then.
    first, second, stale = _two_rounds(wrap=False)
    assert (first.master_port, stale) == (second.master_port, True)
    first, second, stale = _two_rounds(wrap=True)
    assert first.master_port != second.master_port and not stale


def test_a_torch_without_those_private_names_keeps_its_own_behaviour(monkeypatch) -> None:
    # what gpukit changes in torch's rendezvous relies on private names; a torch without them (older, newer, or
    # another handler) runs as torch alone would: nothing replaced, nothing raised
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from gpukit.launch._rendezvous import fresh_store_per_round, rendezvous_parameters
    from gpukit.launch._signals import RunInterruptedError
    from gpukit.launch._stop_report import report_stop
    from gpukit.launch._topology import Topology

    # a handler that caches no workers' store (torch's static one): returned as it is, and its rounds run
    static = registry.get_rendezvous_handler(RendezvousParameters(
        backend="static", endpoint="127.0.0.1:0", run_id="plain", min_nodes=1, max_nodes=1, rank=0))
    assert not hasattr(static, "_bootstrap_store_info") and not hasattr(static, "_shared_tcp_store_server")
    assert fresh_store_per_round(static) is static and "next_rendezvous" not in vars(static)
    info = static.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)

    # a dynamic handler with one of the two names gone (a torch that renamed it): left alone too
    dynamic = registry.get_rendezvous_handler(rendezvous_parameters(Topology(rdzv_timeout_s=30), "renamed"))
    try:
        del dynamic._bootstrap_store_info
        assert fresh_store_per_round(dynamic) is dynamic and "next_rendezvous" not in vars(dynamic)
    finally:
        dynamic.shutdown()

    # a rendezvous module without get_method_name / _delay: the launch goes on, nothing is added to it
    monkeypatch.delattr(dynamic_rendezvous, "get_method_name")
    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    with cheaper_rendezvous(single_machine=True):
        assert not hasattr(dynamic_rendezvous, "get_method_name") and not hasattr(dynamic_rendezvous, "_delay")
    assert not hasattr(dynamic_rendezvous, "get_method_name") and not hasattr(dynamic_rendezvous, "_delay")

    # a handler without a store to report a stop through: node 0 waits for no one, no error
    stopped = RunInterruptedError(signal.SIGUSR2, preempted=True, grace_s=1)
    start = time.monotonic()
    report_stop(stopped, object(), Topology(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=1),
                "plain", "SIGUSR2", grace_s=1, agent=object())
    assert stopped.other_signals == set() and time.monotonic() - start < 1


def test_a_node_seen_waiting_is_forgotten_once_a_round_lets_it_in(tmp_path) -> None:
    # node 1 waits to join; node 0's group restarts for another reason (a worker failed) before its next
    # checkpoint, and that round lets node 1 in. Node 0 must not then restart the grown group once more for the
    # node it saw waiting before (a whole restart for nothing)
    import threading

    from torch.distributed.elastic.rendezvous import registry

    from gpukit.launch._rendezvous import fresh_store_per_round, grow_at_checkpoints, rendezvous_parameters
    from gpukit.launch._topology import Topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [fresh_store_per_round(registry.get_rendezvous_handler(rendezvous_parameters(  # as the launcher's
        Topology(nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=port, local_addr="127.0.0.1",
                 rdzv_timeout_s=60), "grow", min_nodes=1))) for rank in (0, 1)]
    raw = type(nodes[0]).num_nodes_waiting  # torch's own count
    node0 = grow_at_checkpoints(nodes[0], str(tmp_path), patience_s=0)
    joined: list[object] = []
    try:
        node0.next_rendezvous()  # node 0 alone (its fewest nodes, after the last call)
        late = threading.Thread(target=lambda: joined.append(nodes[1].next_rendezvous()))
        late.start()
        deadline = time.monotonic() + 30
        while raw(node0) < 1 and time.monotonic() < deadline:  # node 1 in the wait list
            time.sleep(0.05)
        assert raw(node0) == 1
        assert node0.num_nodes_waiting() == 0  # seen: held back until a checkpoint (or patience)
        assert node0.next_rendezvous().world_size == 2  # a restart for a failure: node 1 is let in
        late.join(timeout=30)
        assert joined and raw(node0) == 0
        assert node0.num_nodes_waiting() == 0  # nobody waits any more: no second restart
    finally:
        for node in nodes:
            node.shutdown()
