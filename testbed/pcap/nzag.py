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

from scapy.fields import (ByteEnumField, ByteField, IntEnumField, IntField, LongField,
                          ShortField, StrFixedLenField, XIntField)
from scapy.layers.inet import TCP
from scapy.packet import Packet, bind_layers

from nezha import aggwire, wire
from nezha.errors import ProtocolError

from testbed.pcap.layer import FramedHeader
from testbed.pcap.stream import Framer, Malformed

PORT = aggwire.DEFAULT_PORT
HANDSHAKE = (aggwire.HELLO, aggwire.CHALLENGE, aggwire.PROOF, aggwire.WELCOME)
GROUPS = ("CONTRIB", "RESULT", "ERROR", "handshake", "PING")   # PING's group holds PONG too


class NZAG(FramedHeader, Packet):
    """The aggregation frame header; the payload (``length`` bytes) follows as Raw."""

    name = "NZAG"
    LENGTH_AT = 28                      # see the layout in nezha/aggwire.py
    HEADER_SIZE = aggwire.HEADER_SIZE
    fields_desc = [
        StrFixedLenField("magic", aggwire.MAGIC, len(aggwire.MAGIC)),
        ByteField("version", aggwire.VERSION),
        ByteEnumField("type", aggwire.CONTRIB, aggwire.TYPE_NAMES),
        ByteEnumField("dtype", 0, wire.DTYPES),
        ByteEnumField("redop", 0, aggwire.REDOPS),
        ShortField("rank", 0),
        ShortField("world", 0),
        IntField("count", 0),
        LongField("op_id", 0),
        IntField("chunk", 0),
        IntField("length", None),
        IntEnumField("code", 0, aggwire.ERROR_NAMES),
        LongField("reserved", 0),
        XIntField("crc", None),
    ]

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


assert sum(f.sz for f in NZAG.fields_desc) == aggwire.HEADER_SIZE, "NZAG layer != nezha.aggwire"
assert NZAG.fields_desc[10].name == "length" and \
    sum(f.sz for f in NZAG.fields_desc[:10]) == NZAG.LENGTH_AT
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
