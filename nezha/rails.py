"""Rail specifications: an IPv4 address or an interface name, resolved to an address."""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from .errors import RailConfigError

SIOCGIFADDR = 0x8915


def iface_ipv4(name: str) -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(res[20:24])
    except OSError as e:
        raise RailConfigError(f"rail {name!r} is neither an IPv4 address nor an interface with "
                              f"an IPv4 address on this host: {e.strerror or e}") from e
    finally:
        s.close()


def resolve_rail(spec: str) -> str:
    spec = spec.strip()
    if not spec:
        raise RailConfigError("empty rail specification")
    try:
        return str(ipaddress.IPv4Address(spec))
    except ValueError:
        return iface_ipv4(spec)


def parse_rails(rails) -> list[str]:
    """'10.0.0.1,eth2' or a list -> list of IPv4 strings, in rail order."""
    if rails is None:
        raise RailConfigError("no rails given (argument rails= or NEZHA_RAILS)")
    if isinstance(rails, str):
        rails = [r for r in rails.split(",") if r.strip()]
    out = [resolve_rail(str(r)) for r in rails]
    if not out:
        raise RailConfigError("no rails given")
    if len(set(out)) != len(out):
        raise RailConfigError(f"the same address appears twice in the rails {out}")
    if len(out) > 255:
        raise RailConfigError("at most 255 rails")
    return out
