"""The fabric: a topology made real as network namespaces, veth rails and rail switches.

The model follows Mininet's nouns: a ``Host`` (a namespace), an ``Intf`` (one end of a veth), a
``Link`` (a host's attachment to a rail, with both directions shaped) and a ``Rail`` (every link of
one rail, behind one Linux bridge in its own namespace). Faults and measurements act only through
these handles; nothing outside this module builds an interface name.

All link work goes through netlink: one synchronous socket per namespace (testbed.kernel.rtnl,
requests encoded by pyroute2). Nothing is ever added to the root namespace: each veth is created
inside its host's namespace with its peer placed straight into the switch's.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from testbed.kernel import netns, rtnl, tc
from testbed.kernel.capabilities import Capabilities, probe
from testbed.kernel.rtnl import Rtnl
from testbed.errors import FabricError
from testbed.fabric.shaper import DirectionShaper
from testbed.model.scenario import scheduled_rates
from testbed.model.spec import BRIDGE, Shape, Topology, check_capabilities
from testbed.fabric.guard import checkpoint, interrupts_at_checkpoints
from testbed.fabric.state import RunState, lock as state_lock

if TYPE_CHECKING:
    from testbed.aggregation.control import Aggregator

log = logging.getLogger(__name__)
RTAX_RTO_MIN = 13  # route metric index; TCP honours it only when the metric is locked


def _aggregation():
    """testbed.aggregation.control, imported on first use: it brings nezha and numpy (0.25 s
    of every CLI start, measured) that a fabric without aggregation rails never needs."""
    from testbed.aggregation import control
    return control


def _intf(ns: str, name: str, ipr: Rtnl) -> "Intf":
    found = ipr.link_lookup(ifname=name)
    if not found:
        raise FabricError(f"interface {name} missing in namespace {ns}")
    return Intf(ns, name, ipr, found[0])


@dataclass
class Intf:
    """One end of a veth: the namespace it lives in, its name there, and a netlink handle."""

    ns: str
    name: str
    ipr: Rtnl
    index: int = 0
    route: Optional[dict] = None    # its connected route with the topology's TCP metrics

    def set_up(self, up: bool) -> None:
        """Down or up. Taking a link down flushes its routes, and the kernel re-creates the
        connected route on up without the topology's metrics (``rto_min``): it is put back,
        or every connection made after the fault would have Linux's 200 ms minimum RTO."""
        self.ipr.link("set", index=self.index, state="up" if up else "down")
        if up and self.route is not None:
            self.ipr.route("replace", **self.route)

    def info(self) -> rtnl.LinkInfo:
        """Flags, MTU, operstate, gso_max_size of this end as the kernel has them now."""
        info = self.ipr.link_info(self.index)
        if info is None:
            raise FabricError(f"interface {self.name} missing in namespace {self.ns}")
        return info

    def operstate(self) -> str:
        return self.info().operstate

    def is_up(self) -> bool:
        return self.info().up

    def counters(self) -> dict:
        """Kernel byte/packet counters of this end (IFLA_STATS64)."""
        stats = self.ipr.get_links(self.index)[0].get_attr("IFLA_STATS64")
        return {k: stats[k] for k in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets",
                                      "rx_dropped", "tx_dropped")}


@dataclass
class Host:
    """A virtual host: one namespace, one interface per rail."""

    name: str
    ns: str
    ipr: Rtnl
    addresses: dict[str, str] = field(default_factory=dict)  # rail -> address
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        return netns.command(self.ns, argv)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        proc = netns.popen(self.ns, argv, **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], check: bool = False, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` in this host and wait, as ``subprocess.run`` does: a non-zero exit is
        in ``.returncode``, raised (CalledProcessError) only with ``check=True``. Output is
        captured as text unless told otherwise; ``timeout`` is 60 s unless given."""
        return netns.run(self.ns, argv, check=check, **kwargs)


@dataclass
class Link:
    """A host's attachment to a rail. ``host_end`` lives in the host, ``peer_end`` in the rail
    switch (or, with direct wiring, in the other host). Shaping applies in both directions."""

    name: str                       # "h2.r1"
    host: str
    rail: str
    host_end: Intf
    peer_end: Intf
    shape: Shape
    up_shaper: DirectionShaper      # host -> switch
    down_shaper: DirectionShaper    # switch -> host

    def set_state(self, up: bool, end: str = "both") -> float:
        """Link down/up at one end ("host", "switch") or both; returns when the kernel acked."""
        ends = {"host": [self.host_end], "switch": [self.peer_end],
                "both": [self.host_end, self.peer_end]}
        if end not in ends:
            raise ValueError(f"end must be host, switch or both, not {end!r}")
        for intf in ends[end]:
            intf.set_up(up)
        return time.monotonic()

    def set_shape(self, shape: Shape) -> float:
        """Change rate/loss/delay in place, both directions; read back and verified. Returns
        when the kernel acknowledged the last change (before the read-back)."""
        acked = self.stage_shape(shape)
        self.confirm_shape(shape)
        return acked

    def stage_shape(self, shape: Shape) -> float:
        """Both directions' kernel changes, not yet read back; returns when the last was
        acknowledged. ``confirm_shape`` must follow (it raises on a mismatch)."""
        self.up_shaper.stage(shape)
        return self.down_shaper.stage(shape)

    def confirm_shape(self, shape: Shape) -> None:
        """Read back both directions of a staged shape; only then is it the link's shape."""
        self.up_shaper.confirm(shape)
        self.down_shaper.confirm(shape)
        self.shape = shape

    def prepare_rates(self, rates: set[int]) -> None:
        """Pre-encode the htb changes to ``rates`` in both directions (see DirectionShaper)."""
        self.up_shaper.prepare(rates)
        self.down_shaper.prepare(rates)

    def update_shape(self, **changes) -> float:
        return self.set_shape(replace(self.shape, **changes))

    def counters(self) -> dict:
        return self.host_end.counters()

    def describe(self) -> dict:
        return {"link": self.name, "host_if": self.host_end.name, "up": self.host_end.is_up(),
                "shape": self.shape.describe(), "to_switch": self.up_shaper.describe(),
                "from_switch": self.down_shaper.describe()}


@dataclass
class Rail:
    """Every host's link on one rail; faults on a whole rail act on all of them."""

    name: str
    ns: Optional[str]              # the switch namespace (None with direct wiring)
    links: list[Link]

    def set_state(self, up: bool, end: str = "both") -> float:
        for link in self.links:
            link.set_state(up, end)
        return time.monotonic()

    def set_shape(self, shape: Shape) -> float:
        """Every link's change first, then every read-back; returns the last kernel ack."""
        acked = max((link.stage_shape(shape) for link in self.links), default=time.monotonic())
        for link in self.links:
            link.confirm_shape(shape)
        return acked

    def update_shape(self, **changes) -> float:
        for link in self.links:
            link.update_shape(**changes)
        return time.monotonic()


class Fabric:
    """Build, control and tear down the namespaces of one topology.

    Use as a context manager: the fabric is torn down on exit, on exceptions and on Ctrl-C.
    A backend (e.g. Mininet) subclasses it and overrides ``_create`` and ``_destroy`` only.
    """

    backend = "pyroute2"

    def __init__(self, topo: Topology, caps: Optional[Capabilities] = None,
                 progress: Optional[Callable[[str], None]] = None) -> None:
        self.topo = topo
        self.caps = caps or probe()
        check_capabilities(topo, self.caps)
        self.progress = progress or (lambda msg: None)
        self.state: Optional[RunState] = None
        self.hosts: dict[str, Host] = {}
        self.rails: dict[str, Rail] = {}
        self.links: dict[str, Link] = {}
        self._ipr: dict[str, Rtnl] = {}   # namespace -> netlink socket inside it
        # the job secret of this run's ranks (testbed.run.workload) and aggregation switches
        self.job_secret = secrets.token_hex(16)
        self.aggregators: dict[str, Aggregator] = {}   # rail -> running service
        self.build_seconds = 0.0
        self.attached = False

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Fabric":
        return self.build()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def build(self) -> "Fabric":
        """Create everything; on any error or interrupt, remove what was built and re-raise."""
        t0 = time.monotonic()
        with state_lock():        # the run id is chosen and its file written as one step
            self.state = RunState.new(self.topo.name, self.backend, self.topo.to_dict(),
                                      self.topo.raw)
        try:
            with interrupts_at_checkpoints():
                self._build()
                checkpoint()
        except BaseException:
            self.teardown()
            raise
        self.build_seconds = time.monotonic() - t0
        return self

    def teardown(self) -> float:
        """Delete every namespace this run recorded; returns seconds taken."""
        t0 = time.monotonic()
        for agg in self.aggregators.values():
            _aggregation().stop(agg)
        self.aggregators.clear()
        for host in self.hosts.values():
            for proc in host.processes:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        self.close()
        self._destroy()
        if self.state is not None:
            self.state.remove_all()
            self.state = None
        return time.monotonic() - t0

    def _destroy(self) -> None:
        """Backend-specific clean-up before the recorded namespaces are deleted (none here)."""

    def detach(self) -> None:
        """Leave the fabric up after this process exits (the `up` verb); `down` removes it."""
        assert self.state is not None
        self.state.detached = True
        self.state.save()
        self.close()
        self.state = None

    def close(self) -> None:
        """Release this process's netlink sockets; the fabric itself stays as it is."""
        for ipr in self._ipr.values():
            try:
                ipr.close()
            except Exception:  # a socket in a deleted namespace may already be gone
                pass
        self._ipr.clear()

    # ---------------------------------------------------------------- building
    def _namespaces(self, suffixes: list[str]) -> list[str]:
        """Record all the names (one write-ahead), then create each namespace, loopback up."""
        assert self.state is not None
        names = [self.state.ns_name(suffix) for suffix in suffixes]
        self.state.record_namespaces(names)
        for ns in names:
            checkpoint()
            netns.create(ns)
            ipr = self._open(ns)
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        return names

    def _open(self, ns: str) -> Rtnl:
        ipr = Rtnl(ns)
        self._ipr[ns] = ipr
        return ipr

    def _build(self) -> None:
        """Create the kernel objects, then bind handles to them and shape through the handles.
        Recording and creating happen under the state lock, so `clean` (which decides under it
        too) never sees a namespace before its record; shaping and the run itself do not hold
        it."""
        with state_lock():
            self._create()
            self.state.save()
        self._configure()

    def _create(self) -> None:
        """Namespaces, rail bridges and veths (a backend overrides this step only)."""
        topo = self.topo
        switches = [f"sw-{rail.name}" for rail in topo.rails] if topo.wiring == "switch" else []
        self._namespaces(list(topo.hosts) + switches)
        self.progress(f"{len(topo.hosts)} hosts")
        if topo.wiring == "switch":
            for rail in topo.rails:
                ipr = self._ipr[self.state.ns_name(f"sw-{rail.name}")]
                ipr.link("add", ifname=BRIDGE, kind="bridge", br_stp_state=0, br_forward_delay=0)
                br = ipr.link_lookup(ifname=BRIDGE)[0]
                ipr.link("set", index=br, mtu=rail.mtu, state="up")
        for (h, r), spec_link in topo.links.items():
            checkpoint()
            host_ns = self.state.ns_name(h)
            peer_ns, peer_if = self._peer_of(h, r)
            if peer_if is None:
                continue                      # direct wiring: the cable exists from the other side
            host_ipr, peer_ipr = self._ipr[host_ns], self._ipr[peer_ns]
            peer_fd = rtnl.ns_fd(peer_ns)
            try:
                host_ipr.add_veth(r, peer_if, peer_fd)
            finally:
                os.close(peer_fd)
            self.state.record_object(kind="veth", ns=host_ns, ifname=r, peer_ns=peer_ns,
                                     peer_ifname=peer_if)
            if topo.wiring == "switch":
                pi = peer_ipr.link_lookup(ifname=peer_if)[0]
                peer_ipr.link("set", index=pi, master=peer_ipr.link_lookup(ifname=BRIDGE)[0])

    def _configure(self) -> None:
        """Handles, shaping (read back), addresses, link up: the same for every backend."""
        topo = self.topo
        self._bind()
        self._set_gso()
        for link in self._cables():
            checkpoint()
            link.up_shaper.apply(link.shape, new_link=True)
            link.down_shaper.apply(link.shape, new_link=True)
        for link in self.links.values():
            spec_link = topo.link(link.host, link.rail)
            for end in (link.host_end, link.peer_end):
                end.ipr.link("set", index=end.index, mtu=spec_link.mtu)
            self._address(link.host_end, spec_link.address)
            link.set_state(True)
        self.progress(f"{len(self.links)} links shaped and addressed")
        self._wait_operational()
        self._start_aggregators()

    def _start_aggregators(self) -> None:
        """Every aggregation rail: its switch's bridge gets the rail's switch address, and the
        aggregation service starts in the switch namespace, recorded in the run state before it
        starts, then read back (PING) before the build goes on."""
        for rail in self.topo.rails:
            address = rail.switch_address
            if address is None:
                continue
            port = self.aggregation_port
            checkpoint()
            ns = self.rails[rail.name].ns
            ipr = self._ipr[ns]
            self._address(_intf(ns, BRIDGE, ipr), address)
            self.state.record_object(kind="aggregator", ns=ns, rail=rail.name,
                                     address=str(address.ip), port=port)
            self.state.save()
            self._launch_aggregator(rail)
            self.progress(f"aggregation switch of {rail.name} on "
                          f"{self.aggregators[rail.name].endpoint}")

    def _launch_aggregator(self, rail) -> float:
        """Start ``rail``'s service (its run-state record already exists) and wait until it
        answers; returns when it did."""
        aggregation = _aggregation()
        ns = self.rails[rail.name].ns
        agg = aggregation.start(rail.name, ns, str(rail.switch_address.ip),
                                self.aggregation_port, self.job_secret,
                                rail.aggregation_rate_bps,
                                self.caps.congestion_control(self.topo))
        self.aggregators[rail.name] = agg
        for obj in self.state.objects:                    # nsenter execs: the service
            if obj.get("kind") == "aggregator" and obj.get("rail") == rail.name:
                obj["pid"] = agg.proc.pid
        self.state.save()
        aggregation.wait_ready(agg)
        return time.monotonic()

    def kill_aggregator(self, rail: str, signal_name: str = "KILL") -> None:
        """Fault ``kill`` on an aggregation rail: signal its switch's service (KILL, TERM,
        INT end it; STOP freezes it: connections stay up, nothing answers)."""
        agg = self.aggregators.get(rail)
        if agg is None:
            raise FabricError(f"rail {rail} has no aggregation switch running")
        if agg.proc.poll() is None:
            agg.proc.send_signal(getattr(signal, f"SIG{signal_name}"))
        if signal_name != "STOP":
            agg.proc.wait(5.0)

    def restore_aggregator(self, rail: str) -> float:
        """The end of a rail kill: a stopped switch continues, a dead one starts again (same
        address, port and secret); returns when it answers PING."""
        agg = self.aggregators[rail]
        if agg.proc.poll() is None:
            agg.proc.send_signal(signal.SIGCONT)
            return time.monotonic()
        agg.log.close()
        spec = next(r for r in self.topo.rails if r.name == rail)
        return self._launch_aggregator(spec)

    def aggregator_health(self) -> dict[str, dict]:
        """Every aggregation rail's switch, read back now (a PING from inside its namespace):
        {rail: {endpoint, answers, keys, bytes} or {endpoint, answers: False, error}}."""
        out = {}
        for rail in self.topo.rails:
            if rail.switch_address is None:
                continue
            ip, ns = str(rail.switch_address.ip), self.state.ns_name(f"sw-{rail.name}")
            entry: dict = {"endpoint": f"{ip}:{self.aggregation_port}"}
            try:
                pong = netns.call_in(ns, _aggregation().ping, ip, self.aggregation_port)
                entry.update(answers=True, keys=pong.get("keys"), bytes=pong.get("bytes"))
            except Exception as e:   # noqa: BLE001 - reported, not raised: status describes
                entry.update(answers=False, error=str(e)[:200])
            out[rail.name] = entry
        return out

    def aggregator_env(self) -> str:
        """NEZHA_AGGREGATORS for the ranks: ``RAIL=ADDR:PORT`` per aggregation rail."""
        return ",".join(f"{r.name}={r.switch_address.ip}:{self.aggregation_port}"
                        for r in self.topo.rails if r.switch_address is not None)

    @property
    def aggregation_port(self) -> int:
        """The aggregation service's port on every aggregation rail (nezha.aggwire's)."""
        return _aggregation().PORT

    def _rail_gso(self, rail: str, scheduled: dict[str, int]) -> int:
        """gso_max_size for every interface of ``rail``: from its slowest link (tc.gso_size),
        counting the rates the fault schedule will give it (``scheduled``, per rail:
        scenario.scheduled_rates). A bucket sized for the built rate's
        skbs let a rail that a fault cut to a quarter pass 103 KB (16 ms at its new rate) at
        veth speed after every pause, and a balancer saw its small shares up to 3x cheaper
        than they were."""
        links = [self.topo.link(h, rail) for h in self.topo.hosts]
        rates = [lk.shape.rate_bps for lk in links if lk.shape.rate_bps]
        rates += [scheduled[rail]] if rail in scheduled else []
        return tc.gso_size(min(rates) if rates else None, max(lk.mtu for lk in links))

    def _set_gso(self) -> None:
        """Cap the GSO skbs on every end of every link at the rail's size, read back, so htb's
        buckets can be small (testbed.kernel.tc). A kernel that keeps 64 KiB gets buckets for
        64 KiB skbs (what the shapers then assume), never a bucket too small for its skbs."""
        for link in self.links.values():
            gso = link.up_shaper.gso
            if gso >= tc.GSO_MAX_SIZE:
                continue
            for end in (link.host_end, link.peer_end):
                try:
                    end.ipr.link("set", index=end.index, gso_max_size=gso)
                    got = end.info().gso_max_size
                except Exception:   # noqa: BLE001 - an old kernel: keep the default, say so
                    got = None
                if got != gso:
                    self.progress(f"{link.name}: the kernel keeps gso_max_size {got} (asked "
                                  f"{gso}): htb buckets sized for 64 KiB skbs")
                    link.up_shaper.gso = link.down_shaper.gso = tc.GSO_MAX_SIZE

    def _peer_of(self, host: str, rail: str) -> tuple[str, Optional[str]]:
        """Where the other end of a host's rail veth lives: (namespace, name there). With direct
        wiring the second host's end is the first host's peer, so it reports no name to create."""
        if self.topo.wiring == "switch":
            return self.state.ns_name(f"sw-{rail}"), host
        first, second = self.topo.hosts
        if host == first:
            return self.state.ns_name(second), rail
        return self.state.ns_name(first), None

    def _bind(self) -> None:
        """Make Host / Intf / Link / Rail handles for objects that exist (built or attached)."""
        topo = self.topo
        for h in topo.hosts:
            ns = self.state.ns_name(h)
            self.hosts[h] = Host(h, ns, self._ipr[ns],
                                 {r.name: topo.address(h, r.name) for r in topo.rails})
        scheduled = scheduled_rates(topo)
        for rail in topo.rails:
            links = []
            gso = self._rail_gso(rail.name, scheduled)
            for h in topo.hosts:
                host = self.hosts[h]
                peer_ns, peer_if = self._peer_of(h, rail.name)
                peer_if = peer_if or rail.name
                host_end = _intf(host.ns, rail.name, host.ipr)
                peer_end = _intf(peer_ns, peer_if, self._ipr[peer_ns])
                mtu = topo.link(h, rail.name).mtu
                up = DirectionShaper(host.ipr, host.ns, rail.name, peer_end.ipr, peer_ns, peer_if,
                                     self.caps, mtu=mtu, name=f"{h}.{rail.name} (to switch)",
                                     gso=gso)
                down = DirectionShaper(peer_end.ipr, peer_ns, peer_if, host.ipr, host.ns,
                                       rail.name, self.caps, mtu=mtu,
                                       name=f"{h}.{rail.name} (from switch)", gso=gso)
                link = Link(f"{h}.{rail.name}", h, rail.name, host_end, peer_end,
                            topo.link(h, rail.name).shape, up, down)
                self.links[link.name] = link
                links.append(link)
            if topo.wiring == "direct":   # one cable, seen from both hosts: share its shapers
                second = links[1]
                second.up_shaper, second.down_shaper = links[0].down_shaper, links[0].up_shaper
            sw = self.state.ns_name(f"sw-{rail.name}") if topo.wiring == "switch" else None
            self.rails[rail.name] = Rail(rail.name, sw, links)

    def _cables(self) -> list["Link"]:
        """One link per veth: with direct wiring both hosts' links share a cable."""
        if self.topo.wiring == "switch":
            return list(self.links.values())
        return [rail.links[0] for rail in self.rails.values()]

    @classmethod
    def attach(cls, state: RunState, caps: Optional[Capabilities] = None) -> "Fabric":
        """Handles to a fabric that another process built and left up (`up`, then `status`)."""
        from testbed.model.spec import parse
        fab = cls(parse(state.topology_doc, default_name=state.name), caps)
        fab.state = state
        for ns in state.namespaces:
            fab._open(ns)
        fab._bind()
        fab.attached = True
        return fab

    def _wait_operational(self, timeout: float = 5.0) -> None:
        """Return once every veth end reports carrier (operstate UP): a link set up a moment ago
        may still drop the first frames, which would show as phantom loss in a measurement."""
        deadline = time.monotonic() + timeout
        pending = [e for l in self.links.values() for e in (l.host_end, l.peer_end)]
        while pending:
            pending = [e for e in pending if e.operstate() != "UP"]
            if pending and time.monotonic() > deadline:
                raise FabricError("links not operational after %.0f s: %s" % (
                    timeout, ", ".join(f"{e.ns}/{e.name}" for e in pending[:5])))
            if pending:
                time.sleep(0.005)

    def _address(self, intf: Intf, address: ipaddress.IPv4Interface) -> None:
        ip, subnet = str(address.ip), address.network
        intf.ipr.add_address(intf.index, ip, subnet.prefixlen)
        rto = self.topo.tcp.get("rto_min_s")
        if rto:
            intf.ipr.link("set", index=intf.index, state="up")
            intf.route = dict(dst=str(subnet), oif=intf.index, prefsrc=ip, scope="link",
                              proto="kernel", metrics={"RTAX_LOCK": 1 << RTAX_RTO_MIN,
                                                       "RTAX_RTO_MIN": max(1, int(rto * 1000))})
            intf.ipr.route("replace", **intf.route)

    # ---------------------------------------------------------------- lookup
    def target(self, name: str) -> Link | Rail | Host:
        """Resolve a fault target: 'h2.r1' (a link), 'r1' (a rail) or 'h2' (a host)."""
        if name in self.links:
            return self.links[name]
        if name in self.rails:
            return self.rails[name]
        if name in self.hosts:
            return self.hosts[name]
        raise KeyError(name)

    def host_links(self, host: str) -> list[Link]:
        return [l for l in self.links.values() if l.host == host]

    def status(self) -> dict:
        return {"name": self.topo.name, "run_id": self.state.run_id if self.state else None,
                "hosts": {h.name: {"namespace": h.ns, "addresses": h.addresses}
                          for h in self.hosts.values()},
                "links": [l.describe() for l in self.links.values()],
                "aggregators": self.aggregator_health()}
