"""Is this address loopback? One answer for ZeroMQ endpoints, HTTP URLs and bind hosts.

Guards that relax security on loopback (no CURVE on the broker, the development token secret,
fault injection) rest on this check, so it is strict: a host counts as loopback only when it is an
IP literal in 127.0.0.0/8 or ``::1``, or exactly ``localhost``. Anything it cannot read the way the
socket layer will read it is *not* loopback. In particular libzmq's ``tcp://source;bind`` form
binds the part after ``;``, and interface names (``lo``, ``eth0``) or ``*`` resolve at bind time,
so any ``;`` and any non-literal host are refused rather than interpreted.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOCAL_SCHEMES = ("ipc://", "inproc://")


def is_loopback_host(host: str) -> bool:
    """``localhost``, or an IP literal (IPv6 with or without brackets) that is loopback."""
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split_host_port(hostport: str) -> tuple[str, str] | None:
    """``host:port`` or ``[v6]:port`` -> (host, port), or None when it is not that shape."""
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0 or hostport[end + 1:end + 2] != ":":
            return None
        return hostport[:end + 1], hostport[end + 2:]
    host, sep, port = hostport.rpartition(":")
    if not sep or ":" in host:
        return None
    return host, port


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint can only be reached from this host (ipc, inproc, loopback tcp)."""
    if endpoint.startswith(LOCAL_SCHEMES):
        return True
    if not endpoint.startswith("tcp://") or ";" in endpoint:
        return False
    parts = _split_host_port(endpoint[len("tcp://"):])
    if parts is None:
        return False
    host, port = parts
    return is_loopback_host(host) and (port == "*" or (port.isascii() and port.isdigit()))


def is_loopback_url(url: str) -> bool:
    """Whether an http(s) URL points at this host (``http://127.0.0.1:8765``, ``http://[::1]``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or "@" in parts.netloc:
        return False
    host = parts.netloc.rsplit(":", 1)[0] if not parts.netloc.startswith("[") else parts.netloc.split("]")[0] + "]"
    return is_loopback_host(host)
