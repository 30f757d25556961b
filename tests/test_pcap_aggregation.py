"""The dissector and `testbed pcap` on aggregation frames (nezha/aggwire.py), offline.

Every frame type built with aggwire's own builders dissects back to the same fields; malformed
NZAG frames (and a few hundred random mutations of valid ones) are recorded as malformed, never
raise and never make the reassembler hold more than a header and a segment; a synthetic capture
of two rails (Nezha frames on r0, a switch's aggregation traffic on r1) gives the right bytes
per protocol and per aggregation frame type.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from nezha import aggwire, wire
from testbed.pcap.dissect import Reassembler, Segment, frame
from testbed.pcap.nzag import NZAG, PORT
from testbed.pcap.report import analyse, format_report

MSS = 1400
H1, H2, SW = "10.0.1.1", "10.0.1.2", "10.0.1.254"      # r1: two hosts and the switch
R0 = {"h1": "10.0.0.1", "h2": "10.0.0.2"}


def contrib(rank: int, op: int, chunk: int, n: int = 300, type_: int = aggwire.CONTRIB) -> bytes:
    """A CONTRIB (or RESULT) of n float32 elements, as nezha/transport/aggregation.py builds it."""
    return aggwire.header(type=type_, dtype=wire.DTYPE_CODES["float32"], redop=1, rank=rank,
                          world=2, count=n, op_id=op, chunk=chunk, length=4 * n) + bytes(4 * n)


def every_type() -> list[bytes]:
    """One frame of each aggregation type, from aggwire's builders."""
    return [aggwire.control(aggwire.HELLO, {"job": "j", "rank": 1, "world": 2, "nonce": "ab"}),
            aggwire.control(aggwire.CHALLENGE, {"nonce": "cd", "proof": "ef"}),
            aggwire.control(aggwire.PROOF, {"proof": "01"}),
            aggwire.control(aggwire.WELCOME, {}),
            contrib(1, 7, 3),
            contrib(1, 7, 3, type_=aggwire.RESULT),
            aggwire.error(aggwire.E_TIMEOUT, "key given up", rank=1, op_id=7, chunk=4),
            aggwire.header(type=aggwire.PING),
            aggwire.control(aggwire.PONG, {"version": 1, "keys": 0, "bytes": 0})]


def feed_stream(stream: bytes, sport: int = 40000, dport: int = PORT, cuts=None):
    """Feed one flow's bytes (SYN, then segments cut at ``cuts`` or every MSS) to a
    Reassembler; (records, flow state)."""
    flow = (H1, sport, SW, dport)
    ra = Reassembler("r1")
    out = ra.feed(Segment(0, flow, 999, 0x02, b"", 60))
    cuts = sorted(set(cuts if cuts is not None else range(MSS, len(stream), MSS)))
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        out += ra.feed(Segment(1, flow, 1000 + a, 0x18, stream[a:b], b - a + 54))
    return out, ra.flows[flow]


# ------------------------------------------------------------------ the layer
@pytest.mark.parametrize("raw", every_type(), ids=lambda r: aggwire.TYPE_NAMES[r[5]])
def test_every_type_round_trips_through_the_layer(raw):
    h = aggwire.unpack(raw[:aggwire.HEADER_SIZE])
    p = NZAG(raw)
    assert p.problem() is None and p.crc_ok()
    assert {f: getattr(p, f) for f in h._fields} == h._asdict()
    assert (p.magic, p.version, p.reserved) == (aggwire.MAGIC, aggwire.VERSION, 0)
    assert bytes(p.payload) == raw[aggwire.HEADER_SIZE:] and bytes(p) == raw
    payload = raw[aggwire.HEADER_SIZE:]     # the layer builds what aggwire builds
    built = NZAG(**h._asdict()) / Raw(payload) if payload else NZAG(**h._asdict())
    assert bytes(built) == raw
    for ports in ({"dport": PORT}, {"sport": PORT}):    # bound to the port, both directions
        pkt = Ether(bytes(Ether() / IP() / TCP(**ports) / Raw(raw)))
        assert NZAG in pkt and pkt[NZAG].type == h.type, pkt.summary()
    assert aggwire.TYPE_NAMES[h.type] in p.summary()


def test_every_type_is_cut_from_a_stream():
    frames = every_type()
    stream = b"".join(frames)
    recs, st = feed_stream(stream, cuts=random.Random(1).sample(range(1, len(stream)), 12))
    assert [r.type_name for r in recs] == [aggwire.TYPE_NAMES[f[5]] for f in frames]
    assert [r.group for r in recs] == ["handshake"] * 4 + ["CONTRIB", "RESULT", "ERROR"] + \
        ["PING"] * 2
    assert [r.size for r in recs] == [len(f) for f in frames]
    assert [r.stream_offset for r in recs] == [stream.index(f) for f in frames]
    assert all(r.protocol == "aggregation" and r.malformed is None for r in recs)
    assert st.error is None and st.frames == len(frames) and st.bytes == len(stream)


# ------------------------------------------------------------------ malformed frames
def _rebuilt(raw: bytes, **changes) -> bytes:
    """A header with some fields changed and its CRC recomputed (so only they are wrong)."""
    p = NZAG(raw[:aggwire.HEADER_SIZE])
    for k, v in changes.items():
        setattr(p, k, v)
    p.crc = None
    return bytes(p)


def _bad_frames() -> dict[str, bytes]:
    good = contrib(0, 1, 0)
    hdr = aggwire.Header(aggwire.CONTRIB, dtype=1, redop=1, rank=0, world=2, count=1 << 30,
                         op_id=1, length=1 << 32 - 1)
    return {
        "bad magic": b"XXXX" + good[4:],
        "unsupported aggregation wire version": _rebuilt(good, version=9),
        "checksum": good[:44] + b"\0\0\0\0" + good[48:],
        "at most": hdr.pack(),                                       # 2 GiB CONTRIB
        "PONG payload": aggwire.Header(aggwire.PONG, length=1 << 31).pack(),
        "unknown aggregation frame type": aggwire.Header(42).pack(),
        "elements": aggwire.Header(aggwire.RESULT, dtype=1, redop=1, world=2, count=3,
                                   length=8).pack(),
    }


@pytest.mark.parametrize("why,raw", list(_bad_frames().items()), ids=list(_bad_frames()))
def test_malformed_frame_is_marked_not_raised(why, raw):
    assert why in NZAG(raw).problem()
    stream = contrib(0, 0, 0) + raw + contrib(0, 2, 0)
    recs, st = feed_stream(stream)
    assert [r.type_name for r in recs] == ["CONTRIB", "malformed"]
    bad = recs[1]
    assert bad.header is None and why in bad.malformed and bad.stream_offset == recs[0].size
    assert st.malformed == 1 and why in st.error and len(st.buf) == 0 and st.skip == 0
    assert st.bytes == len(stream)              # the rest is counted, not parsed


def _mutate(rng: random.Random, frames: list[bytes]) -> bytes:
    """A stream of valid frames with one random mutation."""
    stream = bytearray(b"".join(frames))
    at = rng.randrange(len(stream))
    how = rng.randrange(5)
    if how == 0:
        stream[at] ^= 1 << rng.randrange(8)
    elif how == 1:                              # a random length field, CRC recomputed
        stream[:0] = _rebuilt(rng.choice(frames), length=rng.getrandbits(32))
    elif how == 2:
        del stream[at:at + rng.randrange(1, 64)]
    elif how == 3:
        stream[at:at] = rng.randbytes(rng.randrange(1, 64))
    else:
        stream[at:at + 8] = rng.randbytes(8)
    return bytes(stream)


def test_fuzzed_frames_are_marked_never_raised():
    rng = random.Random(15)
    frames = every_type()
    marked = 0
    for _ in range(300):
        stream = _mutate(rng, frames)
        cuts = rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(1, 20)))
        recs, st = feed_stream(stream, cuts=cuts)
        assert len(st.buf) < aggwire.HEADER_SIZE and not st.pending
        assert st.skip <= aggwire.MAX_CHUNK
        for r in recs:
            assert (r.header is None) == (r.malformed is not None)
            if r.malformed:
                assert r.malformed.startswith("malformed aggregation frame at stream offset ")
            if r.header is not None:
                assert r.header.problem() is None
        marked += st.malformed
        assert st.malformed <= 1 and (st.malformed == 0 or st.error)
        NZAG(stream).problem()                  # the bare layer on any bytes: no exception
    assert marked > 100


def test_a_hole_that_is_never_filled_holds_bounded_memory():
    """A capture that lost a segment: what comes after the hole is held up to MAX_PENDING, then
    the flow is given up (named), not buffered to the end of the capture."""
    from testbed.pcap.stream import MAX_PENDING
    flow = (H1, 40000, SW, PORT)
    ra = Reassembler("r1")
    ra.feed(Segment(0, flow, 999, 0x02, b"", 60))
    block = bytes(64 << 10)
    for i in range(1, 2 * MAX_PENDING // len(block)):
        ra.feed(Segment(i, flow, 1000 + i * len(block), 0x18, block, len(block) + 54))
        st = ra.flows[flow]
        assert st.pending_bytes <= MAX_PENDING
    assert "hole in the capture at stream offset 0" in st.error


# ------------------------------------------------------------------ the report, synthetic pcap
def _packets(src: str, sport: int, dst: str, dport: int, stream: bytes, t: float,
             retransmit: int = -1) -> list:
    """A TCP flow: SYN, then the stream in MSS segments (segment ``retransmit`` sent twice)."""
    base = Ether() / IP(src=src, dst=dst)
    out = [base / TCP(sport=sport, dport=dport, flags="S", seq=99)]
    for i, a in enumerate(range(0, len(stream), MSS)):
        seg = base / TCP(sport=sport, dport=dport, flags="PA", seq=100 + a) / \
            Raw(stream[a:a + MSS])
        out += [seg, seg] if i == retransmit else [seg]
    for k, p in enumerate(out):
        p.time = t + k * 1e-4
    return out


def _nezha_stream(src: int) -> bytes:
    return b"".join(frame(bytes(2000), type=wire.DATA, kind=wire.K_ALLREDUCE, src=src, op_id=1,
                          chunk=i, offset=i * 2000, msg_total=8000) for i in range(4))


def _agg_streams(rank: int) -> tuple[bytes, bytes]:
    """(rank -> switch, switch -> rank): handshake, 3 contributions, 2 results and an ERROR."""
    up = aggwire.control(aggwire.HELLO, {"job": "j", "rank": rank, "world": 2, "nonce": "00"}) + \
        aggwire.control(aggwire.PROOF, {"proof": "11"}) + \
        b"".join(contrib(rank, 1, c) for c in range(3))
    down = aggwire.control(aggwire.CHALLENGE, {"nonce": "22", "proof": "33"}) + \
        aggwire.control(aggwire.WELCOME, {}) + \
        b"".join(contrib(rank, 1, c, type_=aggwire.RESULT) for c in range(2)) + \
        aggwire.error(aggwire.E_TIMEOUT, "gave up", rank=rank, op_id=1, chunk=2)
    return up, down


def _write_captures(d: Path) -> dict:
    """h1/h2 captures of r0 (Nezha both ways, a rendezvous-like flow) and r1 (each host's
    traffic with the switch, a PING from h1, a malformed flow from h2); the expected counts."""
    d.mkdir()
    r0 = _packets(R0["h1"], 41000, R0["h2"], 42000, _nezha_stream(0), 1.0, retransmit=2) + \
        _packets(R0["h2"], 42000, R0["h1"], 41000, _nezha_stream(1), 1.0) + \
        _packets(R0["h2"], 43000, R0["h1"], 29500, b'{"get": "rank0"}' * 10, 1.0)
    r1 = {}
    for h, addr, rank in (("h1", H1, 0), ("h2", H2, 1)):
        up, down = _agg_streams(rank)
        r1[h] = _packets(addr, 45000, SW, PORT, up, 2.0, retransmit=1) + \
            _packets(SW, PORT, addr, 45000, down, 2.0)
    ping, pong = aggwire.header(type=aggwire.PING), aggwire.control(aggwire.PONG, {"keys": 0})
    r1["h1"] += _packets(H1, 46000, SW, PORT, ping, 3.0) + _packets(SW, PORT, H1, 46000, pong, 3.0)
    r1["h2"] += _packets(H2, 47000, SW, PORT, b"GET / HTTP/1.1\r\n" * 4, 3.0)
    for h in ("h1", "h2"):                          # r0: both hosts capture every r0 packet
        wrpcap(str(d / f"{h}.r0.pcap"), r0)
        wrpcap(str(d / f"{h}.r1.pcap"), r1[h])
    (d / "capture.json").write_text(json.dumps({
        "rails": ["r0", "r1"], "hosts": {"h1": {"r0": R0["h1"], "r1": H1},
                                         "h2": {"r0": R0["h2"], "r1": H2}},
        "files": [{"host": h, "rail": r, "file": f"{h}.{r}.pcap"}
                  for h in ("h1", "h2") for r in ("r0", "r1")]}))
    streams = {h: _agg_streams(rank) for h, rank in (("h1", 0), ("h2", 1))}
    return {"r0_wire": sum(len(p) for p in r0),
            "r1_wire": sum(len(p) for h in r1 for p in r1[h]),
            "nezha_bytes": 2 * len(_nezha_stream(0)),
            "agg_bytes": sum(len(u) + len(d) for u, d in streams.values()) + len(ping) + len(pong),
            "contrib": 2 * 3 * len(contrib(0, 1, 0)), "result": 2 * 2 * len(contrib(0, 1, 0))}


def test_report_gives_bytes_per_protocol(tmp_path):
    exp = _write_captures(tmp_path / "captures")
    rep = analyse(tmp_path)
    text = format_report(rep)
    print(text)
    r0, r1 = rep["rails"]["r0"]["protocols"], rep["rails"]["r1"]["protocols"]
    assert set(r0) == {"nezha", "other"} and set(r1) == {"aggregation"}
    assert r0["nezha"]["frame_bytes"] == exp["nezha_bytes"] and r0["nezha"]["frames"] == 8
    agg = r1["aggregation"]
    assert agg["frame_bytes"] == exp["agg_bytes"] and agg["malformed"] == 1
    assert agg["types"]["CONTRIB"] == {"frames": 6, "bytes": exp["contrib"]}
    assert agg["types"]["RESULT"] == {"frames": 4, "bytes": exp["result"]}
    assert agg["types"]["ERROR"]["frames"] == 2 and agg["types"]["handshake"]["frames"] == 8
    assert agg["types"]["PING"]["frames"] == 2
    assert sum(g["bytes"] for g in agg["types"].values()) == agg["frame_bytes"]
    # every captured byte is counted once, under one protocol (r0 was captured twice)
    assert rep["rails"]["r0"]["wire_bytes"] == exp["r0_wire"] == \
        r0["nezha"]["wire_bytes"] + r0["other"]["wire_bytes"]
    assert rep["rails"]["r1"]["wire_bytes"] == exp["r1_wire"] == agg["wire_bytes"]
    assert rep["rails"]["r1"]["retrans_segments"] == 2
    tot = rep["protocols"]
    assert tot["nezha"]["frame_bytes"] == exp["nezha_bytes"]
    assert tot["aggregation"]["types"]["CONTRIB"]["bytes"] == exp["contrib"]
    # the TCP rail's existing figures are unchanged by the aggregation rail
    assert rep["rails"]["r0"]["data_bytes"] == 16000 == rep["data_bytes"]
    assert rep["rails"]["r0"]["chunks"] == 8 and rep["rails"]["r1"]["chunks"] == 0
    assert rep["rails"]["r1"]["frames"] == 0
    assert any("malformed aggregation frame at stream offset 0: bad magic" in u["error"]
               for u in rep["rails"]["r1"]["unparsed_flows"])
    lines = text.splitlines()
    assert any(l.split()[:3] == ["r1", "aggregation", "CONTRIB"] and
               l.split()[4] == str(exp["contrib"]) for l in lines)
    assert any(l.split()[:3] == ["total", "nezha", "all"] and
               l.split()[4] == str(exp["nezha_bytes"]) for l in lines)
    json.dumps(rep)
