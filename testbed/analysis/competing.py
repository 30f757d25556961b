"""Competing traffic (``traffic`` faults) apart from the workload's.

The kernel counters see every byte a rail delivers, the competing flows' with the workload's.
Each flow's receiver counted its own payload bytes about every 100 ms (FlowRecord.received, on
the same monotonic clock), so per goodput bin:

    competing[rail] = sum over the rail's flows of received payload / factor   (L2 estimate)
    workload[rail]  = rail goodput from kernel counters - competing[rail]       (at least 0)

``factor`` is payload per Ethernet-frame byte (TCP: MSS/(MTU+14), UDP: (MTU-28)/(MTU+14)),
so the estimate counts the flow's data frames as htb and the counters do; a TCP flow's ACKs
(about 2 % more, on the sender's link) stay in the workload's line.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from testbed.analysis.sampler import Rates
from testbed.model.records import FlowRecord


def _cumulative_at(points: Sequence[tuple[float, int]], edges: np.ndarray) -> np.ndarray:
    """A flow's cumulative bytes at each edge: 0 before its first report, its last count after
    its last (it sent nothing more), linear in between."""
    if not points:
        return np.zeros(len(edges))
    t = np.array([p[0] for p in points], dtype=np.float64)
    b = np.array([p[1] for p in points], dtype=np.float64)
    return np.interp(edges, t, b, left=0.0, right=float(b[-1]))


def competing_bps(rates: Rates, flows: Sequence[FlowRecord]) -> dict[str, np.ndarray]:
    """Per rail with flows: the competing flows' delivered rate per bin, as L2 bit/s."""
    out: dict[str, np.ndarray] = {}
    for fl in flows:
        cum = _cumulative_at(fl.received, rates.edges) / max(fl.factor, 1e-9)
        bps = np.diff(cum) * 8.0 / rates.bin_s
        out[fl.rail] = out.get(fl.rail, np.zeros(len(rates))) + bps
    return out


def workload_bps(rates: Rates, competing: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per rail: kernel goodput minus the competing flows' estimate (clipped at 0)."""
    return {r: (np.clip(v - competing[r], 0.0, None) if r in competing else v)
            for r, v in rates.rail_bps.items()}


def flows_detail(flows: Sequence[FlowRecord], t0: float) -> list[dict]:
    """One row per flow for results.json: rates in Mbit/s, times relative to t0."""
    def mb(v: Optional[float]) -> Optional[float]:
        return None if v is None else round(v / 1e6, 3)
    rows = []
    for fl in flows:
        d = fl.to_dict()
        recv = fl.rate_bps("received")
        rows.append({"fault": fl.fault, "proto": fl.proto, "rail": fl.rail, "src": fl.src,
                     "dst": fl.dst, "links": fl.links,
                     "offered_mbps": mb(fl.offered_bps),
                     "sent_mbps": mb(fl.rate_bps("sent")), "received_mbps": mb(recv),
                     "received_l2_mbps": mb(None if recv is None else recv / fl.factor),
                     "t_start_rel": None if fl.t_start is None else fl.t_start - t0,
                     "t_end_rel": None if fl.t_end is None else fl.t_end - t0,
                     "sent_bytes": d["sent_bytes"], "received_bytes": d["received_bytes"],
                     "pids": [p for p in (fl.pid_send, fl.pid_recv) if p is not None]})
    return rows
