"""Interface, master address and rendezvous port: real sockets, real interfaces of this machine."""

from __future__ import annotations

import os
import socket
from typing import Iterator

import psutil
import pytest

from gpukit.doctor._network import check_interface, check_master, check_port, nccl_interfaces, probe_tcp


@pytest.fixture
def listener() -> Iterator[int]:
    """A port something listens on (the "address already in use" of a second rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_busy_rendezvous_port_fails_and_names_the_holder(listener, make_ctx):
    [finding] = check_port(make_ctx({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listener)}))
    assert finding.status == "fail" and "in use" in finding.message and "MASTER_PORT=" in finding.fix
    if os.geteuid() == 0:  # psutil sees every socket's owner only as root
        assert f"pid {os.getpid()}" in finding.message


def test_free_port_is_ok_and_a_bad_port_value_fails(make_ctx):
    port = _closed_port()
    assert check_port(make_ctx({"MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}))[0].status == "ok"
    [finding] = check_port(make_ctx({"MASTER_PORT": "http"}))
    assert finding.status == "fail" and "not a port" in finding.message


def test_busy_default_port_only_warns(make_ctx):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", 29500))
        except OSError:
            pytest.skip("port 29500 is taken on this machine already")
        sock.listen()
        [finding] = check_port(make_ctx({}))
    assert finding.status == "warn" and "(default)" in finding.message


def test_probe_tcp_tells_listening_from_refused(listener):
    assert probe_tcp("127.0.0.1", listener) == "open"
    assert probe_tcp("127.0.0.1", _closed_port()) == "refused"


def test_nccl_interface_syntax():
    names = ["docker0", "eth0", "eth1", "ib0", "lo"]
    assert nccl_interfaces("eth", names) == ["eth0", "eth1"]
    assert nccl_interfaces("=eth1", names) == ["eth1"]
    assert nccl_interfaces("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_interfaces("^=eth0", names) == ["docker0", "eth1", "ib0", "lo"]
    assert nccl_interfaces("ens", names) == []


def test_socket_ifname_naming_no_interface_fails(make_ctx):
    names = sorted(psutil.net_if_addrs())
    findings = check_interface(make_ctx({"GLOO_SOCKET_IFNAME": "nosuchif0", "NCCL_SOCKET_IFNAME": "nosuchif"}))
    assert [f.status for f in findings] == ["fail", "fail"]
    assert all(", ".join(names) in f.fix for f in findings)


def test_socket_ifname_naming_loopback_is_ok(make_ctx):
    [finding] = check_interface(make_ctx({"GLOO_SOCKET_IFNAME": "lo"}))
    assert finding.status == "ok" and finding.details["interfaces"] == ["lo"]


def test_default_interface_is_the_route_to_the_master(make_ctx):
    [finding] = check_interface(make_ctx({"MASTER_ADDR": "127.0.0.1"}))
    assert finding.status == "ok" and finding.details["route_local_addr"] == "127.0.0.1"
    assert finding.details["interface"] == "lo"


def test_master_address_that_does_not_resolve_fails(make_ctx):
    [finding] = check_master(make_ctx({"MASTER_ADDR": "no-such-host.invalid"}))
    assert finding.status == "fail" and "does not resolve" in finding.message


def test_master_on_this_machine_and_no_master(make_ctx):
    [finding] = check_master(make_ctx({"MASTER_ADDR": "localhost"}))
    assert finding.status == "ok" and "this machine" in finding.message
    # loopback master with processes on several machines cannot work
    [finding] = check_master(make_ctx({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}))
    assert finding.status == "warn" and finding.fix
    one_node = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    assert check_master(make_ctx(one_node))[0].status == "ok"
    assert check_master(make_ctx({}))[0].status == "info"


def test_host_name_resolving_to_loopback_warns_for_gloo(monkeypatch, make_ctx):
    from gpukit.doctor import _network

    addrs = [(name, a.address) for name, items in psutil.net_if_addrs().items() for a in items
             if a.family == socket.AF_INET and not a.address.startswith("127.")
             and psutil.net_if_stats()[name].isup]
    if not addrs:
        pytest.skip("this machine has no non-loopback IPv4 address")
    iface, own = addrs[0]
    real_resolve = _network.resolve
    # the Debian/Ubuntu /etc/hosts default: "127.0.1.1 <hostname>"
    monkeypatch.setattr(_network, "resolve", lambda host, timeout_s=2.0: ["127.0.1.1"]
                        if host == socket.gethostname() else real_resolve(host, timeout_s))
    [finding] = check_interface(make_ctx({"MASTER_ADDR": own}))
    assert finding.status == "warn" and "127.0.1.1" in finding.message
    assert f"GLOO_SOCKET_IFNAME={iface}" in finding.fix
