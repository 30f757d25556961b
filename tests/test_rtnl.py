"""The fabric's netlink socket (testbed.kernel.rtnl) sends what pyroute2's IPRoute sent: its
templates and hand-encoded requests are byte-identical to pyroute2's encoding, and it answers
with the same message objects and errors."""
from __future__ import annotations

import struct

import pytest
from pyroute2 import IPBatch
from pyroute2.netlink.exceptions import NetlinkError

from testbed.kernel import rtnl, tc


def pyroute2_bytes(method: str, *args, **kwargs) -> bytes:
    """What IPRoute would send, without sequence number and pid (bytes 8-16)."""
    ipb = IPBatch()
    getattr(ipb, method)(*args, **kwargs)
    data = bytes(ipb.batch)
    return data[:8] + data[16:]


def ours(data: bytes) -> bytes:
    return bytes(data[:8] + data[16:])


@pytest.mark.parametrize("ifname,peer,fd", [("r0", "h1", 7), ("r12", "h64", 123),
                                            ("rail_name_15ch", "h", 3)])
def test_veth_request_is_pyroute2s(ifname, peer, fd):
    assert ours(rtnl.veth_request(ifname, peer, fd)) == pyroute2_bytes(
        "link", "add", ifname=ifname, kind="veth", peer={"ifname": peer, "net_ns_fd": fd})


@pytest.mark.parametrize("address,prefix", [("198.18.0.1", 24), ("10.1.2.254", 16)])
def test_address_request_is_pyroute2s(address, prefix):
    assert ours(rtnl.addr_request(5, address, prefix)) == pyroute2_bytes(
        "addr", "add", index=5, address=address, prefixlen=prefix)


@pytest.mark.parametrize("method,args,kwargs", [
    ("tc", ("add-class", "htb"), dict(handle=tc.CLASS_HANDLE, **tc.htb_class_kwargs(
        100_000_000, 1500, 25000))),
    ("tc", ("change-class", "htb"), dict(handle=tc.CLASS_HANDLE, **tc.htb_class_kwargs(
        10_000_000, 9000, 9014))),
    ("tc", ("add", "pfifo"), dict(handle=tc.LEAF_HANDLE, parent=tc.CLASS_HANDLE, limit=84)),
    ("link", ("set",), dict(state="up")),
    ("link", ("set",), dict(mtu=9000)),
    ("link", ("set",), dict(gso_max_size=12500)),
])
def test_a_template_reused_for_another_interface_is_pyroute2s_encoding_of_it(method, args,
                                                                            kwargs):
    first = rtnl.encode(method, *args, index=1003, **kwargs)          # makes the template
    assert ours(first) == pyroute2_bytes(method, *args, index=1003, **kwargs)
    for index in (2, 77, 1003):
        again = rtnl.encode(method, *args, index=index, **kwargs)
        assert struct.unpack_from("i", again, 20)[0] == index
        assert ours(again) == pyroute2_bytes(method, *args, index=index, **kwargs)


@pytest.mark.netns
def test_answers_and_errors_are_iproutes(no_leftovers):
    """link_info decodes what pyroute2 decodes; a kernel error is pyroute2's NetlinkError with
    the errno; a missing name looks up as []."""
    from pyroute2 import IPRoute
    from testbed.fabric import Fabric
    from testbed.model import spec
    with Fabric(spec.loads("hosts: 2\nrails: [{name: r0, bandwidth: 20mbit}]\n")) as fab:
        end = fab.links["h1.r0"].host_end
        info = end.ipr.link_info(end.index)
        with IPRoute(netns=end.ns) as ipr:
            full = ipr.get_links(end.index)[0]
        assert (info.ifname, info.mtu, info.operstate, info.gso_max_size, info.up) == (
            full.get_attr("IFLA_IFNAME"), full.get_attr("IFLA_MTU"),
            full.get_attr("IFLA_OPERSTATE"), full.get_attr("IFLA_GSO_MAX_SIZE"),
            bool(full["flags"] & 1))
        assert end.ipr.link_info(ifname="r0").index == end.index
        assert end.ipr.link_lookup(ifname="nothere") == []
        assert end.ipr.link_info(99999) is None
        assert [q.get_attr("TCA_KIND") for q in end.ipr.get_qdiscs(index=end.index)] == \
            ["htb", "pfifo"]
        with pytest.raises(NetlinkError) as e:
            end.ipr.tc("add", "htb", index=end.index, handle=tc.HTB_HANDLE, default=0x10)
        assert e.value.code == 17          # EEXIST: the tree is there already
