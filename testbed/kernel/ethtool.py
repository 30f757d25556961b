"""TSO/GSO of an interface through the legacy ethtool ioctls (SIOCETHTOOL), no ethtool binary.

The ioctl acts on the namespace of the socket it is issued on, so ``offloads_in`` and
``set_offloads_in`` issue it on a socket of the interface's namespace: the one its netlink
handle keeps (``Rtnl.inet_socket``; no thread switch, which matters inside a fault), else one
opened on the netns worker thread inside it (``netns.call_in``); ``get_offloads``/
``set_offloads`` without a socket act in the calling thread's namespace.
When to turn the offloads off is the shaper's business (testbed.fabric.shaper: per-packet loss).
"""
from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
from typing import Any, Optional

from testbed.kernel import netns

SIOCETHTOOL = 0x8946
ETHTOOL_GTSO, ETHTOOL_STSO = 0x1E, 0x1F
ETHTOOL_GGSO, ETHTOOL_SGSO = 0x23, 0x24


def _ethtool_value(ifname: str, cmd: int, data: int = 0,
                   sock: Optional[socket.socket] = None) -> int:
    value = (ctypes.c_uint32 * 2)(cmd, data)           # struct ethtool_value
    ifreq = bytearray(struct.pack("16sP", ifname.encode(), ctypes.addressof(value)).ljust(40,
                                                                                        b"\0"))
    if sock is not None:
        fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
    return value[1]


def get_offloads(ifname: str, sock: Optional[socket.socket] = None) -> dict:
    """{"tso": bool, "gso": bool} of an interface in ``sock``'s namespace (None: the current
    thread's)."""
    return {"tso": bool(_ethtool_value(ifname, ETHTOOL_GTSO, sock=sock)),
            "gso": bool(_ethtool_value(ifname, ETHTOOL_GGSO, sock=sock))}


def set_offloads(ifname: str, tso: bool, gso: bool,
                 sock: Optional[socket.socket] = None) -> dict:
    """Set TSO and GSO in ``sock``'s namespace (None: the current thread's); returns what the
    kernel has now."""
    _ethtool_value(ifname, ETHTOOL_STSO, int(tso), sock=sock)
    _ethtool_value(ifname, ETHTOOL_SGSO, int(gso), sock=sock)
    return get_offloads(ifname, sock)


def _socket_of(handle: Any) -> Optional[socket.socket]:
    """The ioctl socket a namespace's netlink handle keeps (testbed.kernel.rtnl), if any."""
    get = getattr(handle, "inet_socket", None)
    return get() if get is not None else None


def offloads_in(ns: Optional[str], ifname: str, handle: Any = None) -> dict:
    """{"tso": bool, "gso": bool} of ``ifname`` in namespace ``ns`` (``handle``: that
    namespace's Rtnl, whose socket saves the trip to the worker thread)."""
    sock = _socket_of(handle)
    if sock is not None:
        return get_offloads(ifname, sock)
    return netns.call_in(ns, get_offloads, ifname)


def set_offloads_in(ns: Optional[str], ifname: str, tso: bool, gso: bool,
                    handle: Any = None) -> dict:
    """Set TSO/GSO of ``ifname`` in namespace ``ns``; returns what the kernel has now."""
    sock = _socket_of(handle)
    if sock is not None:
        return set_offloads(ifname, tso, gso, sock)
    return netns.call_in(ns, set_offloads, ifname, tso, gso)
