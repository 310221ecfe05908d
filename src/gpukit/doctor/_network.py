"""The network a multi-machine run would use: interface, master address, rendezvous port.

gloo and NCCL pick their interface from ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (NCCL:
comma-separated prefixes, ``=name`` for an exact name, a leading ``^`` to exclude); without
them gloo uses the address the host name resolves to, which on many Debian/Ubuntu machines is
127.0.1.1 (then the other nodes cannot connect back). The master address is ``MASTER_ADDR``;
the rendezvous port ``MASTER_PORT`` (default 29500), which must be free on the master node.
Without ``MASTER_ADDR``, the master is what :func:`gpukit.cluster.environment` detected (the
first node of a SLURM job, with a port derived from the job id).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Any

from gpukit.cluster import check_port as valid_port
from gpukit.cluster import env_host, env_int, env_port, resolve_host, route_addr
from gpukit.doctor._context import DoctorContext
from gpukit.errors import ConfigurationError
from gpukit.doctor._finding import Finding

__all__ = ["DEFAULT_MASTER_PORT", "check_interface", "check_master", "check_port", "nccl_interfaces",
           "probe_tcp", "resolve"]

DEFAULT_MASTER_PORT = 29500
_RESOLVE_TIMEOUT_S = 2.0
_CONNECT_TIMEOUT_S = 1.0
_INVALID_ADDR = "invalid MASTER_ADDR"


def _interfaces() -> dict[str, dict[str, Any]]:
    """name -> {"up": bool, "addrs": [ip, ...]} for every interface here."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, dict[str, Any]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        out[name] = {"up": bool(getattr(stats.get(name), "isup", False)), "addrs": ips}
    return out


def nccl_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces of ``names`` that ``NCCL_SOCKET_IFNAME=spec`` selects, by NCCL's rules."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    wanted = [w.strip() for w in body.split(",") if w.strip()]

    def matches(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if matches(n) != exclude]


def resolve(host: str, timeout_s: float = _RESOLVE_TIMEOUT_S) -> list[str] | None:
    """Addresses ``host`` resolves to; ``None`` if it does not (or DNS takes over ``timeout_s``)."""
    return resolve_host(host, timeout_s)


def probe_tcp(addr: str, port: int, timeout_s: float = _CONNECT_TIMEOUT_S) -> str:
    """``"open"`` (something listens), ``"refused"`` (host up, port closed) or ``"unreachable"``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"


def _master(ctx: DoctorContext) -> tuple[str | None, int, str]:
    """``(address, port, where it came from)``: MASTER_ADDR/MASTER_PORT, else the detected cluster's.

    A MASTER_ADDR that is no host name gives ``(None, port, "invalid MASTER_ADDR")`` (check_master
    reports it); a MASTER_PORT that is no port gives the default port (check_port reports it).
    """
    env, cluster = ctx.env, ctx.cluster
    port_text = env.get("MASTER_PORT", "")
    try:
        port = env_port(env, "MASTER_PORT") or DEFAULT_MASTER_PORT
    except ConfigurationError:
        port = DEFAULT_MASTER_PORT
    if env.get("MASTER_ADDR", "").strip():
        try:
            return env_host(env, "MASTER_ADDR"), port, "MASTER_ADDR"
        except ConfigurationError:
            return None, port, _INVALID_ADDR
    if cluster is not None and cluster.master_addr:
        if not port_text and cluster.master_port is not None:
            port = cluster.master_port
        return cluster.master_addr, port, f"{cluster.kind} detection"
    return None, port, "unset"


def _local_ips(ifaces: dict[str, dict[str, Any]]) -> set[str]:
    return {ip for info in ifaces.values() for ip in info["addrs"]}


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _iface_of(ip: str | None, ifaces: dict[str, dict[str, Any]]) -> str | None:
    return next((name for name, info in ifaces.items() if ip in info["addrs"]), None)


def check_interface(ctx: DoctorContext) -> list[Finding]:
    """The interface gloo and NCCL would use, and whether it exists and is up."""
    ifaces = _interfaces()
    names = sorted(ifaces)
    have = ", ".join(f"{n}{'' if ifaces[n]['up'] else ' (down)'}" for n in names)
    findings = []
    for var, backend in (("GLOO_SOCKET_IFNAME", "gloo"), ("NCCL_SOCKET_IFNAME", "NCCL")):
        spec = ctx.env.get(var)
        if not spec:
            continue
        chosen = (nccl_interfaces(spec, names) if backend == "NCCL"
                  else [n for n in (s.strip() for s in spec.split(",")) if n in ifaces])
        details = {"variable": var, "value": spec, "interfaces": chosen, "available": names}
        missing = [] if backend == "NCCL" else [s.strip() for s in spec.split(",") if s.strip() not in ifaces]
        down = [n for n in chosen if not ifaces[n]["up"]]
        if not chosen or missing:
            findings.append(Finding(f"network.interface.{backend.lower()}", "fail",
                                    f"{var}={spec!r} names no interface here ({', '.join(missing) or 'no match'}); "
                                    f"interfaces: {have}", f"set {var} to one of: {', '.join(names)}", details))
        elif down:
            findings.append(Finding(f"network.interface.{backend.lower()}", "fail",
                                    f"{var}={spec!r} selects {', '.join(down)}, which is down",
                                    f"bring it up (`ip link set {down[0]} up`) or choose another: {have}", details))
        else:
            findings.append(Finding(f"network.interface.{backend.lower()}", "ok",
                                    f"{backend} uses {', '.join(chosen)} ({var}={spec!r})", None, details))
    if not any(ctx.env.get(v) for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")):
        findings.append(_default_interface(ctx, ifaces, have))
    ctx.extra["interfaces"] = ifaces
    return findings


def _default_interface(ctx: DoctorContext, ifaces: dict[str, dict[str, Any]], have: str) -> Finding:
    name = "network.interface"
    addr, port, _ = _master(ctx)
    host = socket.gethostname()
    host_ips = resolve(host) or []
    if addr is not None:
        local = route_addr(addr, port)
        iface = _iface_of(local, ifaces)
        details = {"master_addr": addr, "route_local_addr": local, "interface": iface, "hostname_addrs": host_ips}
        if local is None and resolve(addr) is None:
            return Finding(name, "info", f"no interface to judge: the master address {addr!r} does not resolve "
                           "(see network.master)", None, details)
        if local is None:
            return Finding(name, "fail", f"no route to the master address {addr}",
                           f"check this machine's network (`ip route get {addr}`)", details)
        if all(_is_loopback(ip) for ip in host_ips) and host_ips and not _is_loopback(local):
            return Finding(name, "warn",
                           f"traffic to {addr} leaves through {iface or '?'} ({local}), but the host name {host!r} "
                           f"resolves to {', '.join(host_ips)}: gloo would advertise a loopback address the other "
                           "nodes cannot reach",
                           "export GLOO_SOCKET_IFNAME={0} NCCL_SOCKET_IFNAME={0}".format(iface or "<interface>"),
                           details)
        return Finding(name, "ok", f"traffic to the master {addr} leaves through {iface or '?'} ({local}); "
                       "gloo/NCCL pick it without *_SOCKET_IFNAME", None, details)
    details = {"hostname": host, "hostname_addrs": host_ips, "interfaces": sorted(ifaces)}
    return Finding(name, "info", f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset and no MASTER_ADDR (one machine); "
                   f"host {host!r} resolves to {', '.join(host_ips) or 'nothing'}; interfaces: {have}", None, details)


def _several_machines(ctx: DoctorContext) -> bool:
    # the detected job's node count (SLURM, PyTorchJob), or more ranks in the world than on this node
    if ctx.cluster is not None and ctx.cluster.nodes > 1:
        return True
    try:
        world, local = env_int(ctx.env, "WORLD_SIZE", default=0), env_int(ctx.env, "LOCAL_WORLD_SIZE", default=0)
    except ConfigurationError:  # cluster.environment reports the bad value
        return False
    return world > local > 0


def check_master(ctx: DoctorContext) -> list[Finding]:
    """Whether the master address resolves, is this machine or is reachable from it."""
    name = "network.master"
    addr, port, source = _master(ctx)
    if source == _INVALID_ADDR:
        try:
            env_host(ctx.env, "MASTER_ADDR")
        except ConfigurationError as exc:
            return [Finding(name, "fail", str(exc), "export MASTER_ADDR=<node 0's address> (or unset it on one machine)",
                            {"master_addr": ctx.env.get("MASTER_ADDR", "")[:300]})]
    if addr is None:
        return [Finding(name, "info", "no master address (MASTER_ADDR unset): a one-machine run; "
                        "`gpukit run` picks a free local port itself", None, {"master_addr": None})]
    ips = resolve(addr)
    details: dict[str, Any] = {"master_addr": addr, "master_port": port, "source": source, "resolved": ips}
    if not ips:
        return [Finding(name, "fail", f"master address {addr!r} ({source}) does not resolve",
                        "use node 0's IP address or a host name every node resolves (check /etc/hosts, DNS)",
                        details)]
    ifaces = ctx.extra.get("interfaces") or _interfaces()
    local = sorted(set(ips) & _local_ips(ifaces))
    if local or all(_is_loopback(ip) for ip in ips):
        iface = _iface_of(local[0], ifaces) if local else "lo"
        details["interface"] = iface
        loop = all(_is_loopback(ip) for ip in ips)
        status = "warn" if loop and _several_machines(ctx) else "ok"
        return [Finding(name, status, f"master {addr} ({source}) is this machine ({', '.join(ips)} on {iface})"
                        + ("; a loopback address works only when every process runs here" if loop else ""),
                        "set MASTER_ADDR to this machine's address on the cluster network" if status != "ok" else None,
                        details)]
    answer = probe_tcp(ips[0], port)
    details["probe"] = answer
    if answer == "unreachable":
        return [Finding(name, "warn", f"master {addr} ({', '.join(ips)}) did not answer on port {port} within "
                        f"{_CONNECT_TIMEOUT_S:g} s (firewalled or unreachable)",
                        f"check the route and firewall to {addr}:{port} (`nc -vz {addr} {port}`)", details)]
    state = "the rendezvous is listening" if answer == "open" else "nothing listens there yet (start node 0 first)"
    return [Finding(name, "ok", f"master {addr} ({', '.join(ips)}) is reachable on port {port}: {state}", None,
                    details)]


def _port_holder(port: int) -> str | None:
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return "a process of another user"
                proc = psutil.Process(conn.pid)
                return f"pid {conn.pid} ({' '.join(proc.cmdline())[:60] or proc.name()})"
    except (psutil.Error, OSError):
        return None
    return None


def check_port(ctx: DoctorContext) -> list[Finding]:
    """Whether the rendezvous port can be bound here (it must be free on the master node)."""
    name = "network.port"
    addr, port, source = _master(ctx)
    explicit = "MASTER_PORT" in ctx.env
    origin = "MASTER_PORT" if explicit else source if source.endswith("detection") else "default"
    details: dict[str, Any] = {"port": port, "explicit": explicit, "source": origin}
    try:
        if explicit:
            valid_port(ctx.env["MASTER_PORT"], "MASTER_PORT")
    except ConfigurationError as exc:
        details["port"] = None
        return [Finding(name, "fail", str(exc), f"export MASTER_PORT={DEFAULT_MASTER_PORT}", details)]
    if addr is not None:
        ifaces = ctx.extra.get("interfaces") or _interfaces()
        ips = resolve(addr) or []
        if ips and not (set(ips) & _local_ips(ifaces)) and not all(_is_loopback(ip) for ip in ips):
            return [Finding(name, "info", f"port {port} is bound on the master {addr}, not here", None, details)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as c10d's TCPStore does: a port in TIME_WAIT is reusable, one with a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                return [Finding(name, "warn", f"cannot bind rendezvous port {port}: {exc.strerror or exc}",
                                "pick another port with --master-port / MASTER_PORT", details)]
            holder = _port_holder(port)
            details["holder"] = holder
            why = "in use" if exc.errno == errno.EADDRINUSE else "not allowed for this user"
            return [Finding(name, "fail" if origin != "default" else "warn",
                            f"rendezvous port {port} ({origin}) is {why}"
                            + (f", held by {holder}" if holder else "") + ": \"address already in use\" at start",
                            f"pick a free port (--master-port / MASTER_PORT={_free_port()})"
                            + (" or end the holder" if holder else ""), details)]
    return [Finding(name, "ok", f"rendezvous port {port} ({origin}) is free",
                    None, details)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
