"""TSO/GSO of an interface through the legacy ethtool ioctls (SIOCETHTOOL), no ethtool binary.

The ioctl acts on the namespace of the socket it is issued on, so ``offloads_in`` and
``set_offloads_in`` issue it on the netns worker thread inside the interface's namespace
(``netns.call_in``); ``get_offloads``/``set_offloads`` act in the calling thread's namespace.
When to turn the offloads off is the shaper's business (testbed.fabric.shaper: per-packet loss).
"""
from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
from typing import Optional

from testbed.kernel import netns

SIOCETHTOOL = 0x8946
ETHTOOL_GTSO, ETHTOOL_STSO = 0x1E, 0x1F
ETHTOOL_GGSO, ETHTOOL_SGSO = 0x23, 0x24


def _ethtool_value(ifname: str, cmd: int, data: int = 0) -> int:
    value = (ctypes.c_uint32 * 2)(cmd, data)           # struct ethtool_value
    ifreq = bytearray(struct.pack("16sP", ifname.encode(), ctypes.addressof(value)).ljust(40,
                                                                                        b"\0"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
    return value[1]


def get_offloads(ifname: str) -> dict:
    """{"tso": bool, "gso": bool} of an interface in the current thread's namespace."""
    return {"tso": bool(_ethtool_value(ifname, ETHTOOL_GTSO)),
            "gso": bool(_ethtool_value(ifname, ETHTOOL_GGSO))}


def set_offloads(ifname: str, tso: bool, gso: bool) -> dict:
    """Set TSO and GSO in the current thread's namespace; returns what the kernel has now."""
    _ethtool_value(ifname, ETHTOOL_STSO, int(tso))
    _ethtool_value(ifname, ETHTOOL_SGSO, int(gso))
    return get_offloads(ifname)


def offloads_in(ns: Optional[str], ifname: str) -> dict:
    """{"tso": bool, "gso": bool} of ``ifname`` in namespace ``ns``."""
    return netns.call_in(ns, get_offloads, ifname)


def set_offloads_in(ns: Optional[str], ifname: str, tso: bool, gso: bool) -> dict:
    """Set TSO/GSO of ``ifname`` in namespace ``ns``; returns what the kernel has now."""
    return netns.call_in(ns, set_offloads, ifname, tso, gso)
