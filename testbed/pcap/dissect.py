"""Nezha frames on the wire: a scapy layer for the frame header, and frames cut from captures.

``Nezha`` is a scapy ``Packet`` with the header of ``nezha/wire.py`` (64 bytes, big-endian);
every constant (magic, version, type/kind/dtype/redop codes, header size) comes from
``nezha.wire``. Building a ``Nezha`` fills ``length`` and ``crc`` unless given, so a test can
craft a correct frame and then break exactly one field (``Nezha(magic=b"XXXX")``,
``Nezha(version=9)``, ``Nezha(crc=0)``...).

A capture's flows are cut into frames by ``Reassembler`` (testbed/pcap/stream.py) with the
framer of the flow's protocol: aggregation frames (testbed/pcap/nzag.py) on a flow to or from
an aggregation switch's port, Nezha frames on every other flow (a flow whose first bytes are
not a Nezha header is another protocol: the rendezvous store, iperf3...).
"""
from __future__ import annotations

from typing import Iterable, Optional

from scapy.packet import Packet, Raw

from nezha import wire

from testbed.pcap import stream
from testbed.pcap.layer import FramedHeader, header_fields
from testbed.pcap.nzag import AGGREGATION, PORT as AGGREGATION_PORT
from testbed.pcap.segments import Flow, Segment, tcp_segments
from testbed.pcap.stream import FlowState, Framer, FrameRecord, Malformed

__all__ = ["Flow", "FlowState", "FrameRecord", "NEZHA", "Nezha", "Reassembler", "Segment",
           "WITH_PAYLOAD", "frame", "framer_for", "frames_in", "tcp_segments"]

WITH_PAYLOAD = (wire.DATA, wire.HELLO, wire.AUTH, wire.ABORT, wire.CONTROL)


class Nezha(FramedHeader, Packet):
    """The Nezha frame header (nezha/wire.py); the payload (``length`` bytes) follows as Raw."""

    name = "Nezha"
    fields_desc = header_fields(
        "4sBBBBBBHIQIIQIQQI", ("magic", "version", *wire.Header._fields, "crc"),
        wire.MAGIC, wire.VERSION, defaults={"type": wire.DATA},
        enums={"type": wire.TYPE_NAMES, "kind": wire.KIND_NAMES, "dtype": wire.DTYPES,
               "redop": wire.REDOPS})

    def payload_length(self) -> int:
        return self.length if self.type in WITH_PAYLOAD else 0

    def mysummary(self) -> str:
        return self.sprintf("Nezha %type% src=%src% rail=%rail% op=%op_id% step=%step% "
                            "chunk=%chunk% off=%offset% len=%length%")


assert Nezha.header_size() == wire.HEADER_SIZE, "Nezha layer != nezha.wire"


def frame(payload: bytes = b"", **fields) -> bytes:
    """Bytes of one frame: a header built from ``fields`` (defaults: a valid DATA frame) and the
    payload. ``length``/``crc`` are computed unless given (give them to break them)."""
    return bytes(Nezha(**fields) / Raw(payload)) if payload else bytes(Nezha(**fields))


class NezhaFramer(Framer):
    """Cuts Nezha frames from a flow; only the magic is checked (a capture shows what was
    sent, the receiver judges the rest)."""

    protocol = "nezha"
    header_size = wire.HEADER_SIZE

    def parse(self, raw: bytes, at: int) -> tuple[Packet, int]:
        if raw[:len(wire.MAGIC)] != wire.MAGIC:
            raise Malformed(f"not a Nezha frame at stream offset {at}: {raw[:8]!r}")
        hdr = Nezha(raw)
        return hdr, hdr.payload_length()

    def type_name(self, hdr: Packet) -> str:
        return wire.TYPE_NAMES.get(hdr.type, str(hdr.type))


NEZHA = NezhaFramer()


def framer_for(flow: Flow) -> Framer:
    """The protocol of a flow, by its ports: aggregation to or from a switch's port, else Nezha."""
    return AGGREGATION if AGGREGATION_PORT in (flow[1], flow[3]) else NEZHA


class Reassembler(stream.Reassembler):
    """A capture's reassembler with the protocols this testbed speaks (``framer_for``)."""

    def __init__(self, rail: str) -> None:
        super().__init__(rail, framer_for)


def frames_in(path: str, rail: str, flows: Optional[Iterable[Flow]] = None
              ) -> tuple[list[FrameRecord], Reassembler]:
    """Every frame in one capture file (frames of ``flows`` only, if given)."""
    wanted = set(flows) if flows is not None else None
    ra = Reassembler(rail)
    out: list[FrameRecord] = []
    for seg in tcp_segments(path):
        if wanted is not None and seg.flow not in wanted:
            continue
        out += ra.feed(seg)
    return out, ra
