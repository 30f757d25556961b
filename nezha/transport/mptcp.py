"""MPTCP transport: one MPTCP connection per peer (logical rail 0, dialled from and to the first
rail's address); the kernel's path manager adds a subflow over every further rail.

The baseline is configured as an MPTCP user who knows the kernel would (``configure_mptcp_endpoints``,
as root in every host's namespace; the testbed does it once per run). Each choice, and why:

* **Path manager and scheduler**: the in-kernel path manager (``net.mptcp.pm_type=0``), the
  same rules for every connection, no daemon; the ``default`` scheduler, the only one a kernel
  without BPF schedulers has (``net.mptcp.available_schedulers``).
* **Endpoints**: every rail address but the first is a ``signal`` endpoint, with its ``dev``.
  Each end announces it (ADD_ADDR) and the end that accepts the announcement opens a subflow
  *to* it, from the source address its routes pick for that rail's network: one subflow per
  rail, both ends on the same rail. Not ``subflow``: such an endpoint opens a subflow from its
  address to the peer's *initial* address (on r0), a path between two rails' addresses that
  only works because Linux answers ARP for any of its addresses on any interface (the set-up
  before issue 13 had 12 of them in 4 hosts x 2 rails, next to 12 failed joins). Not
  ``fullmesh``: one subflow per local endpoint x peer address, the cross-rail pairs again.
  Not ``backup``: every rail carries data.
* **Listener on the wildcard address** (``MptcpTransport.listen``): an MP_JOIN to an announced
  address needs a listener on that address and the connection's port; one bound to the first
  rail's address refused every join (``SF_CLOSED ... error=111`` in ``ip mptcp monitor``),
  which is why ``signal`` alone "never opened the second subflow" before.
* **Limits**: ``subflows`` = ``add_addr_accepted`` = rails - 1 (the kernel's maximum is 8): one
  subflow per announced rail, none more.
* **net.mptcp.stale_loss_cnt = STALE_LOSS_CNT**: a subflow with data outstanding and no ACK over
  more than that many MPTCP-level retransmission intervals (about 200 ms each) is *stale*:
  the scheduler skips it and its unacknowledged data is sent again on the others. The kernel
  marks one stale only while another subflow's own count is below max(cnt - 1, 1): with 1 or
  2 a busy healthy subflow (count 1 every other interval) rarely qualifies and the dead one
  stayed in use for the whole outage (measured: first SubflowStale 3.5 s into a 3 s link-down
  with 1). The default 4 trades switch-over time for lossy links' utilisation.
* **allow_join_initial_addr_port = 1** (the default; the peer may also join the initial
  address), **add_addr_timeout** the default 120 s (an unanswered ADD_ADDR is re-sent; the
  connections are made long before any fault).
* **No short TCP_USER_TIMEOUT on subflows**: a subflow the kernel gives up on is closed, and
  the in-kernel path manager never opens it again (the rail would be lost to that connection
  for good); the transport's TCP_USER_TIMEOUT is the job's timeout. The routes' ``rto_min``
  (the testbed's ``tcp: {rto_min}``) applies to every subflow as to any TCP connection; the
  per-socket minimum the TCP rails take (``NEZHA_TCP_RTO_MIN_MS``) does not: MPTCP sockets
  refuse TCP_RTO_MIN_US (ENOPROTOOPT on Linux 6.18), so the baseline keeps the routes'.
* **No rail link events** (``link_events = False``): nezha/health.py fails a rail's
  connections when its interface goes down; for MPTCP that rail is the whole connection,
  whose subflows the kernel moves. With it, a link-down of r0 failed every MPTCP connection
  from Nezha's side and they were re-dialled only after the link came back.
"""
from __future__ import annotations

import socket
import subprocess

from ..config import Config
from ..errors import ConfigError, RailConfigError
from .base import Transport

IPPROTO_MPTCP = getattr(socket, "IPPROTO_MPTCP", 262)


class MptcpTransport(Transport):
    name = "mptcp"
    link_events = False    # the kernel moves the subflows (module docstring)

    def __init__(self, rails, config: Config = Config()):
        super().__init__(rails, config)
        self.rto_min_ms = 0.0             # MPTCP sockets refuse TCP_RTO_MIN_US (docstring)
        self.all_rails = list(rails)
        self.rails = self.all_rails[:1]   # one logical rail

    def new_socket(self) -> socket.socket:
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_MPTCP)
        except OSError as e:
            raise ConfigError(f"MPTCP sockets are not available: {e} "
                              f"(needs a kernel with CONFIG_MPTCP and net.mptcp.enabled=1)") from e

    def listen(self) -> list[tuple[str, int]]:
        """One listener on the wildcard address: the peers' joins to this host's announced
        rail addresses reach it (bound to the first rail's address, every join was refused);
        the rendezvous still names the first rail's address."""
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:            # the first rail's address must be this host's: it is dialled from
            probe.bind((self.rails[0], 0))
        except OSError as e:
            raise RailConfigError(f"rail 0: cannot bind to {self.rails[0]}: {e.strerror or e} "
                                  f"(is the address configured on this host?)") from e
        finally:
            probe.close()
        s = self.new_socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", 0))
        except OSError as e:
            s.close()
            raise RailConfigError(f"MPTCP: cannot listen: {e.strerror or e}") from e
        s.listen(256)
        self.listeners.append(s)
        return [(self.rails[0], s.getsockname()[1])]


MAX_ENDPOINTS = 8      # the in-kernel path manager's address table (MPTCP_PM_ADDR_MAX)
STALE_LOSS_CNT = 3
SYSCTLS = (("enabled", 1), ("pm_type", 0), ("stale_loss_cnt", STALE_LOSS_CNT),
           ("allow_join_initial_addr_port", 1), ("add_addr_timeout", 120))


def configure_mptcp_endpoints(rails, flags: str = "signal", subflows: int | None = None,
                              add_addr_accepted: int | None = None, flush: bool = True,
                              netns: str | None = None, sysctls=SYSCTLS,
                              run=subprocess.run) -> list[list[str]]:
    """Configure MPTCP on this host (root) as the module docstring says, and why.

    ``rails`` is a list of (addr, ifname) in rail order. The first rail carries the initial
    subflow; every further rail becomes an endpoint with ``flags`` (default ``signal``).
    ``subflows`` and ``add_addr_accepted`` default to one per further rail; ``sysctls``
    (name, value) pairs under net.mptcp. ``netns`` runs the commands inside ``ip netns
    exec``. Returns the commands run.

    The kernel's path manager holds at most MAX_ENDPOINTS addresses and opens at most 8 extra
    subflows per connection: rails beyond the first 1 + MAX_ENDPOINTS are left out of the
    MPTCP baseline (adding them fails with "too many addresses").
    """
    rails = list(rails)[:1 + MAX_ENDPOINTS]
    extra = max(1, len(rails) - 1)
    pre = ["ip", "netns", "exec", netns] if netns else []
    cmds = [pre + ["sysctl", "-q", "-w", f"net.mptcp.{k}={v}"] for k, v in sysctls]
    if flush:
        cmds.append(pre + ["ip", "mptcp", "endpoint", "flush"])
    cmds.append(pre + ["ip", "mptcp", "limits", "set",
                       "subflows", str(extra if subflows is None else subflows),
                       "add_addr_accepted",
                       str(extra if add_addr_accepted is None else add_addr_accepted)])
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
