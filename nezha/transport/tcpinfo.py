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
    mss: int = 0           # sender's MSS, bytes (tcpi_snd_mss)
    delivery_rate: float = 0.0   # bytes/s, the kernel's last delivery-rate sample

    @property
    def rto_base(self) -> float:
        """The RTO before back-off (each back-off doubles it)."""
        return self.rto / (1 << min(self.backoff, 16))

    def for_log(self) -> dict:
        return {"rto_ms": self.rto * 1e3, "rtt_ms": self.rtt * 1e3, "cwnd": self.cwnd,
                "unacked": self.unacked, "retrans": self.retrans, "backoff": self.backoff}


# the fields at their offsets in struct tcp_info: tcpi_backoff (4), rto (8), snd_mss (16),
# unacked (24), last_data_recv (52), last_ack_recv (56), rtt (68), snd_cwnd (80),
# total_retrans (100), delivery_rate (160, u64), delivered (192)
_FIELDS = struct.Struct("=4xB3xI4xI4xI24xII8xI8xI16xI56xQ24xI")


def tcp_info(sock) -> Optional[TcpInfo]:
    """TCP_INFO of ``sock``, or None where the kernel does not give it (MPTCP, non-Linux)."""
    try:
        b = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None
    if len(b) < 200:
        return None
    (backoff, rto, mss, unacked, last_data_recv, last_ack, rtt, cwnd, retrans, rate,
     delivered) = _FIELDS.unpack_from(b)
    return TcpInfo(delivered=delivered, unacked=unacked, rto=rto / 1e6, last_ack=last_ack / 1e3,
                   rtt=rtt / 1e6, cwnd=cwnd, retrans=retrans, backoff=backoff,
                   last_data_recv=last_data_recv / 1e3, mss=mss, delivery_rate=float(rate))
