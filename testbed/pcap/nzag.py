"""Aggregation frames on the wire: a scapy layer for the NZAG header (nezha/aggwire.py).

``NZAG`` has every field of aggwire's 48-byte header under aggwire's names; every constant
(magic, version, type/error codes, header size, bounds) comes from ``nezha.aggwire``, and the
layer is bound to TCP port ``aggwire.DEFAULT_PORT`` in both directions, so scapy dissects a
captured packet to and from an aggregation switch as ``IP / TCP / NZAG``.

A header is valid when ``aggwire.unpack`` (what the switch and the ranks run) accepts it: magic,
version, CRC, known type, lengths within aggwire's bounds. Anything else is a *malformed* frame:
``NZAG.problem()`` says why, and the stream framer records it (never raises, never reads a
length it has not checked).
"""
from __future__ import annotations

from typing import Optional

from scapy.layers.inet import TCP
from scapy.packet import Packet, bind_layers

from nezha import aggwire, wire
from nezha.errors import ProtocolError

from testbed.pcap.layer import FramedHeader, header_fields
from testbed.pcap.stream import Framer, Malformed

PORT = aggwire.DEFAULT_PORT
HANDSHAKE = (aggwire.HELLO, aggwire.CHALLENGE, aggwire.PROOF, aggwire.WELCOME)
GROUPS = ("CONTRIB", "RESULT", "ERROR", "handshake", "PING")   # PING's group holds PONG too


class NZAG(FramedHeader, Packet):
    """The aggregation frame header; the payload (``length`` bytes) follows as Raw."""

    name = "NZAG"
    fields_desc = header_fields(
        "4sBBBBHHIQIIIQI", ("magic", "version", *aggwire.Header._fields, "reserved", "crc"),
        aggwire.MAGIC, aggwire.VERSION, defaults={"type": aggwire.CONTRIB},
        enums={"type": aggwire.TYPE_NAMES, "dtype": wire.DTYPES, "redop": aggwire.REDOPS,
               "code": aggwire.ERROR_NAMES})

    def problem(self) -> Optional[str]:
        """Why this header is malformed (aggwire.unpack's reason), or None if it is valid."""
        raw = bytes(self)[:aggwire.HEADER_SIZE]
        try:
            aggwire.unpack(raw)
        except ProtocolError as e:
            return str(e)
        return None

    def mysummary(self) -> str:
        return self.sprintf("NZAG %type% rank=%rank%/%world% op=%op_id% chunk=%chunk% "
                            "count=%count% len=%length% code=%code%")


assert NZAG.header_size() == aggwire.HEADER_SIZE, "NZAG layer != nezha.aggwire"
bind_layers(TCP, NZAG, sport=PORT)
bind_layers(TCP, NZAG, dport=PORT)


def group_of(type_: int) -> str:
    """The accounting group of an aggregation frame type (one of ``GROUPS``)."""
    if type_ in HANDSHAKE:
        return "handshake"
    if type_ in (aggwire.PING, aggwire.PONG):
        return "PING"
    return aggwire.TYPE_NAMES[type_]


class AggregationFramer(Framer):
    """Cuts NZAG frames from a flow to or from an aggregation switch's port."""

    protocol = "aggregation"
    header_size = aggwire.HEADER_SIZE
    owns_flow = True

    def parse(self, raw: bytes, at: int) -> tuple[Packet, int]:
        try:
            h = aggwire.unpack(raw)
        except ProtocolError as e:
            raise Malformed(f"malformed aggregation frame at stream offset {at}: {e}") from None
        return NZAG(raw), h.length

    def type_name(self, hdr: Packet) -> str:
        return aggwire.TYPE_NAMES[hdr.type]

    def group(self, hdr: Packet) -> Optional[str]:
        return group_of(hdr.type)


AGGREGATION = AggregationFramer()
