"""The fault schedule: fires faults at their times on the run's monotonic clock, through the
fabric's handles only, and undoes each one exactly at its end.

Overlapping faults on one link stack: each active fault is a layer over the link's configured
shape (rate: the lowest active rate; loss: independent drops combine as 1-(1-a)(1-b); delay: the
latest), and a link is down while any active fault holds it down. A fault's end removes its own
layer and re-applies what is left, so it restores exactly what it changed.
"""
from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

from testbed.fabric import Fabric, Link
from testbed.kernel import netns
from testbed.model.records import SHAPING, FaultRecord, FlowRecord, Toggle
from testbed.model.scenario import Fault
from testbed.model.spec import Shape
from testbed.run.traffic import TrafficFlows, flow_hosts

log = logging.getLogger(__name__)
SPIN_S = 0.005     # the last 5 ms before a step are spun, not slept: a sleeping thread wakes
                   # 0.1-several ms late on a loaded machine, a spinning one within microseconds


class _LinkLayers:
    """The active faults on one link, and the shape/state they add up to."""

    def __init__(self, link: Link, base: Shape) -> None:
        self.link = link
        self.base = base
        self.shape_layers: dict[int, dict] = {}
        self.down_holders: dict[int, str] = {}   # fault index -> end held down
        self.staged: Optional[Shape] = None      # set in the kernel, not yet read back

    def effective(self) -> Shape:
        shape = self.base
        keep = 1.0 - shape.loss
        for layer in self.shape_layers.values():
            if "rate_bps" in layer:
                rate = layer["rate_bps"]
                shape = replace(shape, rate_bps=rate if shape.rate_bps is None
                                else min(rate, shape.rate_bps))
            if "loss" in layer:
                keep *= 1.0 - layer["loss"]
            if "delay_s" in layer:
                shape = replace(shape, delay_s=layer["delay_s"],
                                jitter_s=layer.get("jitter_s", 0.0))
        return replace(shape, loss=round(1.0 - keep, 9))

    def push_shape(self, key: int, layer: dict) -> float:
        """Add a layer; the kernel has the new shape when this returns (its ack time), the
        read-back is ``confirm``'s."""
        self.shape_layers[key] = layer
        return self._stage()

    def pop_shape(self, key: int) -> float:
        self.shape_layers.pop(key, None)
        return self._stage()

    def _stage(self) -> float:
        self.staged = self.effective()
        return self.link.stage_shape(self.staged)

    def confirm(self) -> None:
        """Read back a staged shape (raises on a mismatch); nothing staged: nothing to do."""
        staged, self.staged = self.staged, None
        if staged is not None:
            self.link.confirm_shape(staged)

    def hold_down(self, key: int, end: str) -> float:
        self.down_holders[key] = end
        return self.link.set_state(False, end)

    def release(self, key: int) -> float:
        end = self.down_holders.pop(key, None)
        if end is None:
            return time.monotonic()
        still = set(self.down_holders.values())
        if "both" in still or end in still:
            return time.monotonic()
        return self.link.set_state(True, end)


FAULT_NICE = -10   # the fault thread's nice value (root only; else it keeps the default)


def _raise_priority() -> None:
    """Give the calling thread (only it: Linux nice values are per thread) and the netns
    worker a higher CPU share: on a machine loaded by other work a nice-0 thread that wakes for a fault waits
    for a time slice, measured at up to 20 ms late with a load average of 9 on 2 cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FAULT_NICE)
        netns.set_lane_priority(FAULT_NICE)     # nft loss changes run on that worker
    except OSError:      # not root: the schedule still runs, only with ordinary priority
        pass


class FaultInjector:
    """Run a fault schedule against a fabric in a background thread."""

    def __init__(self, fabric: Fabric, faults: tuple[Fault, ...],
                 kill: Optional[Callable[[str, str], None]] = None,
                 on_event: Optional[Callable[[dict], None]] = None,
                 traffic: Optional[TrafficFlows] = None) -> None:
        self.fabric = fabric
        self.faults = faults
        self.kill = kill
        self.traffic = traffic
        self.flow_records: list[FlowRecord] = []
        self.on_event = on_event or (lambda e: None)
        self.layers = {name: _LinkLayers(link, link.shape) for name, link in fabric.links.items()}
        self.records: list[FaultRecord] = []
        self.t0 = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._active: dict[int, Fault] = {}
        self.faults_by_index = {f.index: f for f in faults}
        self.errors: list[str] = []
        # (fault index, step, seconds from the scheduled time to the kernel's last ack)
        self.lateness: list[tuple[int, str, float]] = []

    # ---------------------------------------------------------------- targets
    def links_of(self, fault: Fault) -> list[Link]:
        target = self.fabric.target(fault.target)
        if fault.target_kind == "link":
            return [target]
        if fault.target_kind == "rail" and fault.action == "traffic":
            hosts = flow_hosts(fault, tuple(l.host for l in target.links))
            return [l for l in target.links if l.host in hosts]
        if fault.target_kind == "rail":
            return list(target.links)
        return self.fabric.host_links(fault.target)

    # ---------------------------------------------------------------- schedule
    def _plan(self) -> list[tuple[float, int, str, Fault]]:
        """(offset, order, step, fault): the steps a schedule expands to, in time order."""
        steps: list[tuple[float, int, str, Fault]] = []
        n = 0
        for f in self.faults:
            steps.append((f.at, n, "start", f)); n += 1
            if f.action == "flap":
                half = f.period / 2
                k, t = 1, f.at + half
                while t < f.at + f.duration - 1e-9:
                    steps.append((t, n, "flap-up" if k % 2 else "flap-down", f)); n += 1
                    k += 1
                    t = f.at + k * half
                steps.append((f.at + f.duration, n, "end", f)); n += 1
            elif f.duration is not None:
                steps.append((f.at + f.duration, n, "end", f)); n += 1
        heapq.heapify(steps)
        return steps

    def start(self, t0: Optional[float] = None) -> None:
        """Start the schedule's clock at ``t0`` (now by default); returns once the thread is
        ready to fire, so a fault at 0 s is not late."""
        ready = threading.Event()

        def body():
            _raise_priority()
            self._warm_up()
            ready.set()
            self._run()
        self.t0 = time.monotonic() if t0 is None else t0
        self._thread = threading.Thread(target=body, name="faults", daemon=True)
        self._thread.start()
        ready.wait(timeout=10)

    def _warm_up(self) -> None:
        """Touch every netlink socket a fault will use, from this thread: pyroute2 pays ~10 ms
        the first time a thread uses a socket, which would otherwise land inside a fault.
        A traffic fault's flows are launched here: their senders wait for the fault's time.
        The htb changes of every rate in the schedule are encoded here too (pyroute2 takes
        ~1 ms per rate), and each link's ioctl socket is opened (offloads change with loss)."""
        rates = {f.value for f in self.faults if f.action == "rate"}
        for f in self.faults:
            if f.action == "traffic" and self.traffic is not None:
                try:
                    self.traffic.launch(f, self.t0)
                except Exception as e:  # no flow is a failed run, not a crash
                    self.errors.append(f"fault {f.index} ({f.label}): flows not started: {e}")
            if f.action == "kill":
                continue
            for link in self.links_of(f):
                link.host_end.operstate()
                link.peer_end.operstate()
                if f.action in SHAPING and hasattr(link, "prepare_rates"):
                    base = {link.shape.rate_bps} if link.shape.rate_bps else set()
                    link.prepare_rates(rates | base)
                    link.up_shaper.offloads()
                    link.down_shaper.offloads()

    def _run(self) -> None:
        steps = self._plan()
        while steps and not self._stop.is_set():
            offset, _, step, fault = steps[0]
            due = self.t0 + offset
            delay = due - time.monotonic()
            if delay > SPIN_S:
                if self._stop.wait(min(delay - SPIN_S, 0.05)):
                    break
                continue
            while time.monotonic() < due:
                time.sleep(0)          # yields the GIL and the CPU, wakes at once
            heapq.heappop(steps)
            try:
                with self._lock:
                    self._step(step, fault, due)
            except Exception as e:  # a fault that could not be applied is a failed run
                msg = f"fault {fault.index} ({fault.label}) {step} failed: {e}"
                log.error(msg)
                self.errors.append(msg)

    def timing(self) -> Optional[str]:
        """One line for people: how late the schedule's steps took effect (the kernel's last
        acknowledgement against the scheduled time), median and worst; None without steps."""
        if not self.lateness:
            return None
        late = sorted(x for _, _, x in self.lateness)
        worst = max(self.lateness, key=lambda e: e[2])
        label = self.faults_by_index[worst[0]].label
        return (f"fault changes took effect {late[len(late) // 2] * 1e3:.1f} ms (median), "
                f"{worst[2] * 1e3:.1f} ms (worst: {label}, {worst[1]}) after their scheduled "
                f"times ({len(late)} changes)")

    def stop(self) -> None:
        """Stop firing and undo every fault still active (the run is over)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        with self._lock:
            for fault in list(self._active.values()):
                try:
                    self._step("end", fault)
                except Exception as e:  # the fabric may be going away; report, don't mask
                    self.errors.append(f"undo of fault {fault.index} failed: {e}")
        if self.traffic is not None and self.traffic.flows:
            self.traffic.stop()
            self.flow_records = self.traffic.records()
            self._flow_times()

    def _flow_times(self) -> None:
        """A traffic fault took effect when its last sender began, and ended when its last
        sender stopped (as the flows recorded them, on the same clock)."""
        for rec in self.records:
            mine = [fl for fl in self.flow_records if fl.fault == rec.index]
            if rec.action != "traffic" or not mine:
                continue
            starts = [fl.t_start for fl in mine if fl.t_start is not None]
            ends = [fl.t_end for fl in mine if fl.t_end is not None]
            if len(starts) < len(mine):
                self.errors.append(f"fault {rec.index} ({rec.label}): "
                                   f"{len(mine) - len(starts)} of {len(mine)} flows never sent")
            if starts:
                rec.t_applied = max(starts)
            if ends and rec.t_end is not None:
                rec.t_end = max(ends)

    # ---------------------------------------------------------------- one step
    def _record(self, fault: Fault) -> FaultRecord:
        for r in self.records:
            if r.index == fault.index:
                return r
        links = self.links_of(fault) if fault.action != "kill" else []
        rails = sorted({l.rail for l in links}) if fault.action != "kill" or \
            fault.target_kind != "rail" else [fault.target]
        rec = FaultRecord(index=fault.index, action=fault.action, target=fault.target,
                          target_kind=fault.target_kind, label=fault.label, at=fault.at,
                          duration=fault.duration, rails=rails,
                          links=[l.name for l in links])
        self.records.append(rec)
        return rec

    def _step(self, step: str, f: Fault, due: Optional[float] = None) -> None:
        rec = self._record(f)
        t_issued = time.monotonic()
        links = [self.layers[l.name] for l in self.links_of(f)] if f.action != "kill" else []
        if step == "start":
            try:
                t = self._start(f, links, t_issued)
            except BaseException:         # what was staged before the failure is not
                self._forget_staged(links)  # confirmed by a later step
                raise
            self._confirm(links)
            rec.t_issued, rec.t_applied = t_issued, t
        elif step in ("flap-down", "flap-up"):
            if step == "flap-down":
                t = max(layer.hold_down(f.index, f.end) for layer in links)
            else:
                t = max(layer.release(f.index) for layer in links)
            rec.toggles.append(Toggle(t, "down" if step == "flap-down" else "up"))
        elif step == "end":
            if f.index not in self._active:
                return
            try:
                t = self._end(f, links, t_issued)
            except BaseException:
                self._forget_staged(links)
                raise
            self._confirm(links)
            rec.t_end = t
        else:
            t = t_issued
        if due is not None and f.action != "traffic":   # a traffic fault's time is its flows'
            self.lateness.append((f.index, step, t - due))
        self.on_event({"t": t, "event": f"fault_{step}", "fault": f.index, "label": f.label})

    @staticmethod
    def _forget_staged(links: list[_LinkLayers]) -> None:
        for layer in links:
            layer.staged = None

    @staticmethod
    def _confirm(links: list[_LinkLayers]) -> None:
        """Read back every shape a step staged, after the whole step is in the kernel: its
        time is the last acknowledgement, and a mismatch still fails the step."""
        try:
            for layer in links:
                layer.confirm()
        finally:                          # a failed read-back is not left for the next step
            FaultInjector._forget_staged(links)

    def _start(self, f: Fault, links: list[_LinkLayers], t: float) -> float:
        """Apply a fault; returns when its last change was acknowledged."""
        key = f.index
        self._active[key] = f
        if f.action in ("link-down", "flap"):
            t = max(layer.hold_down(key, f.end) for layer in links)
        elif f.action == "link-up":
            t = self._link_up(f, links, t)
        elif f.action == "rate":
            t = max(layer.push_shape(key, {"rate_bps": f.value}) for layer in links)
        elif f.action == "loss":
            t = max(layer.push_shape(key, {"loss": f.value}) for layer in links)
        elif f.action == "blackhole":
            t = max(layer.push_shape(key, {"loss": 1.0}) for layer in links)
        elif f.action == "delay":
            t = max(layer.push_shape(key, {"delay_s": f.value, "jitter_s": f.jitter})
                    for layer in links)
        elif f.action == "traffic":
            if self.traffic is None:
                raise RuntimeError("no traffic launcher for competing flows")
            t = time.monotonic()      # the senders start at this moment on their own
        elif f.action == "kill" and f.target_kind == "rail":
            self.fabric.kill_aggregator(f.target, f.signal)    # its switch; ``for``: back
            t = time.monotonic()
            if f.duration is None:
                self._active.pop(key, None)
        elif f.action == "kill":
            if self.kill is None:
                raise RuntimeError("no workload process to kill")
            self.kill(f.target, f.signal)
            t = time.monotonic()
            self._active.pop(key, None)
        return t

    def _link_up(self, f: Fault, links: list[_LinkLayers], t: float) -> float:
        """An explicit link-up ends every down that holds the link; a link-down without
        ``for`` ends here (its record gets this t_end)."""
        ended: set[int] = set()
        for layer in links:
            for holder in list(layer.down_holders):
                layer.release(holder)
                ended.add(holder)
        t = max((layer.link.set_state(True, f.end) for layer in links), default=t)
        self._active.pop(f.index, None)
        for holder in ended:
            if holder in self._active and self._active[holder].duration is None:
                self._active.pop(holder)
                self._record(self.faults_by_index[holder]).t_end = t
        return t

    def _end(self, f: Fault, links: list[_LinkLayers], t: float) -> float:
        """Undo a fault's own layer; returns when that was acknowledged."""
        self._active.pop(f.index)
        if f.action in ("link-down", "flap"):
            t = max(layer.release(f.index) for layer in links)
        elif f.action == "kill":
            t = self.fabric.restore_aggregator(f.target)     # answers PING again
        elif f.action in SHAPING:
            t = max(layer.pop_shape(f.index) for layer in links)
        return t
