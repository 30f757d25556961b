"""Traffic-control messages: the qdisc parameters the testbed asks for, and their decoding.

Pure encode/decode around pyroute2's ``tc`` (rates in bytes/s as pyroute2 takes them, netem
times in microseconds, dumped times in psched ticks), plus two thin netlink helpers. Which tree
to build on which interface is the shaper's business (testbed.fabric.shaper).

Choices (measured on veth with GSO/TSO on, iperf3 TCP, see tests/test_shaping.py):
  * htb burst = cburst = max(4 ms at the rate, 2 x (GSO skb + MTU + 14)). veth passes GSO
    skbs of up to the interface's gso_max_size; a bucket smaller than two of them loses credit
    whenever the queue drains for a moment and the measured rate falls 3-8 % short at 500
    Mbit/s. GSO stays on: turning it off made htb *less* accurate (and costs CPU).
  * gso_max_size of every interface on a rail = 2 ms at the rail's slowest link rate, between
    MTU + 14 and 64 KiB (``gso_size``). With 64 KiB skbs everywhere the bucket was at least
    134 KB: 107 ms at 10 Mbit/s, so a rail that idled a moment passed its next 134 KB at veth
    speed, a burst no real 10 Mbit/s link has. A balancer that measures per-message rates saw
    such rails 2-4x faster than they are. The slowest rate includes the schedule's rate
    faults (testbed.model.scenario.scheduled_rates): a rail a fault slows bursts no more
    than one built at the slowed rate. With 2.5 KB skbs the bucket at 10 Mbit/s is 8 KB
    (6.4 ms); iperf3 over 6 s measured 1.00x the TCP bound at 10, 25 and 50 Mbit/s, 0.994x at
    100 and 0.995x at 200 Mbit/s (64 KiB skbs: 1.018x at 10 Mbit/s, the bucket's burst).
  * quantum = 1 ms worth of bytes at the rate, clamped to [MTU + 14, 200000] (one class only,
    so it merely avoids htb's "quantum is big" warning).
  * leaf pfifo, limit = max(20, 10 ms at the rate in MTU-sized packets): drop-tail, no AQM,
    so the only losses are the ones asked for (fq_codel measured the same rate but drops by
    itself under a standing queue).
  * htb rates count L2 bytes (Ethernet header included), like a real link: TCP goodput at MTU
    1500 is at most 1448/1514 = 95.6 % of the set rate.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from pyroute2.netlink.rtnl.tcmsg import common as _tc_common

from testbed.model.spec import Shape

TC_H_ROOT = 0xFFFFFFFF
HTB_HANDLE = 0x10000      # 1:
CLASS_HANDLE = 0x10010    # 1:10
LEAF_HANDLE = 0x100000    # 10:

ETH_HLEN = 14
GSO_MAX_SIZE = 65536
GSO_TIME_S = 0.002
BURST_TIME_S = 0.004
QUANTUM_TIME_S = 0.001
QUEUE_TIME_S = 0.010
MIN_QUEUE_PKTS = 20
UNSHAPED_RATE_BPS = 10_000_000_000   # what veth pushes unshaped; sizes netem's queue then
U32_MAX = 0xFFFFFFFF


def handle_text(h: int) -> str:
    """``1:10``, ``10:``: a tc handle as tc(8) prints it."""
    return f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


# ---- parameter choices (pure, unit-tested) --------------------------------------------------
def gso_size(rate_bps: Optional[int], mtu: int = 1500) -> int:
    """gso_max_size for the interfaces of a rail whose slowest link runs at ``rate_bps``:
    2 ms at that rate, at least one frame, at most 64 KiB (unshaped: 64 KiB)."""
    if not rate_bps:
        return GSO_MAX_SIZE
    return int(min(GSO_MAX_SIZE, max(mtu + ETH_HLEN, math.ceil(rate_bps / 8 * GSO_TIME_S))))


def htb_burst(rate_bps: int, mtu: int = 1500, gso: int = GSO_MAX_SIZE) -> int:
    """Bytes of htb bucket: 4 ms at the rate, but never less than two full GSO skbs (``gso``:
    the largest skb that reaches the queue)."""
    return max(math.ceil(rate_bps / 8 * BURST_TIME_S), 2 * (gso + mtu + ETH_HLEN))


def htb_quantum(rate_bps: int, mtu: int = 1500) -> int:
    return int(min(max(rate_bps / 8 * QUANTUM_TIME_S, mtu + ETH_HLEN), 200_000))


def fifo_limit(rate_bps: Optional[int], mtu: int = 1500) -> int:
    """pfifo limit in packets: 10 ms of the rate in MTU-sized frames, at least 20. A shallow
    buffer, like a datacenter switch port: a deep one inflates the RTT under load (and with it
    TCP's retransmission timeout), which is what bounds how fast a black hole can be told
    from an ordinary loss."""
    rate = rate_bps or UNSHAPED_RATE_BPS
    return max(MIN_QUEUE_PKTS, math.ceil(rate / 8 * QUEUE_TIME_S / (mtu + ETH_HLEN)))


def netem_limit(shape: Shape, mtu: int = 1500) -> int:
    """netem's queue also holds htb's backlog: the fifo's limit plus twice what the rate puts
    in flight during delay + 4 x jitter, so netem never drops on its own."""
    rate = shape.rate_bps or UNSHAPED_RATE_BPS
    in_flight = rate / 8 * (shape.delay_s + 4 * shape.jitter_s) / (mtu + ETH_HLEN)
    return min(U32_MAX, max(MIN_QUEUE_PKTS, fifo_limit(shape.rate_bps, mtu)
                            + math.ceil(2 * in_flight)))


def htb_class_kwargs(rate_bps: int, mtu: int = 1500, gso: int = GSO_MAX_SIZE) -> dict:
    """pyroute2 keyword arguments for class 1:10 (rates in bytes/s as pyroute2 takes ints)."""
    rate = max(1, rate_bps // 8)
    burst = htb_burst(rate_bps, mtu, gso)
    return {"parent": HTB_HANDLE, "rate": rate, "ceil": rate, "burst": burst, "cburst": burst,
            "quantum": htb_quantum(rate_bps, mtu), "mtu": mtu + ETH_HLEN}


def netem_kwargs(shape: Shape, mtu: int = 1500) -> dict:
    """pyroute2 keyword arguments for netem: delay/jitter in microseconds, loss in percent."""
    return {"delay": int(round(shape.delay_s * 1e6)), "jitter": int(round(shape.jitter_s * 1e6)),
            "loss": shape.loss * 100.0, "limit": netem_limit(shape, mtu)}


# ---- decoding dumps -------------------------------------------------------------------------
def decode_netem(opts) -> tuple[float, float, float]:
    """(loss, delay_s, jitter_s) from a dumped netem TCA_OPTIONS (times in psched ticks)."""
    tick_us = _tc_common.tick_in_usec
    delay_s = opts["delay"] / tick_us / 1e6
    jitter_s = opts["jitter"] / tick_us / 1e6
    loss = opts["loss"] / U32_MAX
    return loss, delay_s, jitter_s


def decode_htb_class(cls) -> dict[str, Any]:
    """rate_bps, ceil_bps, burst (bytes), quantum and stats ({bytes, packets} or None) of a
    dumped htb class (the 64-bit rates where the kernel sent them)."""
    opts = cls.get_attr("TCA_OPTIONS")
    parms = opts.get_attr("TCA_HTB_PARMS")
    rate_Bps = opts.get_attr("TCA_HTB_RATE64") or parms["rate"]
    ceil_Bps = opts.get_attr("TCA_HTB_CEIL64") or parms["ceil"]
    stats = cls.get_attr("TCA_STATS2")
    basic = stats.get_attr("TCA_STATS_BASIC") if stats is not None else None
    return {"rate_bps": rate_Bps * 8, "ceil_bps": ceil_Bps * 8,
            "burst": int(round(parms["buffer"] / _tc_common.tick_in_usec / 1e6 * rate_Bps)),
            "quantum": parms["quantum"],
            "stats": {"bytes": basic["bytes"], "packets": basic["packets"]} if basic else None}


# ---- netlink ----------------------------------------------------------------------------------
def try_qdisc(ipr, idx: int, kind: str, **kw) -> Optional[Exception]:
    """Add ``kind`` as root qdisc of ``idx`` and remove it again: None if it worked, else the
    error (a NetlinkError with code 2, ENOENT, if the kind is unknown to this kernel)."""
    try:
        ipr.tc("add", kind, index=idx, handle=HTB_HANDLE, **kw)
    except Exception as e:
        return e
    del_root_qdisc(ipr, idx)
    return None


def del_root_qdisc(ipr, idx: int) -> bool:
    """Delete whatever root qdisc ``idx`` has; False if there was none to delete."""
    try:
        ipr.tc("del", index=idx, parent=TC_H_ROOT)
        return True
    except Exception:
        return False
