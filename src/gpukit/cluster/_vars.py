"""Reading launcher and scheduler variables: each value checked, each error naming its variable.

Everything here reads text someone else set (a job script, a scheduler, a user's shell), so
nothing is trusted: integers have bounded digits and ranges, ports are 1..65535, host names
follow RFC 1123 (or are IP addresses), and every refusal is a :class:`ConfigurationError`
that says which variable holds what, what is allowed and how to fix it. No torch.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections.abc import Mapping

from gpukit.errors import ConfigurationError

__all__ = ["check_host", "check_port", "env_int", "env_port", "env_host", "resolve_host", "route_addr", "MAX_HOST_CHARS"]

#: longest host name DNS allows (RFC 1035: 253 characters, labels of at most 63)
MAX_HOST_CHARS = 253
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_INT = re.compile(r"^\s*[+-]?\d{1,18}\s*$")  # bounded digits: int() of 5,000 digits raises, 10**400 overflows C


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:80] + "...")


def check_host(value: str, what: str) -> str:
    """``value`` if it is an IP address or an RFC 1123 host name, else a ConfigurationError naming ``what``.

    Args:
        value: the address text.
        what: how the message names it, e.g. ``"MASTER_ADDR"`` or ``"--master-addr"``.
    """
    text = value.strip()
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text.strip("[]")
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    why = None
    if not name:
        why = "it is empty"
    elif len(name) > MAX_HOST_CHARS:
        why = f"it is {len(name)} characters long (a host name has at most {MAX_HOST_CHARS})"
    else:
        bad = next((label for label in name.split(".") if not _LABEL.match(label)), None)
        if bad is not None:
            why = ("it has an empty part between dots" if not bad else
                   f"its part {_shown(bad)} is not 1-63 letters, digits, '-' or '_' (not starting or ending with '-')")
    if why is not None:
        raise ConfigurationError(f"{what}={_shown(value)} is not a host name or IP address: {why}. Give node 0's "
                                 "IP address or a host name every node resolves, e.g. node001 or 10.0.0.1.")
    return text


def check_port(value: str | int, what: str) -> int:
    """``value`` as a port 1..65535, else a ConfigurationError naming ``what``."""
    text = str(value)
    if not _INT.match(text) or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{what}={_shown(text)} is not a port number: give an integer from 1 to 65535 "
                                 "(e.g. 29500), or unset it.")
    return int(text)


def env_int(env: Mapping[str, str], *keys: str, default: int | None = None, low: int = 0,
            high: int = 2**31 - 1, hint: str = "") -> int:
    """The first of ``keys`` that is set, as an integer in ``low..high``; else ``default``.

    Raises:
        ConfigurationError: the value is not such an integer (naming the variable), or no key is
            set and there is no default.
    """
    for key in keys:
        value = env.get(key)
        if value is None or not value.strip():
            continue
        if not _INT.match(value) or not low <= int(value) <= high:
            raise ConfigurationError(f"{key}={_shown(value)} is not an integer from {low} to {high:,}. "
                                     + (hint or "Set it to such an integer, or unset it."))
        return int(value)
    if default is None:
        raise ConfigurationError(f"{' / '.join(keys)} is not set. " + (hint or "Set it to an integer."))
    return default


def env_port(env: Mapping[str, str], key: str = "MASTER_PORT") -> int | None:
    """``env[key]`` as a port, ``None`` when unset or empty."""
    value = env.get(key)
    return None if value is None or not value.strip() else check_port(value, key)


def env_host(env: Mapping[str, str], key: str = "MASTER_ADDR") -> str | None:
    """``env[key]`` checked as a host name or IP address, ``None`` when unset or empty."""
    value = env.get(key)
    return None if value is None or not value.strip() else check_host(value, key)


def resolve_host(host: str, timeout_s: float = 2.0) -> list[str] | None:
    """Addresses ``host`` resolves to; ``None`` if it does not, or DNS takes over ``timeout_s``.

    The lookup runs in a daemon thread, so a resolver that hangs (an unreachable DNS server
    retried for a minute) costs at most ``timeout_s``.
    """
    result: list[list[str] | None] = [None]

    def work() -> None:
        try:
            result[0] = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
        except (OSError, UnicodeError, ValueError):
            result[0] = None

    thread = threading.Thread(target=work, name="gpukit-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0]


def route_addr(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (what the others reach it by), or ``None``."""
    # A UDP "connect" sends nothing; it only asks the kernel which local address routes there.
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return str(sock.getsockname()[0])
    except OSError:
        return None
