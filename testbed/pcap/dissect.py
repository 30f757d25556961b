"""Nezha frames on the wire: a scapy layer for the frame header and a TCP stream reassembler.

``Nezha`` is a scapy ``Packet`` with the header of ``nezha/wire.py`` (64 bytes, big-endian);
every constant (magic, version, type/kind/dtype/redop codes, header size) comes from
``nezha.wire``. Building a ``Nezha`` fills ``length`` and ``crc`` unless given, so a test can
craft a correct frame and then break exactly one field (``Nezha(magic=b"XXXX")``,
``Nezha(version=9)``, ``Nezha(crc=0)``...).

Frames are not aligned to TCP segments (a 512 KiB chunk spans dozens of segments, a segment may
hold the end of one frame and the start of the next), so ``Reassembler`` orders each flow's bytes
by TCP sequence number and cuts frames from the byte stream. A segment whose bytes were all seen
before is a retransmission (counted, not re-parsed). Packets are decoded with ``struct`` up to
TCP (fast enough for captures of hundreds of MB); Nezha headers are dissected with the layer.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from scapy.fields import (ByteEnumField, ByteField, IntField, LongField, ShortField,
                          StrFixedLenField, XIntField)
from scapy.packet import Packet, Raw
from scapy.utils import RawPcapReader

from nezha import wire

_CRC_AT = wire.HEADER_SIZE - 4          # crc covers bytes 0 .. HEADER_SIZE - 4
_LENGTH_AT = 40                          # see the layout in nezha/wire.py
WITH_PAYLOAD = (wire.DATA, wire.HELLO, wire.AUTH, wire.ABORT, wire.CONTROL)


class Nezha(Packet):
    """The Nezha frame header (nezha/wire.py); the payload (``length`` bytes) follows as Raw."""

    name = "Nezha"
    fields_desc = [
        StrFixedLenField("magic", wire.MAGIC, len(wire.MAGIC)),
        ByteField("version", wire.VERSION),
        ByteEnumField("type", wire.DATA, wire.TYPE_NAMES),
        ByteEnumField("kind", wire.K_NONE, wire.KIND_NAMES),
        ByteEnumField("dtype", 0, wire.DTYPES),
        ByteEnumField("redop", 0, wire.REDOPS),
        ByteField("rail", 0),
        ShortField("src", 0),
        IntField("aux", 0),
        LongField("op_id", 0),
        IntField("step", 0),
        IntField("chunk", 0),
        LongField("offset", 0),
        IntField("length", None),
        LongField("msg_total", 0),
        LongField("op_total", 0),
        XIntField("crc", None),
    ]

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        if self.length is None:
            p = p[:_LENGTH_AT] + struct.pack("!I", len(pay)) + p[_LENGTH_AT + 4:]
        if self.crc is None:
            p = p[:_CRC_AT] + struct.pack("!I", zlib.crc32(p[:_CRC_AT]))
        return p + pay

    def extract_padding(self, s: bytes):
        n = self.length if self.type in WITH_PAYLOAD else 0
        return s[:n], s[n:]

    def crc_ok(self) -> bool:
        raw = bytes(self)[:wire.HEADER_SIZE]
        return struct.unpack("!I", raw[_CRC_AT:wire.HEADER_SIZE])[0] == zlib.crc32(raw[:_CRC_AT])

    def mysummary(self) -> str:
        return self.sprintf("Nezha %type% src=%src% rail=%rail% op=%op_id% step=%step% "
                            "chunk=%chunk% off=%offset% len=%length%")


assert sum(f.sz for f in Nezha.fields_desc) == wire.HEADER_SIZE, "Nezha layer != nezha.wire"


def frame(payload: bytes = b"", **fields) -> bytes:
    """Bytes of one frame: a header built from ``fields`` (defaults: a valid DATA frame) and the
    payload. ``length``/``crc`` are computed unless given (give them to break them)."""
    return bytes(Nezha(**fields) / Raw(payload)) if payload else bytes(Nezha(**fields))


# ------------------------------------------------------------------------ packets -> flows
Flow = tuple  # (src ip, src port, dst ip, dst port)


@dataclass
class Segment:
    t: float
    flow: Flow
    seq: int
    flags: int
    payload: bytes
    wire_len: int


def tcp_segments(path: str) -> Iterator[Segment]:
    """TCP/IPv4 segments of a pcap file (Ethernet link type), decoded with struct."""
    with RawPcapReader(path) as reader:
        for data, meta in reader:
            if len(data) < 34 or data[12:14] != b"\x08\x00":
                continue
            ip = 14
            ihl = (data[ip] & 0x0F) * 4
            if data[ip + 9] != 6:
                continue
            total = struct.unpack_from("!H", data, ip + 2)[0]
            src, dst = data[ip + 12:ip + 16], data[ip + 16:ip + 20]
            tcp = ip + ihl
            sport, dport, seq = struct.unpack_from("!HHI", data, tcp)
            off = (data[tcp + 12] >> 4) * 4
            flags = data[tcp + 13]
            payload = bytes(data[tcp + off:ip + total])
            t = meta.sec + meta.usec / 1e6 if hasattr(meta, "sec") else \
                meta.tshigh * 4294967296 / 1e6 + meta.tslow / 1e6
            yield Segment(t, (_ip(src), sport, _ip(dst), dport), seq, flags, payload,
                          meta.wirelen)


def _ip(b: bytes) -> str:
    return ".".join(str(x) for x in b)


@dataclass
class FrameRecord:
    """One Nezha frame cut from a flow's byte stream."""

    flow: Flow
    rail: str                      # the capture's rail (interface) name
    t: float                       # time of the segment that completed the header
    header: Nezha
    stream_offset: int             # where the frame starts in the flow's byte stream

    @property
    def type_name(self) -> str:
        return wire.TYPE_NAMES.get(self.header.type, str(self.header.type))


@dataclass
class FlowState:
    flow: Flow
    rail: str
    isn: Optional[int] = None
    next: int = 0                          # next expected stream offset
    buf: bytearray = field(default_factory=bytearray)
    buf_at: int = 0                        # stream offset of buf[0]
    skip: int = 0                          # payload bytes still to drop
    pending: dict = field(default_factory=dict)  # out-of-order: offset -> bytes
    segments: int = 0
    bytes: int = 0                         # unique payload bytes
    wire_bytes: int = 0                    # every captured frame of the flow, retransmits too
    retrans_segments: int = 0
    retrans_bytes: int = 0
    frames: int = 0
    error: Optional[str] = None            # the stream stopped parsing here (not Nezha, garbage)


class Reassembler:
    """Feed TCP segments of one capture (one rail); get Nezha frames per (flow, rail)."""

    def __init__(self, rail: str) -> None:
        self.rail = rail
        self.flows: dict[Flow, FlowState] = {}

    def feed(self, seg: Segment) -> list[FrameRecord]:
        st = self.flows.get(seg.flow)
        if st is None:
            st = self.flows[seg.flow] = FlowState(seg.flow, self.rail)
        st.wire_bytes += seg.wire_len
        syn = seg.flags & 0x02
        if st.isn is None:
            if syn:
                st.isn = (seg.seq + 1) & 0xFFFFFFFF
            elif seg.payload:
                st.isn = seg.seq          # capture started mid-flow: start here
                st.error = st.error or "capture started mid-stream"
            else:
                return []
        if not seg.payload:
            return []
        st.segments += 1
        rel = (seg.seq - st.isn) & 0xFFFFFFFF
        end = rel + len(seg.payload)
        if end <= st.next:                 # every byte already seen: a retransmission
            st.retrans_segments += 1
            st.retrans_bytes += len(seg.payload)
            return []
        if rel > st.next:                  # a hole before it: keep for later
            st.pending[rel] = seg.payload
            return []
        if rel < st.next:                  # partly new (a retransmission that grew)
            st.retrans_bytes += st.next - rel
            seg_payload = seg.payload[st.next - rel:]
        else:
            seg_payload = seg.payload
        out = self._append(st, seg_payload, seg.t)
        while st.pending:                  # fill from out-of-order segments
            progressed = False
            for off in sorted(st.pending):
                data = st.pending[off]
                if off + len(data) <= st.next:
                    del st.pending[off]
                    st.retrans_segments += 1
                    st.retrans_bytes += len(data)
                    progressed = True
                elif off <= st.next:
                    del st.pending[off]
                    out += self._append(st, data[st.next - off:], seg.t)
                    progressed = True
                break
            if not progressed:
                break
        return out

    def _append(self, st: FlowState, data: bytes, t: float) -> list[FrameRecord]:
        st.next += len(data)
        st.bytes += len(data)
        if st.error:                       # mid-stream start or garbage: no frame boundaries
            return []
        if st.skip:
            k = min(st.skip, len(data))
            st.skip -= k
            st.buf_at += k
            data = data[k:]
        st.buf += data
        out = []
        H = wire.HEADER_SIZE
        while len(st.buf) >= H and st.skip == 0:
            raw = bytes(st.buf[:H])
            if raw[:len(wire.MAGIC)] != wire.MAGIC:
                st.error = f"not a Nezha frame at stream offset {st.buf_at}: {raw[:8]!r}"
                st.buf.clear()
                return out
            hdr = Nezha(raw)
            n = hdr.length if hdr.type in WITH_PAYLOAD else 0
            out.append(FrameRecord(st.flow, st.rail, t, hdr, st.buf_at))
            st.frames += 1
            del st.buf[:H]
            st.buf_at += H
            take = min(n, len(st.buf))
            del st.buf[:take]
            st.buf_at += take
            st.skip = n - take
        return out


def frames_in(path: str, rail: str, flows: Optional[Iterable[Flow]] = None
              ) -> tuple[list[FrameRecord], Reassembler]:
    """Every Nezha frame in one capture file (frames of ``flows`` only, if given)."""
    wanted = set(flows) if flows is not None else None
    ra = Reassembler(rail)
    out: list[FrameRecord] = []
    for seg in tcp_segments(path):
        if wanted is not None and seg.flow not in wanted:
            continue
        out += ra.feed(seg)
    return out, ra
