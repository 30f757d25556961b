"""MPTCP transport: one MPTCP connection per peer (logical rail 0 = the first rail's
address); the kernel path manager opens subflows over the other rails.

Endpoints must be configured on every host (``configure_mptcp_endpoints``, run as root in
each host's namespace): every rail address other than the first becomes a ``signal subflow``
endpoint (announced to the peer, and used to open subflows from), and the limits allow up to
8 subflows / accepted addresses. (In the testbed, ``signal`` alone never opened the second
subflow.)
"""
from __future__ import annotations

import socket
import subprocess

from ..config import Config
from ..errors import ConfigError
from .base import Transport

IPPROTO_MPTCP = getattr(socket, "IPPROTO_MPTCP", 262)


class MptcpTransport(Transport):
    name = "mptcp"

    def __init__(self, rails, config: Config = Config()):
        super().__init__(rails, config)
        self.all_rails = list(rails)
        self.rails = self.all_rails[:1]   # one logical rail

    def new_socket(self) -> socket.socket:
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_MPTCP)
        except OSError as e:
            raise ConfigError(f"MPTCP sockets are not available: {e} "
                              f"(needs a kernel with CONFIG_MPTCP and net.mptcp.enabled=1)") from e


MAX_ENDPOINTS = 8      # the in-kernel path manager's address table (MPTCP_PM_ADDR_MAX)


def configure_mptcp_endpoints(rails, flags: str = "signal subflow", subflows: int = 8,
                              add_addr_accepted: int = 8, flush: bool = True,
                              netns: str | None = None, run=subprocess.run) -> list[list[str]]:
    """Configure the in-kernel MPTCP path manager of this host (root).

    ``rails`` is a list of (addr, ifname) in rail order. The first rail carries the initial
    subflow; every further rail becomes an endpoint with ``flags`` (default ``signal subflow``:
    the address is announced to the peer and subflows are opened from it; ``"subflow
    fullmesh"`` etc. for other set-ups). ``netns`` runs the
    commands inside ``ip netns exec``. Returns the commands run.

    The kernel's path manager holds at most MAX_ENDPOINTS addresses and opens at most 8 extra
    subflows per connection: rails beyond the first 1 + MAX_ENDPOINTS are left out of the
    MPTCP baseline (adding them fails with "too many addresses").
    """
    rails = list(rails)[:1 + MAX_ENDPOINTS]
    pre = ["ip", "netns", "exec", netns] if netns else []
    cmds = []
    if flush:
        cmds.append(pre + ["ip", "mptcp", "endpoint", "flush"])
    cmds.append(pre + ["ip", "mptcp", "limits", "set", "subflow", str(subflows),
                       "add_addr_accepted", str(add_addr_accepted)])
    for i, (addr, ifname) in enumerate(rails):
        if i == 0:
            continue
        cmd = pre + ["ip", "mptcp", "endpoint", "add", addr]
        if ifname:
            cmd += ["dev", ifname]
        cmd += flags.split()
        cmds.append(cmd)
    for c in cmds:
        r = run(c, capture_output=True, text=True)
        if r.returncode != 0:
            raise ConfigError(f"{' '.join(c)} failed: {r.stderr.strip()}")
    return cmds
