"""nf_tables rules sent as netlink messages encoded here, for the one change that must be
fast: a loss fault's new head rules (testbed.fabric.shaper).

Why not libnftables for it (testbed.kernel.nftables, which still builds the chains, lists
them for the read-back and deletes dead rules): every batch it runs parses text, fetches the
ruleset into its cache and makes a context, about 1 ms, on the netns worker thread, a thread
hand-off that costs up to the interpreter's 5 ms switch interval when another thread runs
Python. A whole rail's loss is one batch per link end: 8 for 4 hosts, 4.7-10 ms in all. Here a
batch is encoded in microseconds and sent on a NETLINK_NETFILTER socket that the namespace's
netlink handle opened once inside it (``Rtnl.nft_socket``), from the caller's thread.

The encoding is the one nft itself sends for ``insert rule netdev T C <rule>`` (a rule
without NLM_F_APPEND and without a position goes to the head of the chain). Its read-back
(nft's JSON listing, decoded by testbed.kernel.nftables) must show the loss that was asked
for, so an encoding error cannot pass unnoticed.
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from typing import Iterable

from testbed.kernel.nftables import NFT_MOD, loss_threshold
from testbed.kernel.rtnl import NLMSGHDR, asciiz, nlattr, recv_keeping_gil, send_keeping_gil

NFPROTO_NETDEV = 5
_NFNL_SUBSYS_NFTABLES = 10
_NFNL_MSG_BATCH_BEGIN, _NFNL_MSG_BATCH_END = 0x10, 0x11
_NFT_MSG_NEWRULE = 6
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_CREATE = 0x1, 0x4, 0x400
_NLMSG_ERROR = 2
_NFGEN = struct.Struct("=BBH")          # nfgenmsg: family, version, res_id (big-endian)

# attribute types (linux/netfilter/nf_tables.h)
_RULE_TABLE, _RULE_CHAIN, _RULE_EXPRESSIONS = 1, 2, 4
_LIST_ELEM, _EXPR_NAME, _EXPR_DATA = 1, 1, 2
_NG_DREG, _NG_MODULUS, _NG_TYPE, _NG_OFFSET = 1, 2, 3, 4
_NFT_NG_RANDOM = 1
_BYTEORDER_SREG, _BYTEORDER_DREG, _BYTEORDER_OP, _BYTEORDER_LEN, _BYTEORDER_SIZE = 1, 2, 3, 4, 5
_NFT_BYTEORDER_HTON = 1
_CMP_SREG, _CMP_OP, _CMP_DATA = 1, 2, 3
_NFT_CMP_LT = 2
_DATA_VALUE, _DATA_VERDICT, _VERDICT_CODE = 1, 2, 1
_COUNTER_BYTES, _COUNTER_PACKETS = 1, 2
_IMMEDIATE_DREG, _IMMEDIATE_DATA = 1, 2
_NFT_REG_VERDICT, _NFT_REG_1 = 0, 1
NF_DROP, NF_ACCEPT = 0, 1
_seq = itertools.count()
_lock = threading.Lock()      # one batch in flight at a time: acks are read by its sender


def _be32(atype: int, value: int) -> bytes:
    return nlattr(atype, struct.pack(">I", value))


def _expr(name: str, *attrs: bytes) -> bytes:
    data = nlattr(_EXPR_DATA, b"".join(attrs), nested=True)
    return nlattr(_LIST_ELEM, nlattr(_EXPR_NAME, asciiz(name)) + data, nested=True)


def _verdict(code: int) -> bytes:
    data = nlattr(_DATA_VERDICT, _be32(_VERDICT_CODE, code), nested=True)
    return _expr("immediate", _be32(_IMMEDIATE_DREG, _NFT_REG_VERDICT),
                 nlattr(_IMMEDIATE_DATA, data, nested=True))


def _counter() -> bytes:
    zero = struct.pack(">Q", 0)
    return _expr("counter", nlattr(_COUNTER_BYTES, zero), nlattr(_COUNTER_PACKETS, zero))


def loss_expressions(loss: float) -> list[list[bytes]]:
    """The head rules for ``loss``, head first, as nftables.nft_generation gives them in text:
    ``numgen random mod 1000000 < N counter drop`` then ``accept``; 100 %: ``counter drop``;
    0 %: ``accept``."""
    n = loss_threshold(loss)
    if n == 0:
        return [[_verdict(NF_ACCEPT)]]
    if n >= NFT_MOD:
        return [[_counter(), _verdict(NF_DROP)]]
    numgen = _expr("numgen", _be32(_NG_DREG, _NFT_REG_1), _be32(_NG_MODULUS, NFT_MOD),
                   _be32(_NG_TYPE, _NFT_NG_RANDOM), _be32(_NG_OFFSET, 0))
    # numgen leaves a host-order u32 in the register and cmp compares bytes (memcmp), so the
    # value goes to network order first, as nft does it: "<" on little-endian bytes is wrong
    # (a 5 % rule dropped 29 % of the packets)
    hton = _expr("byteorder", _be32(_BYTEORDER_SREG, _NFT_REG_1),
                 _be32(_BYTEORDER_DREG, _NFT_REG_1), _be32(_BYTEORDER_OP, _NFT_BYTEORDER_HTON),
                 _be32(_BYTEORDER_LEN, 4), _be32(_BYTEORDER_SIZE, 4))
    cmp = _expr("cmp", _be32(_CMP_SREG, _NFT_REG_1), _be32(_CMP_OP, _NFT_CMP_LT),
                nlattr(_CMP_DATA, nlattr(_DATA_VALUE, struct.pack(">I", n)), nested=True))
    return [[numgen, hton, cmp, _counter(), _verdict(NF_DROP)], [_verdict(NF_ACCEPT)]]


def _message(mtype: int, flags: int, seq: int, family: int, res_id: int,
             body: bytes = b"") -> bytes:
    payload = _NFGEN.pack(family, 0, socket.htons(res_id)) + body
    return NLMSGHDR.pack(16 + len(payload), mtype, flags, seq, 0) + payload


def insert_batch(table: str, chain: str, rules: Iterable[list[bytes]], seq: int) -> bytes:
    """One batch inserting ``rules`` (head first) at the head of ``chain`` of the netdev
    table ``table``: each rule's message carries sequence number seq + its position."""
    name = nlattr(_RULE_TABLE, asciiz(table)) + nlattr(_RULE_CHAIN, asciiz(chain))
    msgs = [_message(_NFNL_MSG_BATCH_BEGIN, _NLM_F_REQUEST, seq, 0, _NFNL_SUBSYS_NFTABLES)]
    rules = list(rules)
    for i, exprs in enumerate(reversed(rules)):      # each goes in front of the one before
        body = name + nlattr(_RULE_EXPRESSIONS, b"".join(exprs), nested=True)
        msgs.append(_message((_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWRULE,
                             _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE, seq + 1 + i,
                             NFPROTO_NETDEV, 0, body))
    msgs.append(_message(_NFNL_MSG_BATCH_END, _NLM_F_REQUEST, seq + 1 + len(rules), 0,
                         _NFNL_SUBSYS_NFTABLES))
    return b"".join(msgs)


def _acks(sock: socket.socket, first: int, count: int) -> None:
    """Wait for the acknowledgements of sequence numbers first .. first + count - 1; a kernel
    error raises OSError with its errno (ENOENT: no such table or chain)."""
    pending = set(range(first, first + count))
    while pending:
        buf = recv_keeping_gil(sock)
        offset = 0
        while offset + 16 <= len(buf):
            length, mtype, _, seq, _ = NLMSGHDR.unpack_from(buf, offset)
            if length < 16:
                break
            if mtype == _NLMSG_ERROR and seq in pending:
                code = -struct.unpack_from("=i", buf, offset + 16)[0]
                if code:
                    raise OSError(code, f"nf_tables: {os.strerror(code)}")
                pending.discard(seq)
            offset += (length + 3) & ~3


def insert_loss_rules(sock: socket.socket, table: str, chain: str, loss: float) -> None:
    """Insert the head rules for ``loss`` at the head of ``chain`` (netdev table ``table``)
    through ``sock`` (a NETLINK_NETFILTER socket in the chain's namespace) and wait for the
    kernel's acknowledgement. Keeps the GIL throughout (testbed.kernel.rtnl says why)."""
    rules = loss_expressions(loss)
    with _lock:
        seq = next(_seq) * 64 % (1 << 30) + 1
        send_keeping_gil(sock, bytearray(insert_batch(table, chain, rules, seq)))
        _acks(sock, seq + 1, len(rules))
