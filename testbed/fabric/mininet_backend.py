"""The Mininet backend: the same fabric, built with Mininet's API (hosts, switches, links).

``MininetFabric`` overrides only ``_create`` and ``_destroy``; everything after the kernel
objects exist (handles, shaping read back from the kernel, addresses, waiting for carrier) is
the shared ``Fabric._configure``. So faults, measurements, captures and the shell work on a
Mininet fabric unchanged, and a user who prefers Mininet's CLI gets it (``mininet_net()``).

How it maps onto our model
--------------------------
* Each topology host is a Mininet ``Host`` (its own network namespace, ``ip=None``: addresses
  are ours). Each rail is one ``RailBridge`` (a ``LinuxBridge`` whose bridge is called ``br0``,
  STP off, forward delay 0), always in its own namespace (``inNamespace=True``): we never build
  anything in the root namespace. Mininet's ``makeIntfPair`` creates the veth inside node1 with
  the peer moved straight into node2's namespace, so with both nodes namespaced nothing touches
  the root. (``Mininet(inNamespace=True)`` is deliberately NOT used: it builds a control network
  in the root namespace.)
* Links are ``addLink(host, switch, intfName1=<rail>, intfName2=<host>)``: the host side is named
  after the rail and the switch side after the host, exactly like the pyroute2 backend. With
  direct wiring the two hosts are linked to each other, both ends named after the rail.
* Mininet's namespaces are anonymous (held by the node's shell). We give each a name, the one
  the pyroute2 backend would use, ``nzt-<runid>-<host>`` / ``nzt-<runid>-sw-<rail>``, by
  bind-mounting ``/proc/PID/ns/net`` onto ``/var/run/netns/NAME`` (what ``ip netns attach``
  does). The name is recorded in the run-state file first (write-ahead), so ``clean`` removes a
  killed run's namespaces (and the Mininet shells inside them) like any other.
* ``Mininet.init()`` (``fixLimits``: raises root-namespace sysctls and rlimits) is skipped: a
  test fabric needs none of it and must not change the machine.

Why shaping is ours and not TCLink's
------------------------------------
Links are plain ``Link``, never ``TCLink``. TCLink configures tc through ``tc`` commands and
parses nothing back: on a kernel without ``sch_netem`` (like ours) it silently drops the
loss/delay settings and still reports the link as shaped, so a measurement would be judged
against a shape that was never applied. Our ``DirectionShaper`` (testbed/fabric/shaper.py) applies
rate with htb/tbf, loss with netem or nftables, reads every setting back from the kernel and
refuses what it cannot honour. Both backends therefore shape identically and honestly, and a
result never depends on which backend built the fabric.
"""
from __future__ import annotations

import logging

from testbed.kernel import netns
from testbed.errors import FabricError
from testbed.fabric.fabric import BRIDGE, Fabric
from testbed.fabric.guard import checkpoint
from testbed.model.spec import Topology

log = logging.getLogger(__name__)

def _mininet():
    try:
        from mininet.net import Mininet
        from mininet.nodelib import LinuxBridge
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise FabricError(f"the mininet backend needs the mininet Python package: {e}") from e
    return Mininet, LinuxBridge


def _rail_bridge_class():
    _, LinuxBridge = _mininet()

    class RailBridge(LinuxBridge):
        """A Mininet LinuxBridge whose bridge is ``br0`` inside the switch's own namespace (the
        name every rail switch has in this testbed), enslaving all of the switch's ports."""

        @classmethod
        def setup(cls):
            # LinuxBridge.setup also reads the ROOT namespace's bridge-nf-call sysctls and warns;
            # our bridges live in their own namespaces, where no firewall rules exist.
            from mininet.moduledeps import pathCheck
            pathCheck("brctl", moduleName="bridge-utils")

        def start(self, _controllers):
            self.cmd("brctl delbr", BRIDGE)
            self.cmd("brctl addbr", BRIDGE)
            self.cmd("brctl stp", BRIDGE, "off")
            self.cmd("brctl setfd", BRIDGE, "0")
            for intf in self.intfList():
                if intf.name != "lo":
                    self.cmd("brctl addif", BRIDGE, intf.name)
            self.cmd("ip link set", BRIDGE, "up")

        def connected(self):
            return True

        def stop(self, deleteIntfs=True):
            self.cmd("ip link set", BRIDGE, "down")
            self.cmd("brctl delbr", BRIDGE)
            # LinuxBridge.stop would delete a bridge named after the switch: skip to Switch.stop
            super(LinuxBridge, self).stop(deleteIntfs)

    return RailBridge


class MininetFabric(Fabric):
    """A Fabric whose kernel objects are made by Mininet (see the module docstring)."""

    backend = "mininet"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.net = None          # the mininet.net.Mininet object, once built
        self.nodes: dict[str, object] = {}   # our name ("h1", "sw-r0") -> Mininet node

    def mininet_net(self):
        """The ``Mininet`` object (for ``mininet.cli.CLI(net)``); None before build."""
        return self.net

    # ---------------------------------------------------------------- building
    def _name(self, suffix: str, node) -> str:
        """Record (write-ahead), then name the node's namespace, then open netlink inside it."""
        ns = self.state.ns_name(suffix)
        self.state.record_namespace(ns)
        netns.attach(ns, node.pid)
        ipr = self._open(ns)
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        return ns

    def _create(self) -> None:
        Mininet, _ = _mininet()
        RailBridge = _rail_bridge_class()
        topo: Topology = self.topo
        Mininet.inited = True   # skip fixLimits(): no root-namespace sysctls/rlimits changes
        self.net = net = Mininet(topo=None, build=False, controller=None, switch=RailBridge,
                                 autoSetMacs=False, autoStaticArp=False, inNamespace=False,
                                 waitConnected=False)
        for h in topo.hosts:
            node = net.addHost(h, ip=None, inNamespace=True)
            self.nodes[h] = node
            self._name(h, node)
            self.progress(f"host {h} (mininet pid {node.pid})")
            checkpoint()
        if topo.wiring == "switch":
            for i, rail in enumerate(topo.rails):
                sw = net.addSwitch(f"sw-{rail.name}", cls=RailBridge, inNamespace=True,
                                   dpid="%016x" % (i + 1), stp=False)
                self.nodes[f"sw-{rail.name}"] = sw
                self._name(f"sw-{rail.name}", sw)
        for (h, r), _spec_link in topo.links.items():
            peer_ns, peer_if = self._peer_of(h, r)
            if peer_if is None:
                continue
            other = self.nodes[f"sw-{r}"] if topo.wiring == "switch" else \
                self.nodes[topo.hosts[1]]
            link = net.addLink(self.nodes[h], other, intfName1=r, intfName2=peer_if)
            self.state.record_object(kind="veth", ns=self.state.ns_name(h), ifname=r,
                                     peer_ns=peer_ns, peer_ifname=peer_if, via="mininet")
            # Mininet's own view of the address (for its CLI: `h1 ping h2`); no kernel action
            link.intf1.ip, link.intf1.prefixLen = topo.address(h, r), \
                topo.link(h, r).address.network.prefixlen
            if topo.wiring == "direct":
                other_host = topo.hosts[1]
                link.intf2.ip, link.intf2.prefixLen = topo.address(other_host, r), \
                    topo.link(other_host, r).address.network.prefixlen
        net.build()      # configHosts: lo up; no addresses (ip=None)
        net.start()      # RailBridge.start: br0 with every port
        if topo.wiring == "switch":
            for rail in topo.rails:
                ipr = self._ipr[self.state.ns_name(f"sw-{rail.name}")]
                found = ipr.link_lookup(ifname=BRIDGE)
                if not found:
                    raise FabricError(f"mininet switch of rail {rail.name} has no {BRIDGE}")
                for h in topo.hosts:      # port MTUs first, then the bridge's own
                    ipr.link("set", index=ipr.link_lookup(ifname=h)[0], mtu=rail.mtu)
                ipr.link("set", index=found[0], mtu=rail.mtu, state="up")

    def _destroy(self) -> None:
        """Stop Mininet (links, switches, shells); namespaces are removed by the run state."""
        net, self.net = self.net, None
        if net is None:
            return
        try:
            net.stop()
        except Exception as e:   # a half-built net: the namespaces still go with the run state
            log.warning("mininet stop: %s", e)
        self.nodes.clear()


def fabric_class(topo: Topology) -> type[Fabric]:
    """The Fabric class for a topology's backend (``backend: mininet`` -> MininetFabric)."""
    return MininetFabric if topo.backend == "mininet" else Fabric


def make_fabric(topo: Topology, *args, **kwargs) -> Fabric:
    return fabric_class(topo)(topo, *args, **kwargs)
