import pytest

from nezha import wire
from nezha.errors import ProtocolError


def hdr(**kw):
    f = dict(type=wire.DATA, kind=1, dtype=1, redop=1, rail=1, src=3, aux=0, op_id=42, step=5,
             chunk=7, offset=4096, length=1024, msg_total=8192, op_total=65536)
    f.update(kw)
    return wire.Header(**f)


def test_roundtrip_and_size():
    h = hdr()
    b = h.pack()
    assert len(b) == wire.HEADER_SIZE == 64
    assert wire.unpack(b) == h
    assert b[:4] == b"NZHA" and b[4] == wire.VERSION


@pytest.mark.parametrize("mutate, msg", [
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "version"),
    (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "checksum"),
    (lambda b: b[:40], "truncated"),
])
def test_corruption_is_rejected(mutate, msg):
    with pytest.raises(ProtocolError, match=msg):
        wire.unpack(mutate(hdr().pack()))


@pytest.mark.parametrize("kw, msg", [
    (dict(offset=8000, length=1024), "outside"),
    (dict(length=wire.MAX_PAYLOAD + 1, msg_total=1 << 40), "too long"),
    (dict(type=99), "unknown frame type"),
    (dict(dtype=77), "dtype"),
    (dict(redop=9), "reduction op"),
    (dict(kind=50), "kind"),
    (dict(type=wire.ACK, length=5), "payload"),
])
def test_invalid_fields_are_rejected(kw, msg):
    with pytest.raises(ProtocolError, match=msg):
        wire.unpack(hdr(**kw).pack())
