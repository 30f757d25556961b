"""A synchronous rtnetlink socket bound to one network namespace: the subset of pyroute2's
``IPRoute`` the fabric and the shapers use (``link``, ``tc``, ``addr``, ``route``,
``get_links``, ``link_lookup``, ``get_qdiscs``, ``get_classes``), without its costs.

Why not ``IPRoute(netns=NS)``: it forks a helper process to open each namespace's socket
(about 8 ms each), and every request goes through its asyncio machinery (0.3-0.6 ms a round
trip where the kernel needs a few microseconds). Here:

* the socket is opened on the netns worker thread while it is inside the namespace
  (``netns.call_in``): no fork, and the socket stays in that namespace for its life;
* requests are still *encoded* by pyroute2 (``IPBatch``, the same code ``IPRoute`` sends), so
  the kernel gets byte for byte what it got before; an encoding is kept as a template per
  distinct request and re-used with another interface index (the index sits at the same
  offset of ifinfomsg, tcmsg and ifaddrmsg): an htb class, whose rate tables pyroute2
  computes in Python for ~1 ms, is encoded once per rate;
* send and receive are libc calls that keep the GIL (``_send``/``_recv``): the kernel handles
  an rtnetlink request inside send() and queues its answer before send() returns, so there
  is nothing to wait for, while giving the GIL up and taking it back costs up to the
  interpreter's 5 ms switch interval per call whenever another thread runs Python (a fault
  was measured 8-30 ms late that way next to a busy thread); responses are decoded by
  pyroute2's message classes, so callers get the same message objects (``get_attr``,
  ``["index"]``);
  a dump's messages for other interfaces are skipped before decoding (a switch namespace
  holds one port per host).

A kernel error raises pyroute2's ``NetlinkError`` (``.code`` is the errno), as IPRoute does.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from pyroute2 import IPBatch
from pyroute2.netlink import NLMSG_DONE, NLMSG_ERROR, nlmsgerr
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from testbed.kernel import netns

NETLINK_ROUTE = 0
NETLINK_NETFILTER = 12
NETLINK_EXT_ACK = 11
SOL_NETLINK = 270
NLM_F_DUMP = 0x300
NLMSGHDR = struct.Struct("IHHII")   # nlmsghdr: length, type, flags, seq, pid
_INDEX_OFFSET = 20                  # ifinfomsg/tcmsg/ifaddrmsg: the ifindex after the header
_RCVBUF = 4 << 20

_local = threading.local()          # one pyroute2 encoder per thread (it is not thread-safe)
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_RTA = struct.Struct("=HH")
_NLA_F_NESTED = 0x8000
_IFADDR = struct.Struct("=BBBBI")   # ifaddrmsg: family, prefixlen, flags, scope, index
_RTM_NEWLINK, _RTM_GETLINK, _RTM_NEWADDR = 16, 18, 20
_NLM_F_CREATE_ACK = 0x605           # REQUEST | ACK | EXCL | CREATE, as pyroute2's "add"
_IFLA_LINKINFO, _IFLA_NET_NS_FD = 18, 28
_IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_IFLA_IFNAME, _IFLA_MTU, _IFLA_OPERSTATE, _IFLA_GSO_MAX_SIZE = 3, 4, 16, 41
_RTEXT_FILTER_SKIP_STATS = 1 << 3
_IFLA_EXT_MASK = 29
OPERSTATES = ("UNKNOWN", "NOTPRESENT", "DOWN", "LOWERLAYERDOWN", "TESTING", "DORMANT", "UP")
_templates: dict[tuple, bytes] = {}
_MSG_DONTWAIT = 0x40
_RECV_SIZE = 1 << 20                # more than any dump chunk the kernel sends (32 KiB)
_buffers = threading.local()


def _gil_libc() -> Any:
    """libc through ctypes.PyDLL: calls that do not release the GIL."""
    lib = ctypes.PyDLL(None, use_errno=True)
    for name in ("send", "recv"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_ssize_t
    return lib


_libc = _gil_libc()


def send_keeping_gil(sock: socket.socket, data: bytearray) -> None:
    """send() without releasing the GIL (see the module's docstring); a socket buffer that is
    full (never seen) falls back to Python's blocking send."""
    raw = (ctypes.c_char * len(data)).from_buffer(data)
    if _libc.send(sock.fileno(), raw, len(data), _MSG_DONTWAIT) >= 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EAGAIN, errno.EINTR):
        raise OSError(err, os.strerror(err))
    sock.send(data)


def recv_keeping_gil(sock: socket.socket) -> bytes:
    """What the kernel has queued, without releasing the GIL; nothing queued yet (an answer
    the kernel sends later) falls back to Python's blocking recv."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = ctypes.create_string_buffer(_RECV_SIZE)
    n = _libc.recv(sock.fileno(), buf, _RECV_SIZE, _MSG_DONTWAIT)
    if n >= 0:
        return ctypes.string_at(buf, n)
    err = ctypes.get_errno()
    if err not in (errno.EAGAIN, errno.EINTR):
        raise OSError(err, os.strerror(err))
    return sock.recv(_RECV_SIZE)


_templates_lock = threading.Lock()
_msg_map = MarshalRtnl.msg_map


def _encoder() -> IPBatch:
    ipb = getattr(_local, "ipb", None)
    if ipb is None:
        ipb = _local.ipb = IPBatch()
    return ipb


def _encode_now(method: str, args: tuple, kwargs: dict) -> bytes:
    """What ``IPRoute.<method>(*args, **kwargs)`` would send (one message)."""
    ipb = _encoder()
    ipb.reset()
    getattr(ipb, method)(*args, **kwargs)
    data = bytes(ipb.batch)
    ipb.reset()
    if not data or NLMSGHDR.unpack_from(data)[0] != len(data):
        raise ValueError(f"{method}{args}: pyroute2 encoded {len(data)} bytes, not one message")
    return data


def _key(method: str, args: tuple, kwargs: dict) -> Optional[tuple]:
    """A hashable key for a request without its index, or None (not cacheable: e.g. a veth's
    peer dict)."""
    try:
        key = (method, args, "index" in kwargs,
               tuple(sorted((k, v) for k, v in kwargs.items() if k != "index")))
        hash(key)
        return key
    except TypeError:
        return None


def encode(method: str, *args: Any, **kwargs: Any) -> bytearray:
    """The request ``IPRoute.<method>(*args, **kwargs)`` sends, from a template when the same
    request (but for ``index``) was encoded before. Sequence number and pid are the caller's."""
    index = kwargs.get("index")
    key = _key(method, args, kwargs) if index is None or isinstance(index, int) else None
    if key is not None:
        with _templates_lock:
            hit = _templates.get(key)
        if hit is not None:
            data = bytearray(hit)
            if index is not None:
                struct.pack_into("i", data, _INDEX_OFFSET, index)
            return data
    data = _encode_now(method, args, kwargs)
    # a template only if the index is where we patch it (and nowhere we do not know of)
    if key is not None and (index is None or (
            index > 0 and len(data) >= _INDEX_OFFSET + 4
            and struct.unpack_from("i", data, _INDEX_OFFSET)[0] == index
            and data.count(struct.pack("i", index)) == 1)):
        with _templates_lock:
            _templates[key] = data
    return bytearray(data)


def _error(data: bytes, offset: int, code: int) -> NetlinkError:
    msg = nlmsgerr(data, offset=offset)
    try:
        msg.decode()
        text = msg.get_attr("NLMSGERR_ATTR_MSG")
    except Exception:  # noqa: BLE001 - the errno is what matters; the text is a courtesy
        text = None
    return NetlinkError(code, text)


@dataclass(frozen=True)
class LinkInfo:
    """The few facts of one interface the fabric reads back, decoded with struct (pyroute2
    decodes all ~60 attributes of a link: 0.25 ms, against a few microseconds here)."""

    index: int
    flags: int
    ifname: str
    mtu: int
    operstate: str
    gso_max_size: Optional[int]

    @property
    def up(self) -> bool:
        return bool(self.flags & 1)      # IFF_UP


def _getlink_request(index: int = 0, ifname: Optional[str] = None) -> bytearray:
    """RTM_GETLINK for one interface by index or by name (no statistics asked)."""
    attrs = b""
    if ifname is not None:
        name = ifname.encode() + b"\0"
        attrs += _RTA.pack(4 + len(name), _IFLA_IFNAME) + name + b"\0" * (-len(name) % 4)
    attrs += _RTA.pack(8, _IFLA_EXT_MASK) + struct.pack("=I", _RTEXT_FILTER_SKIP_STATS)
    length = 16 + _IFINFO.size + len(attrs)
    return bytearray(NLMSGHDR.pack(length, _RTM_GETLINK, 0x1, 0, 0)
                     + _IFINFO.pack(0, 0, index, 0, 0) + attrs)


def nlattr(atype: int, payload: bytes, nested: bool = False) -> bytes:
    """One netlink attribute, padded to 4 bytes (``nested``: NLA_F_NESTED, which nfnetlink
    wants on attributes that hold attributes)."""
    return (_RTA.pack(4 + len(payload), atype | (_NLA_F_NESTED if nested else 0)) + payload
            + b"\0" * (-len(payload) % 4))


def asciiz(text: str) -> bytes:
    return text.encode() + b"\0"


def veth_request(ifname: str, peer_ifname: str, peer_ns_fd: int) -> bytearray:
    """RTM_NEWLINK of a veth pair whose peer is created straight in the namespace of
    ``peer_ns_fd``: byte for byte what ``IPRoute.link("add", ifname=..., kind="veth",
    peer={"ifname": ..., "net_ns_fd": fd})`` sends (tests/test_fabric.py compares them),
    without pyroute2's 0.5 ms of request filters per veth."""
    peer = _IFINFO.pack(0, 0, 0, 0, 0) + nlattr(_IFLA_IFNAME, asciiz(peer_ifname)) \
        + nlattr(_IFLA_NET_NS_FD, struct.pack("=I", peer_ns_fd))
    linkinfo = nlattr(_IFLA_INFO_KIND, asciiz("veth")) \
        + nlattr(_IFLA_INFO_DATA, nlattr(_VETH_INFO_PEER, peer))
    body = _IFINFO.pack(0, 0, 0, 0, 0) + nlattr(_IFLA_IFNAME, asciiz(ifname)) \
        + nlattr(_IFLA_LINKINFO, linkinfo)
    return bytearray(NLMSGHDR.pack(16 + len(body), _RTM_NEWLINK, _NLM_F_CREATE_ACK, 0, 0) + body)


def addr_request(index: int, address: str, prefixlen: int) -> bytearray:
    """RTM_NEWADDR of an IPv4 address: what ``IPRoute.addr("add", index=..., address=...,
    prefixlen=...)`` sends (IFA_ADDRESS and IFA_LOCAL both the address)."""
    ip = socket.inet_aton(address)
    body = _IFADDR.pack(socket.AF_INET, prefixlen, 0, 0, index) + nlattr(_IFA_ADDRESS, ip) \
        + nlattr(_IFA_LOCAL, ip)
    return bytearray(NLMSGHDR.pack(16 + len(body), _RTM_NEWADDR, _NLM_F_CREATE_ACK, 0, 0) + body)


def _link_info(buf: bytes, offset: int, length: int) -> LinkInfo:
    _, _, index, flags, _ = _IFINFO.unpack_from(buf, offset + 16)
    pos, end = offset + 16 + _IFINFO.size, offset + length
    name, mtu, oper, gso = "", 0, 0, None
    while pos + 4 <= end:
        alen, atype = _RTA.unpack_from(buf, pos)
        if alen < 4:
            break
        atype &= 0x3FFF
        if atype == _IFLA_IFNAME:
            name = bytes(buf[pos + 4:pos + alen]).split(b"\0", 1)[0].decode()
        elif atype == _IFLA_MTU:
            mtu = struct.unpack_from("=I", buf, pos + 4)[0]
        elif atype == _IFLA_OPERSTATE:
            oper = buf[pos + 4]
        elif atype == _IFLA_GSO_MAX_SIZE:
            gso = struct.unpack_from("=I", buf, pos + 4)[0]
        pos += (alen + 3) & ~3
    return LinkInfo(index, flags, name, mtu,
                    OPERSTATES[oper] if oper < len(OPERSTATES) else str(oper), gso)


class Rtnl:
    """One rtnetlink socket inside namespace ``ns`` (None: this thread's namespace).
    Thread-safe: one request at a time; answers are matched by sequence number."""

    def __init__(self, ns: Optional[str] = None) -> None:
        self.ns = ns
        self.sock = netns.call_in(ns, socket.socket, socket.AF_NETLINK, socket.SOCK_RAW,
                                  NETLINK_ROUTE) if ns is not None else \
            socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            self.sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        except OSError:
            pass        # defaults work, only slower dumps / no kernel error text
        self.sock.bind((0, 0))
        self.pid = self.sock.getsockname()[0]
        self._seq = 0
        self._lock = threading.Lock()
        self._inet: Optional[socket.socket] = None
        self._nft: Optional[socket.socket] = None
        self.closed = False

    def inet_socket(self) -> socket.socket:
        """An AF_INET datagram socket in the same namespace, for interface ioctls (ethtool:
        an ioctl acts in its socket's namespace), opened once and closed with this handle,
        so an ioctl needs no trip to the netns worker thread."""
        if self._inet is None:
            self._inet = netns.call_in(self.ns, socket.socket, socket.AF_INET,
                                       socket.SOCK_DGRAM) if self.ns is not None else \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        return self._inet

    def nft_socket(self) -> socket.socket:
        """A NETLINK_NETFILTER socket in the same namespace, opened once and closed with this
        handle: a loss fault's nf_tables rules go there from the caller's thread
        (testbed.kernel.nfnl), with no trip to the netns worker thread."""
        if self._nft is None:
            sock = netns.call_in(self.ns, socket.socket, socket.AF_NETLINK, socket.SOCK_RAW,
                                 NETLINK_NETFILTER) if self.ns is not None else \
                socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            sock.bind((0, 0))
            self._nft = sock
        return self._nft

    # ---- transport -------------------------------------------------------------------------
    def _stamp(self, data: bytearray) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        struct.pack_into("II", data, 8, self._seq, self.pid)
        return self._seq

    def _exchange(self, data: bytearray, want: Optional[Callable[[bytes, int], bool]] = None,
                  raw: Optional[Callable[[bytes, int, int], Any]] = None) -> list:
        """Send one request; return its decoded answers (a dump's, all of them) once the
        kernel said it is done (ACK, DONE or the single answer of a get without ACK).
        ``want(buf, offset)`` skips answers before decoding; ``raw(buf, offset, length)``
        decodes them instead of pyroute2."""
        _, _, flags, _, _ = NLMSGHDR.unpack_from(data)
        dump = flags & NLM_F_DUMP == NLM_F_DUMP
        acked = flags & 0x4 != 0          # NLM_F_ACK
        out: list = []
        with self._lock:
            seq = self._stamp(data)
            self._send(data)
            while True:
                buf = self._recv()
                offset, done = 0, False
                while offset + 16 <= len(buf):
                    length, mtype, _, mseq, _ = NLMSGHDR.unpack_from(buf, offset)
                    if length < 16:
                        break
                    if mseq == seq:
                        if mtype == NLMSG_ERROR:
                            code = -struct.unpack_from("i", buf, offset + 16)[0]
                            if code:
                                raise _error(buf, offset, code)
                            done = True
                        elif mtype == NLMSG_DONE:
                            done = True
                        elif want is None or want(buf, offset):
                            msg = _msg_map.get(mtype)
                            if raw is not None:
                                out.append(raw(buf, offset, length))
                            elif msg is not None:
                                m = msg(buf[offset:offset + length])
                                m.decode()
                                out.append(m)
                            if not dump and not acked:
                                done = True
                    offset += (length + 3) & ~3
                if done:
                    return out

    def _send(self, data: bytearray) -> None:
        send_keeping_gil(self.sock, data)

    def _recv(self) -> bytes:
        return recv_keeping_gil(self.sock)

    def request(self, method: str, *args: Any, **kwargs: Any) -> list:
        return self._exchange(encode(method, *args, **kwargs))

    def prepare(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Encode a request now (kept as a template) that will be sent later, when time
        matters (a fault at its scheduled time)."""
        encode(method, *args, **kwargs)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
            for extra in (self._inet, self._nft):
                if extra is not None:
                    extra.close()

    def __enter__(self) -> "Rtnl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- IPRoute's API, the subset the testbed uses ----------------------------------------
    def link(self, command: str, **kwargs: Any) -> list:
        return self.request("link", command, **kwargs)

    def tc(self, command: str, kind: Optional[str] = None, **kwargs: Any) -> list:
        if command == "dump":
            return self.get_qdiscs(kwargs.get("index"))
        return self.request("tc", command, kind, **kwargs) if kind is not None else \
            self.request("tc", command, **kwargs)

    def addr(self, command: str, **kwargs: Any) -> list:
        return self.request("addr", command, **kwargs)

    def route(self, command: str, **kwargs: Any) -> list:
        return self.request("route", command, **kwargs)

    def get_links(self, *indexes: int) -> list:
        if not indexes:
            return self._exchange(encode("link", "dump"))
        return [m for i in indexes for m in self._exchange(encode("link", "get", index=i))]

    def add_veth(self, ifname: str, peer_ifname: str, peer_ns_fd: int) -> None:
        """A veth ``ifname`` here, its peer ``peer_ifname`` in the namespace of the fd."""
        self._exchange(veth_request(ifname, peer_ifname, peer_ns_fd))

    def add_address(self, index: int, address: str, prefixlen: int) -> None:
        """An IPv4 address on interface ``index``."""
        self._exchange(addr_request(index, address, prefixlen))

    def link_lookup(self, ifname: str) -> list[int]:
        """[index] of interface ``ifname``, [] if there is none."""
        info = self.link_info(ifname=ifname)
        return [info.index] if info is not None else []

    def link_info(self, index: int = 0, ifname: Optional[str] = None) -> Optional[LinkInfo]:
        """Index, flags, name, MTU, operstate and gso_max_size of one interface (by index or
        name), or None if there is no such interface."""
        try:
            found = self._exchange(_getlink_request(index, ifname), raw=_link_info)
        except NetlinkError as e:
            if e.code in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        return found[0] if found else None

    def get_qdiscs(self, index: Optional[int] = None) -> list:
        """All qdiscs, or those of interface ``index`` (the others are not decoded)."""
        return self._exchange(encode("tc", "dump"), _of_index(index))

    def get_classes(self, index: int = 0) -> list:
        return self._exchange(encode("get_classes", index=index), _of_index(index or None))


def _of_index(index: Optional[int]) -> Optional[Callable[[bytes, int], bool]]:
    if not index:
        return None
    return lambda buf, offset: struct.unpack_from("i", buf, offset + _INDEX_OFFSET)[0] == index


def open_all(namespaces: Iterable[str]) -> dict[str, Rtnl]:
    """An Rtnl per namespace."""
    return {ns: Rtnl(ns) for ns in namespaces}


def ns_fd(ns: str) -> int:
    """An open fd of namespace ``ns`` (for IFLA_NET_NS_FD); the caller closes it."""
    return os.open(netns.path(ns), os.O_RDONLY)
