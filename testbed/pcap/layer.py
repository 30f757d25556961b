"""What every frame header layer shares: a fixed header with a length and a trailing CRC.

Nezha (nezha/wire.py) and the aggregation protocol (nezha/aggwire.py) both end their header
with a CRC-32 of the bytes before it and carry a ``length`` field for the payload that follows.
Building a layer fills both unless given, so a test can craft a correct frame and then break
exactly one field.
"""
from __future__ import annotations

import struct
import zlib


class FramedHeader:
    """Mixin for a scapy ``Packet``: ``LENGTH_AT`` is the byte offset of the 4-byte ``length``
    field, ``HEADER_SIZE`` the header's size (its last 4 bytes are the CRC)."""

    LENGTH_AT: int
    HEADER_SIZE: int

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        if self.length is None:
            p = p[:self.LENGTH_AT] + struct.pack("!I", len(pay)) + p[self.LENGTH_AT + 4:]
        if self.crc is None:
            at = self.HEADER_SIZE - 4
            p = p[:at] + struct.pack("!I", zlib.crc32(p[:at]))
        return p + pay

    def payload_length(self) -> int:
        """Payload bytes that follow this header on the wire."""
        return self.length

    def extract_padding(self, s: bytes):
        n = self.payload_length()
        return s[:n], s[n:]

    def crc_ok(self) -> bool:
        raw = bytes(self)[:self.HEADER_SIZE]
        at = self.HEADER_SIZE - 4
        return struct.unpack("!I", raw[at:])[0] == zlib.crc32(raw[:at])
