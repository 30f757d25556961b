"""Frames cut from TCP byte streams: a per-flow reassembler that any frame protocol plugs into.

Frames are not aligned to TCP segments (a 512 KiB chunk spans dozens of segments, a segment may
hold the end of one frame and the start of the next), so ``Reassembler`` orders each flow's bytes
by TCP sequence number and cuts frames from the byte stream with the flow's ``Framer`` (chosen
per flow, e.g. by port). A segment whose bytes were all seen before is a retransmission
(counted, not re-parsed). Payloads are skipped, never buffered: memory per flow is one header,
one segment and, while a hole waits for its retransmission, at most ``MAX_PENDING`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from scapy.packet import Packet

from testbed.pcap.segments import Flow, Segment

MAX_PENDING = 32 << 20       # out-of-order bytes held per flow before it is given up


class Malformed(Exception):
    """Bytes where a frame header belongs that are not a valid one (the message says why)."""


class Framer:
    """One frame protocol: how to read a header, what its frames are called.

    ``owns_flow``: the flow is this protocol's by its port, so a header that does not parse is
    a malformed frame (recorded as such); otherwise it means the flow speaks something else."""

    protocol = "?"
    header_size = 0
    owns_flow = False

    def parse(self, raw: bytes, at: int) -> tuple[Packet, int]:
        """(header layer, payload bytes that follow) of ``raw`` (``header_size`` bytes at stream
        offset ``at``); raises Malformed."""
        raise NotImplementedError

    def type_name(self, hdr: Packet) -> str:
        return str(hdr.type)

    def group(self, hdr: Packet) -> Optional[str]:
        """The accounting group of a frame (None: the protocol is counted as a whole)."""
        return None


@dataclass
class FrameRecord:
    """One frame cut from a flow's byte stream (``header`` None: a malformed one)."""

    flow: Flow
    rail: str                      # the capture's rail (interface) name
    t: float                       # time of the segment that completed the header
    header: Optional[Packet]
    stream_offset: int             # where the frame starts in the flow's byte stream
    protocol: str = "nezha"
    type_name: str = "?"
    group: Optional[str] = None
    size: int = 0                  # header + payload bytes
    malformed: Optional[str] = None


@dataclass
class FlowState:
    flow: Flow
    rail: str
    framer: Framer
    isn: Optional[int] = None
    next: int = 0                          # next expected stream offset
    buf: bytearray = field(default_factory=bytearray)
    buf_at: int = 0                        # stream offset of buf[0]
    skip: int = 0                          # payload bytes still to drop
    pending: dict = field(default_factory=dict)  # out-of-order: offset -> bytes
    pending_bytes: int = 0
    segments: int = 0
    bytes: int = 0                         # unique payload bytes
    wire_bytes: int = 0                    # every captured frame of the flow, retransmits too
    retrans_segments: int = 0
    retrans_bytes: int = 0
    frames: int = 0
    malformed: int = 0
    error: Optional[str] = None            # the stream stopped parsing here
    foreign: bool = False                  # its first bytes were not the framer's protocol

    @property
    def protocol(self) -> str:
        return "other" if self.foreign else self.framer.protocol


class Reassembler:
    """Feed TCP segments of one capture (one rail); get frames per (flow, rail)."""

    def __init__(self, rail: str, framer_for: Callable[[Flow], Framer]) -> None:
        self.rail = rail
        self.framer_for = framer_for
        self.flows: dict[Flow, FlowState] = {}

    def feed(self, seg: Segment) -> list[FrameRecord]:
        st = self.flows.get(seg.flow)
        if st is None:
            st = self.flows[seg.flow] = FlowState(seg.flow, self.rail, self.framer_for(seg.flow))
        st.wire_bytes += seg.wire_len
        if st.isn is None and not self._start(st, seg):
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
            self._hold(st, rel, seg.payload)
            return []
        if rel < st.next:                  # partly new (a retransmission that grew)
            st.retrans_bytes += st.next - rel
        out = self._append(st, seg.payload[st.next - rel:], seg.t)
        return out + self._drain(st, seg.t)

    @staticmethod
    def _start(st: FlowState, seg: Segment) -> bool:
        """Set the flow's initial sequence number; False while there is none to set."""
        if seg.flags & 0x02:
            st.isn = (seg.seq + 1) & 0xFFFFFFFF
        elif seg.payload:
            st.isn = seg.seq               # capture started mid-flow: start here
            st.error = st.error or "capture started mid-stream"
        return st.isn is not None

    @staticmethod
    def _hold(st: FlowState, rel: int, payload: bytes) -> None:
        """Keep an out-of-order segment, unless the hole has held too much already."""
        if st.pending_bytes + len(payload) > MAX_PENDING:
            st.error = st.error or (f"hole in the capture at stream offset {st.next} "
                                    f"(more than {MAX_PENDING} bytes after it)")
            st.pending.clear()
            st.pending_bytes = 0
            return
        if rel not in st.pending:
            st.pending[rel] = payload
            st.pending_bytes += len(payload)

    def _drain(self, st: FlowState, t: float) -> list[FrameRecord]:
        """Append the out-of-order segments the stream has now reached."""
        out: list[FrameRecord] = []
        while st.pending:
            off = min(st.pending)
            if off > st.next:
                break
            data = st.pending.pop(off)
            st.pending_bytes -= len(data)
            if off + len(data) <= st.next:
                st.retrans_segments += 1
                st.retrans_bytes += len(data)
            else:
                out += self._append(st, data[st.next - off:], t)
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
        H = st.framer.header_size
        while len(st.buf) >= H and st.skip == 0:
            rec = self._cut(st, bytes(st.buf[:H]), t)
            if rec is not None:
                out.append(rec)
            if st.error:
                return out
            del st.buf[:H]
            st.buf_at += H
            n = rec.size - H
            take = min(n, len(st.buf))
            del st.buf[:take]
            st.buf_at += take
            st.skip = n - take
        return out

    @staticmethod
    def _cut(st: FlowState, raw: bytes, t: float) -> Optional[FrameRecord]:
        """The frame whose header is ``raw``. If it is none, the flow stops parsing (``error``)
        and, on a flow that is the framer's own, the answer is a malformed record."""
        fr = st.framer
        try:
            hdr, n = fr.parse(raw, st.buf_at)
        except Malformed as e:
            st.error = str(e)
            st.buf.clear()
            if not fr.owns_flow:
                st.foreign = st.buf_at == 0 and st.frames == 0
                return None
            st.malformed += 1
            return FrameRecord(st.flow, st.rail, t, None, st.buf_at, fr.protocol, "malformed",
                               "malformed", 0, str(e))
        st.frames += 1
        return FrameRecord(st.flow, st.rail, t, hdr, st.buf_at, fr.protocol, fr.type_name(hdr),
                           fr.group(hdr), fr.header_size + n)
