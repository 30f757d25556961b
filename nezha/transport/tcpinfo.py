"""TCP_INFO as the health checks read it (Linux ``struct tcp_info``): what the kernel knows of
a connection's progress that the application cannot see (segments in flight and delivered,
the time since the last ACK or data segment, the RTO and its back-off)."""
from __future__ import annotations

import socket
import struct
from typing import NamedTuple, Optional


class TcpInfo(NamedTuple):
    """The TCP_INFO fields the watchdog reads (Linux ``struct tcp_info``)."""
    delivered: int       # segments delivered (tcpi_delivered)
    unacked: int         # segments in flight
    rto: float           # retransmission timeout, s (backed off, if TCP is in back-off)
    last_ack: float      # s since the last ACK arrived
    rtt: float           # smoothed RTT, s
    cwnd: int
    retrans: int         # total retransmitted segments
    backoff: int         # RTO back-off count
    last_data_recv: float  # s since the last data segment arrived (the kernel's clock)

    @property
    def rto_base(self) -> float:
        """The RTO before back-off (each back-off doubles it)."""
        return self.rto / (1 << min(self.backoff, 16))

    def for_log(self) -> dict:
        return {"rto_ms": self.rto * 1e3, "rtt_ms": self.rtt * 1e3, "cwnd": self.cwnd,
                "unacked": self.unacked, "retrans": self.retrans, "backoff": self.backoff}


def tcp_info(sock) -> Optional[TcpInfo]:
    """TCP_INFO of ``sock``, or None where the kernel does not give it (MPTCP, non-Linux)."""
    try:
        b = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None
    if len(b) < 200:
        return None
    u32 = lambda off: struct.unpack_from("I", b, off)[0]  # noqa: E731
    return TcpInfo(delivered=u32(192), unacked=u32(24), rto=u32(8) / 1e6,
                   last_ack=u32(56) / 1e3, rtt=u32(68) / 1e6, cwnd=u32(80), retrans=u32(100),
                   backoff=b[4], last_data_recv=u32(52) / 1e3)
