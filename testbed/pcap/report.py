"""`python -m testbed pcap RESULTS_DIR`: what actually crossed each rail, from the captures.

Per rail: Nezha bytes and chunks per operation, TCP retransmissions (a segment whose bytes were
all seen before), rerouted chunks (the same (sender, op, step, chunk, offset) seen on more than
one rail), hedged chunks (copies of a late share, marked as such in the DATA header's aux, see
nezha/engine/hedge.py) and the split that crossed the wire (each rail's share of DATA payload
bytes). Per rail and in total, the bytes per protocol: Nezha frames, aggregation frames (to and
from an aggregation rail's switch, by type: CONTRIB, RESULT, ERROR, handshake, PING/PONG), and
other TCP flows (rendezvous store, MPTCP, iperf3...).

Each packet is captured twice (leaving one host, entering another); a flow is counted once, from
the capture of the host that owns its source address (``capture.json``, written by
testbed.run.capture), so every byte is counted once, where it was sent. A flow from an address
no host owns (an aggregation switch) is counted at the host it goes to.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from nezha import wire

from testbed.pcap.dissect import frames_in, tcp_segments
from testbed.pcap.nzag import AGGREGATION, GROUPS
from testbed.run.capture import MANIFEST


def find_captures(results: Path) -> tuple[Optional[dict], list[tuple[str, str, Path]]]:
    """(manifest or None, [(host, rail, path)]) for a results folder or a captures folder."""
    results = Path(results)
    manifests = sorted(results.rglob(MANIFEST))
    if manifests:
        m = json.loads(manifests[0].read_text())
        base = manifests[0].parent
        return m, [(f["host"], f["rail"], base / f["file"]) for f in m["files"]
                   if (base / f["file"]).exists()]
    files = []
    for p in sorted(results.rglob("*.pcap")):
        host, _, rail = p.stem.partition(".")
        files.append((host, rail, p))
    return None, files


def _new_rail() -> dict:
    return {"wire_bytes": 0, "tcp_bytes": 0, "tcp_segments": 0, "frames": 0, "data_bytes": 0,
            "chunks": 0, "retrans_segments": 0, "retrans_bytes": 0, "rerouted_chunks": 0,
            "hedged_chunks": 0,
            "acks": 0, "flows": 0, "unparsed_flows": [], "protocols": {}}


def _protocol(table: dict, name: str) -> dict:
    """``table[name]``, the counts of one protocol, created on first use."""
    if name not in table:
        table[name] = {"flows": 0, "wire_bytes": 0, "tcp_bytes": 0, "frames": 0,
                       "frame_bytes": 0, "malformed": 0}
        if name == AGGREGATION.protocol:
            table[name]["types"] = {g: {"frames": 0, "bytes": 0} for g in GROUPS}
    return table[name]


def _ordered(protocols: dict) -> list[str]:
    """Protocol names in a stable order: Nezha, aggregation, then the rest."""
    first = ["nezha", AGGREGATION.protocol]
    return sorted(protocols, key=lambda n: (first.index(n) if n in first else len(first), n))


def _ours(flow, host: str, owner: dict) -> bool:
    """Is ``flow`` counted in ``host``'s capture: the host sent it or, from an address no host
    owns (a switch), receives it. Without a manifest every file may count it."""
    if not owner:
        return True
    src = owner.get(flow[0])
    return src == host if src is not None else owner.get(flow[2]) == host


@dataclass
class _Tally:
    """Counts over every capture file, filled file by file."""

    per_rail: dict[str, dict]
    per_op: dict = field(default_factory=lambda: defaultdict(
        lambda: defaultdict(lambda: {"bytes": 0, "chunks": 0})))
    op_kind: dict = field(default_factory=dict)
    chunk_rails: dict = field(default_factory=lambda: defaultdict(set))
    hedge_copies: dict = field(default_factory=lambda: defaultdict(set))
    per_host: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    seen_flows: set = field(default_factory=set)

    def sent_flows(self, host: str, path: Path, owner: dict) -> set:
        """Flows of this file sent by ``host`` (by source address) and not counted yet;
        without a manifest, the first file that has a flow wins."""
        flows = set()
        for seg in tcp_segments(str(path)):
            if seg.flow not in self.seen_flows and _ours(seg.flow, host, owner):
                flows.add(seg.flow)
        self.seen_flows |= flows
        return flows

    @staticmethod
    def add_streams(pr: dict, streams) -> None:
        for st in streams:
            pr["wire_bytes"] += st.wire_bytes
            pr["tcp_bytes"] += st.bytes
            pr["tcp_segments"] += st.segments
            pr["retrans_segments"] += st.retrans_segments
            pr["retrans_bytes"] += st.retrans_bytes
            pr["flows"] += 1
            proto = _protocol(pr["protocols"], st.protocol)
            proto["flows"] += 1
            proto["wire_bytes"] += st.wire_bytes
            proto["tcp_bytes"] += st.bytes
            if st.foreign:
                pr["other_flows"] = pr.get("other_flows", 0) + 1   # rendezvous store, iperf3...
            elif st.error and st.bytes:
                pr["unparsed_flows"].append({"flow": list(st.flow), "error": st.error})

    def add_frames(self, host: str, rail: str, pr: dict, frames) -> None:
        for fr in frames:
            self.add_protocol(pr, fr)
            if fr.protocol != "nezha":
                continue
            h = fr.header
            pr["frames"] += 1
            if h.type == wire.ACK:
                pr["acks"] += 1
            if h.type != wire.DATA:
                continue
            pr["data_bytes"] += h.length
            pr["chunks"] += 1
            self.per_host[host][rail] += h.length
            op = self.per_op[h.op_id][rail]
            op["bytes"] += h.length
            op["chunks"] += 1
            self.op_kind[h.op_id] = wire.KIND_NAMES.get(h.kind, str(h.kind))
            key = (h.src, h.op_id, h.step, h.chunk, h.offset)
            if h.aux >> wire.COPY_SHIFT:
                self.hedge_copies[key].add(rail)
                pr["hedged_chunks"] += 1
            else:
                self.chunk_rails[key].add(rail)

    @staticmethod
    def add_protocol(pr: dict, fr) -> None:
        """Count one frame under its protocol (and its type group, if the protocol has some)."""
        proto = _protocol(pr["protocols"], fr.protocol)
        if fr.malformed:
            proto["malformed"] += 1
            return
        proto["frames"] += 1
        proto["frame_bytes"] += fr.size
        if fr.group is not None:
            g = proto["types"][fr.group]
            g["frames"] += 1
            g["bytes"] += fr.size

    def rerouted(self) -> dict:
        """Chunks sent unmarked on more than one rail (failover moved them), each counted on
        every rail it crossed. Hedge copies are not reroutes: they are counted apart."""
        rerouted = {k: v for k, v in self.chunk_rails.items() if len(v) > 1}
        for rs in rerouted.values():
            for r in rs:
                self.per_rail[r]["rerouted_chunks"] += 1
        return rerouted


def analyse(results, rails: Optional[list[str]] = None) -> dict:
    manifest, files = find_captures(Path(results))
    if not files:
        raise FileNotFoundError(f"no pcap files under {results}")
    owner = {}
    if manifest:
        owner = {a: h for h, addrs in manifest["hosts"].items() for a in addrs.values()}
        rails = rails or manifest["rails"]
    rails = rails or sorted({r for _, r, _ in files})
    tally = _Tally({r: _new_rail() for r in rails})
    for host, rail, path in files:
        flows = tally.sent_flows(host, path, owner)
        frames, ra = frames_in(str(path), rail, flows)
        pr = tally.per_rail.setdefault(rail, _new_rail())
        tally.add_streams(pr, ra.flows.values())
        tally.add_frames(host, rail, pr, frames)
    rerouted = tally.rerouted()
    per_rail = tally.per_rail
    total = sum(pr["data_bytes"] for pr in per_rail.values())
    for pr in per_rail.values():
        pr["share"] = pr["data_bytes"] / total if total else 0.0
    return {
        "protocols": _totals(per_rail),
        "results": str(results),
        "rails": per_rail,
        "split": {r: pr["share"] for r, pr in per_rail.items()},
        "data_bytes": total,
        "sent_by_host": {h: dict(v) for h, v in tally.per_host.items()},
        "operations": {str(op): {"kind": tally.op_kind.get(op), "rails": dict(v)}
                       for op, v in sorted(tally.per_op.items())},
        "rerouted": [{"src": k[0], "op": k[1], "step": k[2], "chunk": k[3], "offset": k[4],
                      "rails": sorted(v)} for k, v in sorted(rerouted.items())],
        "hedged": [{"src": k[0], "op": k[1], "step": k[2], "chunk": k[3], "offset": k[4],
                    "rails": sorted(tally.chunk_rails.get(k, set())), "copies_on": sorted(v)}
                   for k, v in sorted(tally.hedge_copies.items())],
        "captures": manifest["files"] if manifest else [str(p) for _, _, p in files],
    }


def _totals(per_rail: dict) -> dict:
    """Every protocol's counts summed over the rails (type groups too)."""
    out: dict = {}
    for pr in per_rail.values():
        for name, counts in pr["protocols"].items():
            tot = _protocol(out, name)
            for k, v in counts.items():
                if k == "types":
                    for g, gv in v.items():
                        tot["types"][g]["frames"] += gv["frames"]
                        tot["types"][g]["bytes"] += gv["bytes"]
                else:
                    tot[k] += v
    return out


def _protocol_lines(rep: dict) -> list[str]:
    """The per-protocol table: one line per (rail, protocol), one per aggregation type group,
    then the totals over the rails."""
    title = ("  bytes per protocol (frame bytes: headers + payloads; wire bytes: every captured "
             "packet of its flows):")
    head = (f"  {'rail':<6} {'protocol':<12} {'type':<10} {'frames':>8} {'frame bytes':>12} "
            f"{'wire bytes':>12} {'malformed':>9}")
    lines = [title, head]
    rows = [(r, pr["protocols"]) for r, pr in rep["rails"].items()] + \
        [("total", rep["protocols"])]
    for r, protos in rows:
        for name in _ordered(protos):
            c = protos[name]
            lines.append(f"  {r:<6} {name:<12} {'all':<10} {c['frames']:>8} "
                         f"{c['frame_bytes']:>12} {c['wire_bytes']:>12} {c['malformed']:>9}")
            for g, gc in c.get("types", {}).items():
                lines.append(f"  {r:<6} {name:<12} {g:<10} {gc['frames']:>8} {gc['bytes']:>12}")
    return lines


def format_report(rep: dict) -> str:
    lines = [f"captures in {rep['results']}: {rep['data_bytes']} bytes of Nezha data"]
    lines.append(f"  {'rail':<6} {'share':>7} {'data bytes':>12} {'chunks':>7} {'wire bytes':>12} "
                 f"{'retrans':>8} {'rerouted':>8} {'hedged':>7}  protocols")
    for r, pr in rep["rails"].items():
        lines.append(f"  {r:<6} {pr['share'] * 100:>6.1f}% {pr['data_bytes']:>12} "
                     f"{pr['chunks']:>7} {pr['wire_bytes']:>12} {pr['retrans_segments']:>8} "
                     f"{pr['rerouted_chunks']:>8} {pr.get('hedged_chunks', 0):>7}  "
                     f"{','.join(_ordered(pr['protocols'])) or '-'}")
        if pr.get("other_flows"):
            lines.append(f"         {pr['other_flows']} non-Nezha TCP flow(s) (rendezvous store...)")
        for u in pr["unparsed_flows"]:
            lines.append(f"         flow {u['flow']}: {u['error']}")
    lines += _protocol_lines(rep)
    if rep["operations"]:
        lines.append("  per operation (bytes/chunks per rail):")
        for op, o in rep["operations"].items():
            cells = "  ".join(f"{r}={v['bytes']}/{v['chunks']}" for r, v in o["rails"].items())
            lines.append(f"    op {op:>4} {o['kind'] or '':<14} {cells}")
    for c in rep["captures"]:
        if isinstance(c, dict) and (c.get("truncated") or c.get("kernel_dropped")):
            lines.append(f"  warning: {c['file']} truncated={c.get('truncated')} "
                         f"kernel_dropped={c.get('kernel_dropped', 0)}")
    return "\n".join(lines)


def main(results, as_json: bool = False, rails: Optional[str] = None) -> int:
    from testbed.errors import TestbedError
    try:
        rep = analyse(results, rails.split(",") if rails else None)
    except FileNotFoundError as e:
        raise TestbedError(str(e)) from None
    print(json.dumps(rep, indent=1) if as_json else format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--json" in sys.argv))
