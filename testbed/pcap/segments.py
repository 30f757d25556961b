"""TCP/IPv4 segments of a pcap file, decoded with ``struct`` (not scapy).

A capture of a busy rail holds hundreds of MB; building a scapy packet per record would take
minutes on two cores, so packets are decoded up to TCP by hand and only frame headers (cut
from the reassembled byte stream, testbed/pcap/stream.py) go through scapy layers.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

from scapy.utils import RawPcapReader

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
            if len(data) < tcp + 20:       # cut short (snaplen): no TCP header to read
                continue
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
