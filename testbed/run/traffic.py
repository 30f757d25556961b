"""Competing traffic (the ``traffic`` fault): real flows on one rail, in the fabric's namespaces,
so a rail can be slowed the way a shared cluster slows it (other jobs' flows), not only by a
shaper.

Which flows: a ring over the fault's hosts (``between``, in the order given; default every host
on the rail, in the topology's order): h1 -> h2, h2 -> h3, ..., hn -> h1 (two hosts: one flow
each way). Each flow goes from the sender's rail address to the receiver's, so it crosses the
sender's link upward and the receiver's link downward, and every link of the ring carries
exactly one competing flow in each direction: the rail is loaded evenly, and a ring allreduce
in the same host order meets one competitor on every hop. Each flow is offered ``value``
(frames, as a rail's bandwidth): UDP sends exactly that, TCP takes what it can up to it.

How: both ends are ``flowgen.py`` processes (standard library only), started through
``Host.popen``, the same path the workload's ranks take, when the schedule starts (the senders
wait for the fault's time on the shared monotonic clock, so the flows begin on time whatever
Python's start-up costs). Each process is recorded in the run-state file (objects of kind
``flow``) as soon as it exists; it lives in its host's namespace, so whatever removes the fabric
ends it: the teardown (which kills every process it started), ``clean`` and ``down`` (which end
every process inside a namespace before deleting it). Measured: each end appends its
cumulative payload bytes about every 100 ms to ``traffic/F<fault>-<src>-<dst>.{send,recv}.jsonl``
in the results folder; ``records()`` reads them back as ``FlowRecord``s.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.fabric import Fabric
from testbed.model.records import FlowRecord, load_jsonl
from testbed.model.scenario import Fault

FLOWGEN = Path(__file__).with_name("flowgen.py")
BASE_PORT = 20000          # below the kernel's ephemeral range (32768-60999) and Nezha's 29500+
ETH_HEADER = 14
TCP_IP_HEADERS = 52        # IPv4 20 + TCP 20 + timestamps 12
UDP_IP_HEADERS = 28


def ring(hosts: tuple[str, ...]) -> list[tuple[str, str]]:
    """(sender, receiver) pairs of a ring over ``hosts``; two hosts: one flow each way."""
    n = len(hosts)
    return [(hosts[i], hosts[(i + 1) % n]) for i in range(n)] if n >= 2 else []


def payload_factor(proto: str, mtu: int) -> float:
    """Payload bytes per byte of Ethernet frame that htb counts (no FCS on a veth)."""
    if proto == "udp":
        return (mtu - UDP_IP_HEADERS) / (mtu + ETH_HEADER)
    return (mtu - TCP_IP_HEADERS) / (mtu + ETH_HEADER)


def flow_hosts(fault: Fault, hosts: tuple[str, ...]) -> tuple[str, ...]:
    """The hosts whose flows load the fault's rail: ``between``, or every host on it."""
    return fault.between or hosts


@dataclass
class _Flow:
    fault: Fault
    src: str
    dst: str
    mtu: int
    send_out: Path
    recv_out: Path
    start_at: float
    stop_at: Optional[float]
    send_proc: object = None
    recv_proc: object = None

    @property
    def factor(self) -> float:
        return payload_factor(self.fault.proto, self.mtu)


class TrafficFlows:
    """The competing flows of a run's traffic faults: ``launch`` one fault's flows, ``stop``
    them all (the run is over), ``records`` of what they measured."""

    def __init__(self, fabric: Fabric, out_dir: Path, congestion: Optional[str] = None) -> None:
        self.fabric = fabric
        self.out_dir = Path(out_dir)
        self.congestion = congestion
        self.flows: list[_Flow] = []

    def plan(self, fault: Fault, t0: float) -> list[_Flow]:
        topo = self.fabric.topo
        rail = fault.target
        hosts = flow_hosts(fault, tuple(h for h in topo.hosts if (h, rail) in topo.links))
        start = t0 + fault.at
        stop = start + fault.duration if fault.duration else None
        mtu = min(topo.link(h, rail).mtu for h in hosts)
        return [_Flow(fault, a, b, mtu,
                      self.out_dir / f"F{fault.index}-{a}-{b}.send.jsonl",
                      self.out_dir / f"F{fault.index}-{a}-{b}.recv.jsonl", start, stop)
                for a, b in ring(hosts)]

    def _argv(self, flow: _Flow, role: str) -> list[str]:
        topo, f = self.fabric.topo, flow.fault
        port = BASE_PORT + f.index % 9000
        argv = [sys.executable, "-S", str(FLOWGEN), role, "--proto", f.proto,
                "--port", str(port), "--stop-at", repr(flow.stop_at or 0.0)]
        if role == "recv":
            return argv + ["--bind", topo.address(flow.dst, f.target), "--out", str(flow.recv_out)]
        argv += ["--bind", topo.address(flow.src, f.target), "--to",
                 topo.address(flow.dst, f.target), "--rate", str(f.value),
                 "--factor", f"{flow.factor:.6f}", "--datagram", str(flow.mtu - UDP_IP_HEADERS),
                 "--start-at", repr(flow.start_at), "--out", str(flow.send_out)]
        if self.congestion and f.proto == "tcp":
            argv += ["--congestion", self.congestion]
        return argv

    def _popen(self, host: str, argv: list[str], role: str, fault: Fault):
        h = self.fabric.hosts[host]
        with open(self.out_dir / f"F{fault.index}-{host}.{role}.log", "a") as log:
            proc = h.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        st = self.fabric.state
        if st is not None:     # recorded as soon as it exists (for people and `status`)
            st.record_object(kind="flow", ns=h.ns, pid=proc.pid, role=role, fault=fault.index)
            st.save()
        return proc

    def launch(self, fault: Fault, t0: float) -> list[_Flow]:
        """Start the fault's receivers, then its senders (which wait for the fault's time)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        flows = self.plan(fault, t0)
        for fl in flows:
            fl.recv_proc = self._popen(fl.dst, self._argv(fl, "recv"), "recv", fault)
        for fl in flows:
            fl.send_proc = self._popen(fl.src, self._argv(fl, "send"), "send", fault)
        self.flows += flows
        return flows

    def stop(self, grace: float = 2.0) -> None:
        """End every flow still running: SIGTERM (each end writes its last line), then KILL."""
        procs = [p for fl in self.flows for p in (fl.send_proc, fl.recv_proc) if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def records(self) -> list[FlowRecord]:
        out = []
        for fl in self.flows:
            sent = load_jsonl(fl.send_out)
            recv = load_jsonl(fl.recv_out)
            started = [e["t"] for e in sent if e.get("started")]
            final = [e["t"] for e in sent if e.get("final")]
            out.append(FlowRecord(
                fault=fl.fault.index, proto=fl.fault.proto, rail=fl.fault.target, src=fl.src,
                dst=fl.dst, offered_bps=float(fl.fault.value), factor=fl.factor,
                t_start=started[0] if started else None,
                t_end=final[-1] if final and started else None,
                sent=[(e["t"], int(e["bytes"])) for e in sent if "bytes" in e],
                received=[(e["t"], int(e["bytes"])) for e in recv if "bytes" in e],
                pid_send=getattr(fl.send_proc, "pid", None),
                pid_recv=getattr(fl.recv_proc, "pid", None)))
        return out

