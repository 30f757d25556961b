"""Topology files: parse and validate YAML into a typed, immutable model before anything is built.

Everything a later stage needs is resolved here (host names, per-link shaping after overrides,
addresses), so the fabric never has to interpret the file, and a bad file never builds half a
fabric.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from testbed.errors import CapabilityError, SpecError, quote
from testbed.model.units import (MAX_DELAY_S, MAX_FILE_BYTES, MAX_HOSTS, MAX_RAILS,
                                 MAX_YAML_DEPTH, MAX_YAML_NODES, format_duration, format_rate,
                                 parse_duration, parse_percent, parse_rate)

DEFAULT_ADDRESSING = "198.18.0.0/15"
DEFAULT_RAIL_PREFIX = 24
_NAME_RE = re.compile(r"[a-z][a-z0-9]{0,14}")
_TOPO_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
BACKENDS = ("pyroute2", "mininet")
WIRINGS = ("switch", "direct")
BRIDGE = "br0"   # each rail switch's bridge, inside the switch namespace (testbed.fabric)
# Host names become interface names in the rail switches' namespaces (next to BRIDGE), rail
# names in the hosts' (next to lo): none may be a name the kernel or the fabric already uses
# there. "all" and "default" the kernel refuses (they are /proc/sys/net/*/conf entries); the
# tunnels' fallback devices appear in every new namespace where their module is loaded.
RESERVED_NAMES = frozenset({"lo", BRIDGE, "all", "default", "sit0", "tunl0", "gre0", "gretap0",
                            "erspan0", "ip6tnl0", "ip6gre0", "ip6erspan0"})

# Keys of each section; the scenario sections are validated by testbed.model.scenario.
TOP_KEYS = ("name", "description", "hosts", "rails", "links", "wiring", "addressing",
            "rail_prefix", "backend", "tcp", "workload", "faults", "expect", "capture")
SHAPE_KEYS = ("bandwidth", "loss", "delay", "jitter")
RAIL_KEYS = ("name", "mtu", "protocol", "aggregation_rate") + SHAPE_KEYS
# tcp: hosts talk to each other through the rail's bridge; aggregation: the rail's switch also
# reduces (an aggregation service on the bridge's address, testbed/aggregation)
PROTOCOLS = ("tcp", "aggregation")


@dataclass(frozen=True)
class Shape:
    """How one direction of a link should behave. ``delay`` is one-way, per direction."""

    rate_bps: Optional[int] = None     # None: not rate-limited
    loss: float = 0.0                  # fraction, 0..1
    delay_s: float = 0.0
    jitter_s: float = 0.0

    @property
    def needs_netem(self) -> bool:
        return self.delay_s > 0 or self.jitter_s > 0

    def describe(self) -> str:
        parts = [format_rate(self.rate_bps)]
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        if self.delay_s:
            parts.append(f"delay {format_duration(self.delay_s)}")
        if self.jitter_s:
            parts.append(f"jitter {format_duration(self.jitter_s)}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {"rate_bps": self.rate_bps, "loss": self.loss,
                "delay_s": self.delay_s, "jitter_s": self.jitter_s}


@dataclass(frozen=True)
class RailSpec:
    """One rail as the file describes it: its subnet, and the shape every link on it gets."""

    name: str
    index: int
    subnet: ipaddress.IPv4Network
    shape: Shape
    mtu: int = 1500
    protocol: str = "tcp"
    aggregation_rate_bps: Optional[int] = None     # the switch's reduction rate; None: unpaced

    @property
    def switch_address(self) -> Optional[ipaddress.IPv4Interface]:
        """Where an aggregation rail's switch listens: the subnet's last usable address (hosts
        take the first ones, and the spec refuses a rail too full to leave it free)."""
        if self.protocol != "aggregation":
            return None
        return ipaddress.IPv4Interface(f"{self.subnet.broadcast_address - 1}/"
                                       f"{self.subnet.prefixlen}")


@dataclass(frozen=True)
class LinkSpec:
    """One host's attachment to one rail: the unit that shaping and faults act on (the live
    handle is testbed.fabric.Link)."""

    host: str
    rail: str
    address: ipaddress.IPv4Interface
    shape: Shape
    mtu: int

    @property
    def name(self) -> str:
        return f"{self.host}.{self.rail}"


@dataclass(frozen=True)
class Topology:
    name: str
    hosts: tuple[str, ...]
    rails: tuple[RailSpec, ...]
    links: Mapping[tuple[str, str], LinkSpec]
    wiring: str = "switch"
    addressing: ipaddress.IPv4Network = ipaddress.IPv4Network(DEFAULT_ADDRESSING)
    backend: str = "pyroute2"
    description: str = ""
    tcp: Mapping[str, Any] = field(default_factory=dict)
    sections: Mapping[str, Any] = field(default_factory=dict)  # workload/faults/expect/capture
    source: Optional[str] = None
    raw: Mapping[str, Any] = field(default_factory=dict)       # the document as written

    @property
    def tcp_rails(self) -> list[RailSpec]:
        """The rails a rank drives as TCP rails, in file order: what nezha numbers 0, 1, ...
        (NEZHA_RAILS; the aggregation rails it reaches as another protocol)."""
        return [r for r in self.rails if r.protocol == "tcp"]

    @property
    def rail_order(self) -> list[str]:
        """The rails as Nezha's events number them: its TCP rails, then the aggregation rails
        (events name those). With an aggregation rail listed first, file order gave Nezha's
        rail 0 the aggregation rail's name."""
        tcp = [r.name for r in self.tcp_rails]
        return tcp + [r.name for r in self.rails if r.name not in tcp]

    def rail(self, name: str) -> RailSpec:
        for r in self.rails:
            if r.name == name:
                return r
        raise KeyError(name)

    def link(self, host: str, rail: str) -> LinkSpec:
        return self.links[(host, rail)]

    def address(self, host: str, rail: str) -> str:
        return str(self.links[(host, rail)].address.ip)

    @property
    def needs_netem(self) -> bool:
        return any(l.shape.needs_netem for l in self.links.values())

    def to_dict(self) -> dict:
        """The resolved topology, as written into a results folder and the run-state file."""
        return {
            "name": self.name, "description": self.description, "backend": self.backend,
            "wiring": self.wiring, "addressing": str(self.addressing), "hosts": list(self.hosts),
            "rails": [{"name": r.name, "subnet": str(r.subnet), "mtu": r.mtu,
                       "protocol": r.protocol, "aggregation_rate_bps": r.aggregation_rate_bps,
                       **r.shape.to_dict()} for r in self.rails],
            "links": {l.name: {"address": str(l.address), "mtu": l.mtu, **l.shape.to_dict()}
                      for l in self.links.values()},
            "tcp": dict(self.tcp), **{k: v for k, v in self.sections.items()},
        }


# --------------------------------------------------------------------------------------------
def _require_mapping(value: Any, field: str, accepted: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(field, f"{type(value).__name__} given", accepted)
    return value


def _check_keys(mapping: dict, allowed: tuple, field: str) -> None:
    for key in mapping:
        if key not in allowed:
            where = f"{field}.{key}" if field else str(key)
            raise SpecError(where, "unknown key", f"one of: {', '.join(allowed)}")


def _parse_name(value: Any, field: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise SpecError(field, f"{quote(value)} is not a valid {what} name",
                        "1-15 lowercase letters or digits, starting with a letter (e.g. h1, r0)")
    if value in RESERVED_NAMES:
        raise SpecError(field, f"{quote(value)} is a name the fabric or the kernel already uses "
                        "for an interface", f"any other {what} name; not one of: "
                        + ", ".join(sorted(RESERVED_NAMES)))
    return value


def _parse_shape(raw: dict, field: str, base: Shape) -> Shape:
    shape = base
    if "bandwidth" in raw:
        shape = replace(shape, rate_bps=parse_rate(raw["bandwidth"], f"{field}.bandwidth"))
    if "loss" in raw:
        shape = replace(shape, loss=parse_percent(raw["loss"], f"{field}.loss"))
    if "delay" in raw:
        shape = replace(shape, delay_s=parse_duration(raw["delay"], f"{field}.delay",
                                                      maximum=MAX_DELAY_S))
    if "jitter" in raw:
        shape = replace(shape, jitter_s=parse_duration(raw["jitter"], f"{field}.jitter",
                                                       maximum=MAX_DELAY_S))
    if shape.jitter_s > 0 and shape.delay_s == 0:
        raise SpecError(f"{field}.jitter", "jitter without delay",
                        "a delay as well (jitter varies the delay around its mean)")
    return shape


def _parse_mtu(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 576 <= value <= 65535:
        raise SpecError(field, f"{quote(value)} is not a valid MTU", "an integer from 576 to 65535")
    return value


def _parse_hosts(raw: Any) -> tuple[str, ...]:
    if isinstance(raw, bool):
        raw = None
    limit = (f"at most {MAX_HOSTS} hosts: each host is a port of every rail switch, and a "
             f"Linux bridge has 1024 port numbers (0 reserved)")
    if isinstance(raw, int):
        if raw < 1:
            raise SpecError("hosts", f"{raw} hosts", "a count of at least 1, or a list of names")
        if raw > MAX_HOSTS:        # before a single name is made
            raise SpecError("hosts", f"{quote(raw)} hosts", limit)
        return tuple(f"h{i + 1}" for i in range(raw))
    if isinstance(raw, list) and raw:
        if len(raw) > MAX_HOSTS:
            raise SpecError("hosts", f"a list of {len(raw)} hosts", limit)
        names = [_parse_name(n, f"hosts[{i}]", "host") for i, n in enumerate(raw)]
        for i, n in enumerate(names):
            if names.index(n) != i:
                raise SpecError(f"hosts[{i}]", f"duplicate host name {quote(n)}",
                                "unique host names")
        return tuple(names)
    raise SpecError("hosts", f"{quote(raw)} given", "a host count (e.g. 4) or a list of host names")


def _parse_document(doc: Any) -> dict:
    if doc is None:
        raise SpecError("(file)", "the topology file is empty", "a mapping with hosts and rails")
    doc = _require_mapping(doc, "(file)", "a mapping with keys such as hosts, rails, links")
    _check_keys(doc, TOP_KEYS, "")
    return doc


def _parse_topology_name(name: Any) -> str:
    if not isinstance(name, str) or not _TOPO_NAME_RE.fullmatch(name):
        raise SpecError("name", f"{quote(name)} is not a valid topology name",
                        "up to 64 letters, digits, '.', '_' or '-'")
    return name


def _parse_wiring(wiring: Any, hosts: tuple[str, ...]) -> str:
    if wiring not in WIRINGS:
        raise SpecError("wiring", f"{quote(wiring)} is not a wiring",
                        f"one of: {', '.join(WIRINGS)}")
    if wiring == "direct" and len(hosts) != 2:
        raise SpecError("wiring", f"direct wiring with {len(hosts)} hosts",
                        "exactly 2 hosts for direct wiring, or wiring: switch")
    return wiring


def _parse_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise SpecError("backend", f"{quote(backend)} is not a backend",
                        f"one of: {', '.join(BACKENDS)}")
    return backend


def _parse_addressing(doc: dict) -> tuple[ipaddress.IPv4Network, int]:
    """(the addressing block, each rail's prefix length)."""
    addr_raw = doc.get("addressing", DEFAULT_ADDRESSING)
    try:
        block = ipaddress.IPv4Network(str(addr_raw), strict=True)
    except ValueError:
        raise SpecError("addressing", f"{quote(addr_raw)} is not an IPv4 network",
                        "a CIDR block such as 198.18.0.0/15") from None
    rail_prefix = doc.get("rail_prefix", max(DEFAULT_RAIL_PREFIX, block.prefixlen))
    if isinstance(rail_prefix, bool) or not isinstance(rail_prefix, int) \
            or not block.prefixlen <= rail_prefix <= 30:
        raise SpecError("rail_prefix", f"{quote(rail_prefix)} is not usable",
                        f"an integer from {block.prefixlen} to 30 (each rail's subnet length)")
    return block, rail_prefix


def _check_room(n_rails: int, n_hosts: int, block: ipaddress.IPv4Network,
                rail_prefix: int) -> None:
    """The block holds a subnet per rail, and each subnet an address per host."""
    n_subnets = 2 ** (rail_prefix - block.prefixlen)
    if n_rails > n_subnets:
        raise SpecError("rails", f"{n_rails} rails but {block} holds only {n_subnets} "
                        f"/{rail_prefix} subnets", "fewer rails, a larger addressing block, "
                        "or a longer rail_prefix")
    host_capacity = 2 ** (32 - rail_prefix) - 2
    if n_hosts > host_capacity:
        raise SpecError("hosts", f"{n_hosts} hosts but a /{rail_prefix} rail subnet holds "
                        f"only {host_capacity}", "fewer hosts, or a shorter rail_prefix "
                        "(e.g. rail_prefix: 20 with addressing: 198.18.0.0/15)")


def _parse_protocol(raw: dict, f: str, wiring: str, n_hosts: int,
                    subnet: ipaddress.IPv4Network) -> tuple[str, Optional[int]]:
    """(protocol, aggregation rate) of one rail; aggregation needs a switch and a free address
    on the rail's subnet for it."""
    protocol = raw.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise SpecError(f"{f}.protocol", f"{quote(protocol)} is not a rail protocol",
                        f"one of: {', '.join(PROTOCOLS)}")
    if protocol == "tcp":
        if "aggregation_rate" in raw:
            raise SpecError(f"{f}.aggregation_rate", "given on a tcp rail",
                            "protocol: aggregation with it, or no aggregation_rate")
        return protocol, None
    if wiring != "switch":
        raise SpecError(f"{f}.protocol", f"aggregation with wiring: {wiring} (the aggregation "
                        "service runs in the rail's switch)", "wiring: switch, or protocol: tcp")
    if n_hosts >= subnet.num_addresses - 2:
        raise SpecError(f"{f}.protocol", f"{n_hosts} hosts fill the rail's {subnet}, and an "
                        "aggregation rail's switch needs its last usable address",
                        "fewer hosts, or a shorter rail_prefix")
    rate = raw.get("aggregation_rate")
    return protocol, (None if rate is None else parse_rate(rate, f"{f}.aggregation_rate"))


def _parse_rails(rails_raw: Any, hosts: tuple[str, ...], block: ipaddress.IPv4Network,
                 rail_prefix: int, wiring: str = "switch") -> tuple[RailSpec, ...]:
    if not isinstance(rails_raw, list) or not rails_raw:
        raise SpecError("rails", f"{quote(rails_raw)} given",
                        "a non-empty list of rails, e.g. [{name: r0, bandwidth: 200mbit}]")
    if len(rails_raw) > MAX_RAILS:
        raise SpecError("rails", f"{len(rails_raw)} rails", f"at most {MAX_RAILS} rails")
    _check_room(len(rails_raw), len(hosts), block, rail_prefix)
    subnets = block.subnets(new_prefix=rail_prefix)
    rails: list[RailSpec] = []
    for i, raw in enumerate(rails_raw):
        f = f"rails[{i}]"
        raw = _require_mapping(raw, f, "a mapping such as {name: r0, bandwidth: 200mbit}")
        _check_keys(raw, RAIL_KEYS, f)
        rname = _parse_name(raw.get("name", f"r{i}"), f"{f}.name", "rail")
        if any(r.name == rname for r in rails):
            raise SpecError(f"{f}.name", f"duplicate rail name {quote(rname)}", "unique rail names")
        if rname in hosts:
            raise SpecError(f"{f}.name", f"{quote(rname)} is also a host name",
                            "rail names distinct from host names")
        mtu = _parse_mtu(raw.get("mtu", 1500), f"{f}.mtu")
        subnet = next(subnets)
        protocol, agg_rate = _parse_protocol(raw, f, wiring, len(hosts), subnet)
        rails.append(RailSpec(rname, i, subnet, _parse_shape(raw, f, Shape()), mtu, protocol,
                              agg_rate))
    return tuple(rails)


def _rail_links(hosts: tuple[str, ...],
                rails: tuple[RailSpec, ...]) -> dict[tuple[str, str], LinkSpec]:
    """Every host on every rail, with the rail's shape and the next address of its subnet."""
    links: dict[tuple[str, str], LinkSpec] = {}
    for rail in rails:
        hosts_iter = rail.subnet.hosts()
        for h in hosts:
            ip = next(hosts_iter)
            links[(h, rail.name)] = LinkSpec(h, rail.name, ipaddress.IPv4Interface(
                f"{ip}/{rail.subnet.prefixlen}"), rail.shape, rail.mtu)
    return links


def _apply_link_overrides(links: dict[tuple[str, str], LinkSpec], overrides: Any,
                          hosts: tuple[str, ...], rails: tuple[RailSpec, ...],
                          wiring: str) -> None:
    """The ``links`` section: per-link shapes over the rail's, in place."""
    overrides = _require_mapping(overrides, "links",
                                 "a mapping such as {h2.r1: {bandwidth: 50mbit}}")
    for key, raw in overrides.items():
        f = f"links.{key}"
        host, _, rname = str(key).partition(".")
        if host not in hosts or not any(r.name == rname for r in rails):
            raise SpecError(f, "no such link", "HOST.RAIL naming a host and a rail of this file "
                            f"(hosts: {', '.join(hosts[:8])}{'...' if len(hosts) > 8 else ''}; "
                            f"rails: {', '.join(r.name for r in rails)})")
        raw = _require_mapping(raw, f, "a mapping such as {bandwidth: 50mbit}")
        _check_keys(raw, SHAPE_KEYS, f)
        link = links[(host, rname)]
        links[(host, rname)] = replace(link, shape=_parse_shape(raw, f, link.shape))
        if wiring == "direct":
            # one cable per rail: either host's name for it shapes the whole cable
            other = hosts[1 - hosts.index(host)]
            if f"{other}.{rname}" in overrides:
                raise SpecError(f, f"{host}.{rname} and {other}.{rname} name the same cable "
                                "in direct wiring", "an override on only one of them")
            links[(other, rname)] = replace(links[(other, rname)],
                                            shape=links[(host, rname)].shape)


def _parse_tcp(raw: Any) -> dict[str, Any]:
    tcp = _require_mapping(raw, "tcp", "a mapping such as {rto_min: 10ms}")
    _check_keys(tcp, ("rto_min", "congestion_control"), "tcp")
    parsed: dict[str, Any] = {}
    if "rto_min" in tcp:
        parsed["rto_min_s"] = parse_duration(tcp["rto_min"], "tcp.rto_min", allow_zero=False)
    if "congestion_control" in tcp:
        cc = tcp["congestion_control"]
        if not isinstance(cc, str) or not re.fullmatch(r"[a-z0-9_]{1,15}", cc):
            raise SpecError("tcp.congestion_control",
                            f"{quote(cc)} is not a congestion control name",
                            "a name such as cubic, reno, bbr or dctcp")
        parsed["congestion_control"] = cc
    return parsed


def parse(doc: Any, source: Optional[str] = None, default_name: str = "topology") -> Topology:
    """Validate a loaded YAML document into a Topology (no kernel capabilities checked here),
    the scenario sections (workload, faults, expect, capture) included."""
    doc = _parse_document(doc)
    name = _parse_topology_name(doc.get("name", default_name))
    if "hosts" not in doc:
        raise SpecError("hosts", "missing", "a host count (e.g. 4) or a list of host names")
    hosts = _parse_hosts(doc["hosts"])
    wiring = _parse_wiring(doc.get("wiring", "switch"), hosts)
    backend = _parse_backend(doc.get("backend", "pyroute2"))
    block, rail_prefix = _parse_addressing(doc)
    rails = _parse_rails(doc.get("rails"), hosts, block, rail_prefix, wiring)
    links = _rail_links(hosts, rails)
    _apply_link_overrides(links, doc.get("links") or {}, hosts, rails, wiring)
    tcp = _parse_tcp(doc.get("tcp") or {})
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise SpecError("description", "not a string", "free text")
    sections = {k: doc[k] for k in ("workload", "faults", "expect", "capture") if k in doc}
    topo = Topology(name=name, hosts=hosts, rails=rails, links=links, wiring=wiring,
                    addressing=block, backend=backend, description=description, tcp=tcp,
                    sections=sections, source=source, raw=doc)
    from testbed.model import scenario  # validated together: a bad fault never waits for the build
    scenario.validate(topo)
    return topo


def load(path: str | Path) -> Topology:
    """Read and validate a topology file; every problem is a SpecError naming the field."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SpecError(str(path), f"cannot read: {e.strerror}", "a readable YAML file") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(str(path), f"larger than {MAX_FILE_BYTES >> 10} KiB",
                        f"a topology file of at most {MAX_FILE_BYTES >> 10} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(str(path), f"not UTF-8 text (byte {e.start})", "a UTF-8 YAML file") \
            from None
    return loads(text, source=str(path), default_name=path.stem)


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses duplicate keys (YAML's last-wins would silently drop the
    first), and documents whose aliases expand to more than MAX_YAML_NODES values or that nest
    deeper than MAX_YAML_DEPTH (an alias bomb is a few hundred bytes: the expansion is counted
    on the composed node graph, never built)."""

    _depth = 0

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def compose_node(self, parent, index):
        # refused while composing: a deeper document is never even scanned (PyYAML's scanner
        # slows down with every open bracket, and its composer recurses per level)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise SpecError(_where(self.peek_event().start_mark),
                                f"nested more than {MAX_YAML_DEPTH} deep",
                                "a topology file (mappings and lists a few levels deep)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or \
                        not isinstance(key_node, yaml.ScalarNode):
                    continue       # merge keys (<<) may override; complex keys fail later
                key = self.construct_object(key_node)
                if key in seen:
                    raise SpecError(_where(key_node.start_mark),
                                    f"duplicate key {quote(key)} (first on line "
                                    f"{seen[key].line + 1})", "each key once per mapping")
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root) -> None:
    """Count the values of the document as if every alias were expanded (memoised per node, so
    a bomb costs its size in nodes, not its expansion) and measure its depth."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    active: set[int] = set()

    def visit(node, level: int) -> None:
        if level > MAX_YAML_DEPTH:
            raise SpecError(_where(node.start_mark), f"nested more than {MAX_YAML_DEPTH} deep",
                            "a topology file (mappings and lists a few levels deep)")
        key = id(node)
        if key in size:
            if level + depth[key] > MAX_YAML_DEPTH:
                raise SpecError(_where(node.start_mark), f"nested more than {MAX_YAML_DEPTH} "
                                "deep (through aliases)", "a topology file (a few levels deep)")
            return
        if key in active:
            raise SpecError(_where(node.start_mark), "an alias refers to the value containing it",
                            "aliases (*name) to values outside their own anchor (&name)")
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            size[key], depth[key] = 1, 0
            return
        active.add(key)
        for child in children:
            visit(child, level + 1)
        active.discard(key)
        size[key] = 1 + sum(size[id(c)] for c in children)
        depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
        if size[key] > MAX_YAML_NODES:
            raise SpecError(_where(node.start_mark), f"more than {MAX_YAML_NODES} values here "
                            "once aliases (*name) are expanded", "a topology file without alias "
                            "bombs (an anchor reused a few times is fine)")

    if root is not None:
        visit(root, 0)


def loads(text: str, source: Optional[str] = None, default_name: str = "topology") -> Topology:
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(source or "(file)", f"larger than {MAX_FILE_BYTES >> 10} KiB",
                        f"a topology file of at most {MAX_FILE_BYTES >> 10} KiB")
    try:
        doc = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = _where(mark) if mark else "(file)"
        raise SpecError(where, f"malformed YAML: {str(getattr(e, 'problem', None) or e)[:200]}",
                        "valid YAML (check indentation and colons)") from None
    except RecursionError:     # not reached (compose_node stops at MAX_YAML_DEPTH): a guard
        raise SpecError("(file)", "nested too deeply to read",
                        f"mappings and lists at most {MAX_YAML_DEPTH} levels deep") from None
    except ValueError as e:    # e.g. an integer of more than 4300 digits
        raise SpecError("(file)", f"unreadable value: {str(e)[:200]}",
                        "numbers of sane size (README: Limits)") from None
    return parse(doc, source=source, default_name=default_name)


def check_capabilities(topo: Topology, caps) -> None:
    """Refuse, before building, any shaping this kernel cannot apply honestly."""
    # caps: testbed.kernel.capabilities.Capabilities (not imported: the model is free of kernel
    # code)
    if not caps.netem:
        for link in topo.links.values():
            if link.shape.needs_netem:
                what = "delay" if link.shape.delay_s else "jitter"
                raise CapabilityError(
                    f"links.{link.name}.{what}",
                    f"{what} needs the kernel's netem qdisc (sch_netem), which this kernel lacks",
                    "no delay/jitter on this machine, or a kernel with sch_netem "
                    "(e.g. the Vagrant VM); loss still works through nftables")
    cc = topo.tcp.get("congestion_control")
    if cc and caps.congestion_controls and cc not in caps.congestion_controls:
        raise CapabilityError("tcp.congestion_control",
                              f"{quote(cc)} is not available in this kernel",
                              f"one of: {', '.join(caps.congestion_controls)} (or load its "
                              f"module first: modprobe tcp_{cc})")
    if not caps.nftables and not caps.netem:
        for link in topo.links.values():
            if link.shape.loss:
                raise CapabilityError(f"links.{link.name}.loss",
                                      "loss needs netem or nftables, and neither works here",
                                      "install nftables (apt-get install nftables)")
