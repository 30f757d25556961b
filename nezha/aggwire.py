"""Aggregation wire format: what a rank and an aggregation switch (testbed/aggregation) say.

A rank sends its contribution for (job, op_id, chunk); once every rank of the job has sent
its own, the switch reduces them and sends the one result to every contributor. Frames are a
fixed 48-byte header, optionally followed by a payload. Integers are big-endian; payload
elements are little-endian (numpy's native order on every machine this runs on). Layout
(byte offset, size, field)::

     0  4  magic     b"NZAG"
     4  1  version   1
     5  1  type      1 HELLO, 2 CHALLENGE, 3 PROOF, 4 WELCOME, 5 CONTRIB, 6 RESULT, 7 ERROR,
                     8 PING, 9 PONG
     6  1  dtype     nezha.wire's codes: 1 float32, 2 float64, 3 float16, 4 int32, 5 int64,
                     6 uint8, 7 int8, 8 uint32, 9 uint64, 10 int16, 11 uint16 (0: none)
     7  1  redop     1 sum, 2 max, 3 min (0: none)
     8  2  rank      the sender's rank (CONTRIB), the addressee's (RESULT / ERROR)
    10  2  world     ranks in the job (every CONTRIB of a key must agree)
    12  4  count     elements in the payload (CONTRIB / RESULT)
    16  8  op_id     the collective's sequence number (the same on every rank)
    24  4  chunk     chunk index within the operation
    28  4  length    payload bytes after the header
    32  4  code      ERROR: one of the E_* codes; 0 otherwise
    36  8  reserved  0
    44  4  crc       CRC-32 (zlib) of bytes 0..43

Handshake (``nezha.auth``'s challenge-response under labels of its own), first thing on every
connection, JSON payloads::

    rank   -> switch  HELLO     {job, rank, world, nonce Nr}
    switch -> rank    CHALLENGE {nonce Ns, proof HMAC(K, "nezha-agg-switch", T)}
    rank   -> switch  PROOF     {proof HMAC(K, "nezha-agg-rank", T)}
    switch -> rank    WELCOME   {}          (or ERROR and close)

with T = (Nr, Ns, job, rank, world): a proof is bound to both nonces and to who is talking,
so it cannot be replayed or reflected. Without a job secret K is empty (nothing is proved).
A PING as the first frame (instead of HELLO) gets one PONG {version, keys, bytes} and nothing
else: the fabric reads a service back with it, no secret needed, no data exposed.

After WELCOME: CONTRIB frames (rank = the authenticated rank, else refused); the switch
answers RESULT (payload: the reduced elements) for a completed key, or ERROR (payload UTF-8
reason) for one contribution it refused or a key it gave up (E_TIMEOUT). An ERROR with
op_id = chunk = 0 and code E_PROTOCOL ends the connection.
"""
from __future__ import annotations

import json
import socket
import struct
import zlib
from typing import Any, NamedTuple

import numpy as np

from .errors import ProtocolError
from .wire import DTYPES, DTYPE_CODES

MAGIC = b"NZAG"
VERSION = 1
DEFAULT_PORT = 29400         # the aggregation service's port on every aggregation rail

HELLO, CHALLENGE, PROOF, WELCOME, CONTRIB, RESULT, ERROR, PING, PONG = range(1, 10)
TYPE_NAMES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", PROOF: "PROOF", WELCOME: "WELCOME",
              CONTRIB: "CONTRIB", RESULT: "RESULT", ERROR: "ERROR", PING: "PING", PONG: "PONG"}
CONTROL_TYPES = (HELLO, CHALLENGE, PROOF, WELCOME, ERROR, PING, PONG)
DATA_TYPES = (CONTRIB, RESULT)

REDOPS = {1: "sum", 2: "max", 3: "min"}
REDOP_CODES = {name: code for code, name in REDOPS.items()}

# ERROR codes: why a contribution or a key was refused
E_PROTOCOL, E_AUTH, E_MISMATCH, E_DUPLICATE, E_BUSY, E_TIMEOUT, E_LIMIT = range(1, 8)
ERROR_NAMES = {E_PROTOCOL: "protocol", E_AUTH: "auth", E_MISMATCH: "mismatch",
               E_DUPLICATE: "duplicate", E_BUSY: "busy", E_TIMEOUT: "timeout",
               E_LIMIT: "limit"}

_BODY = struct.Struct("!4sBBBBHHIQIIIQ")
_CRC = struct.Struct("!I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 48

MAX_CHUNK = 16 << 20         # payload bytes of one CONTRIB / RESULT
MAX_CONTROL = 4 << 10        # payload bytes of a handshake / ERROR / PONG frame
MAX_WORLD = 4096             # ranks in one job


class Header(NamedTuple):
    """The fields after magic and version, in wire order (see the layout above)."""
    type: int
    dtype: int = 0
    redop: int = 0
    rank: int = 0
    world: int = 0
    count: int = 0
    op_id: int = 0
    chunk: int = 0
    length: int = 0
    code: int = 0

    def pack(self) -> bytes:
        body = _BODY.pack(MAGIC, VERSION, *self, 0)
        return body + _CRC.pack(zlib.crc32(body))

    @property
    def key(self) -> tuple[int, int]:
        return self.op_id, self.chunk

    def describe(self) -> str:
        return (f"{TYPE_NAMES.get(self.type, self.type)} rank={self.rank}/{self.world} "
                f"op={self.op_id} chunk={self.chunk} count={self.count} len={self.length}")


def header(**fields: int) -> bytes:
    """A header built by keyword only, so a field can never be taken for its neighbour."""
    return Header(**fields).pack()


def control(type_: int, body: dict[str, Any], **fields: int) -> bytes:
    """A control frame: header plus a JSON payload (bounded by MAX_CONTROL)."""
    payload = json.dumps(body).encode()
    if len(payload) > MAX_CONTROL:
        raise ValueError(f"control payload of {len(payload)} bytes (at most {MAX_CONTROL})")
    return Header(type_, length=len(payload), **fields).pack() + payload


def error(code: int, reason: str, **fields: int) -> bytes:
    """An ERROR frame: the reason as UTF-8, cut to fit MAX_CONTROL."""
    payload = reason.encode()[:MAX_CONTROL]
    return Header(ERROR, code=code, length=len(payload), **fields).pack() + payload


def unpack(data: bytes | bytearray | memoryview, max_chunk: int = MAX_CHUNK,
           max_world: int = MAX_WORLD) -> Header:
    """Parse and validate a header, lengths included, before any payload is read (so nothing
    is ever allocated from an unchecked length). Raises ProtocolError."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"truncated aggregation header: {len(data)} of {HEADER_SIZE} bytes")
    body = bytes(data[:_BODY.size])
    magic, version, *values, _reserved = _BODY.unpack(body)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r}): not an aggregation peer")
    if version != VERSION:
        raise ProtocolError(f"unsupported aggregation wire version {version} "
                            f"(this side speaks {VERSION})")
    if _CRC.unpack(bytes(data[_BODY.size:]))[0] != zlib.crc32(body):
        raise ProtocolError("aggregation header checksum mismatch")
    h = Header._make(values)
    if h.type not in TYPE_NAMES:
        raise ProtocolError(f"unknown aggregation frame type {h.type}")
    if h.type in DATA_TYPES:
        _check_data(h, max_chunk, max_world)
    elif h.length > MAX_CONTROL:
        raise ProtocolError(f"{TYPE_NAMES[h.type]} payload of {h.length} bytes "
                            f"(at most {MAX_CONTROL})")
    return h


def _check_data(h: Header, max_chunk: int, max_world: int) -> None:
    """A CONTRIB / RESULT: known dtype and op, a world and rank in range, a payload of exactly
    count elements, at most max_chunk bytes."""
    if h.dtype not in DTYPE_CODES.values():
        raise ProtocolError(f"unknown dtype code {h.dtype} (expected one of "
                            f"{sorted(DTYPE_CODES.values())})")
    if h.redop not in REDOPS:
        raise ProtocolError(f"unknown reduction code {h.redop} (expected one of {sorted(REDOPS)})")
    if not 1 <= h.world <= max_world:
        raise ProtocolError(f"world size {h.world} (expected 1 to {max_world})")
    if h.rank >= h.world:
        raise ProtocolError(f"rank {h.rank} outside a world of {h.world}")
    if h.length > max_chunk:
        raise ProtocolError(f"chunk of {h.length} bytes (at most {max_chunk})")
    if h.length != h.count * dtype_of(h.dtype).itemsize or h.count == 0:
        raise ProtocolError(f"{h.count} elements of {DTYPES[h.dtype]} in {h.length} bytes")


def dtype_of(code: int) -> np.dtype:
    """The numpy dtype (little-endian) of a wire dtype code."""
    return np.dtype(DTYPES[code]).newbyteorder("<")


def dtype_code(dtype: Any) -> int:
    """The wire code of a numpy dtype; ValueError naming the valid ones."""
    name = np.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise ValueError(f"dtype {name} cannot be aggregated; expected one of "
                         f"{', '.join(sorted(DTYPE_CODES))}")
    return DTYPE_CODES[name]


def redop_code(op: str) -> int:
    if op not in REDOP_CODES:
        raise ValueError(f"reduction {op!r} cannot be aggregated; expected one of "
                         f"{', '.join(REDOP_CODES)}")
    return REDOP_CODES[op]


def parse_json(payload: bytes, what: str) -> dict:
    """A control payload as a JSON object, or ProtocolError naming the frame."""
    try:
        body = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"{what}: not a JSON object") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{what}: a JSON {type(body).__name__}, not an object")
    return body


def read_frame(sock: socket.socket, what: str = "frame") -> tuple[Header, bytes]:
    """One whole frame from a blocking socket: the header is checked (``unpack``: every
    length bounded) before its payload is read. ConnectionError if the peer closes first."""
    h = unpack(_read_exact(sock, HEADER_SIZE, what))
    return h, _read_exact(sock, h.length, what)


def _read_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        more = sock.recv(n - len(buf))
        if not more:
            raise ConnectionError(f"closed in the middle of a {what} ({len(buf)} of {n} bytes)")
        buf += more
    return bytes(buf)


def ping(address: str, port: int, timeout: float) -> dict:
    """One PING / PONG (no secret needed): the service's answer ({version, keys, bytes}).
    OSError (ConnectionError) or ProtocolError if it does not answer as a switch."""
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.sendall(header(type=PING))
        h, payload = read_frame(s, "PONG")
    if h.type != PONG:
        raise ConnectionError(f"{TYPE_NAMES[h.type]} instead of PONG")
    return parse_json(payload, "PONG")


def transcript(nonce_rank: bytes, nonce_switch: bytes, job: str, rank: int,
               world: int) -> tuple[bytes, ...]:
    """What both proofs of a handshake cover (see the module docstring)."""
    return (nonce_rank, nonce_switch, job.encode(), struct.pack("!HH", rank, world))


RANK_LABEL = b"nezha-agg-rank"
SWITCH_LABEL = b"nezha-agg-switch"
