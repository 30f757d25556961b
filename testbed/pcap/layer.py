"""What every frame header layer shares: a fixed header with a length and a trailing CRC.

Nezha (nezha/wire.py) and the aggregation protocol (nezha/aggwire.py) both lay out a header as
a big-endian struct that starts with a magic and a version and ends with a CRC-32 of the bytes
before it, and both carry a ``length`` field for the payload that follows. ``header_fields``
turns such a layout into scapy fields named as the wire module's ``Header`` names them, and
``FramedHeader`` fills ``length`` and ``crc`` when a layer is built without them, so a test can
craft a correct frame and then break exactly one field.
"""
from __future__ import annotations

import re
import struct
import zlib
from typing import Mapping, Optional, Sequence

from scapy.fields import (ByteEnumField, ByteField, Field, IntEnumField, IntField, LongField,
                          ShortEnumField, ShortField, StrFixedLenField, XIntField)

_PLAIN = {"B": ByteField, "H": ShortField, "I": IntField, "Q": LongField}
_ENUM = {"B": ByteEnumField, "H": ShortEnumField, "I": IntEnumField}


def header_fields(fmt: str, names: Sequence[str], magic: bytes, version: int,
                  defaults: Optional[Mapping[str, int]] = None,
                  enums: Optional[Mapping[str, dict]] = None) -> list[Field]:
    """scapy fields for a header laid out as ``fmt`` (struct codes, big-endian, no prefix):
    ``names[0]`` the magic, ``names[1]`` the version, the last the CRC; ``length`` and ``crc``
    default to None (computed when built), the rest to ``defaults`` or 0."""
    codes = re.findall(r"\d*[a-zA-Z]", fmt)
    assert len(codes) == len(names), (fmt, names)
    values = {names[0]: magic, names[1]: version, "length": None, names[-1]: None,
              **(defaults or {})}
    enums = enums or {}
    out: list[Field] = []
    for i, (code, name) in enumerate(zip(codes, names)):
        value = values.get(name, 0)
        if code.endswith("s"):
            out.append(StrFixedLenField(name, value, int(code[:-1])))
        elif i == len(names) - 1:
            out.append(XIntField(name, value))
        elif name in enums:
            out.append(_ENUM[code](name, value, enums[name]))
        else:
            out.append(_PLAIN[code](name, value))
    return out


class FramedHeader:
    """Mixin for a scapy ``Packet`` whose ``fields_desc`` comes from ``header_fields``."""

    @classmethod
    def header_size(cls) -> int:
        return sum(f.sz for f in cls.fields_desc)

    @classmethod
    def length_at(cls) -> int:
        """Byte offset of the 4-byte ``length`` field."""
        names = [f.name for f in cls.fields_desc]
        return sum(f.sz for f in cls.fields_desc[:names.index("length")])

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        if self.length is None:
            at = self.length_at()
            p = p[:at] + struct.pack("!I", len(pay)) + p[at + 4:]
        if self.crc is None:
            at = self.header_size() - 4
            p = p[:at] + struct.pack("!I", zlib.crc32(p[:at]))
        return p + pay

    def payload_length(self) -> int:
        """Payload bytes that follow this header on the wire."""
        return self.length

    def extract_padding(self, s: bytes):
        n = self.payload_length()
        return s[:n], s[n:]

    def crc_ok(self) -> bool:
        at = self.header_size() - 4
        raw = bytes(self)[:at + 4]
        return struct.unpack("!I", raw[at:])[0] == zlib.crc32(raw[:at])
