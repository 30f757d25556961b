"""Transports: how frames move between two ranks on one rail.

A ``Transport`` knows how to listen on and connect from a rail's local address; a
``Connection`` (Gloo's Pair) is one socket to one peer on one rail, with a reader thread
(header -> ``recv_into`` straight into the posted destination, or into staging) and a writer
thread fed by a queue. Implementations: ``TcpTransport`` (one TCP connection per peer per
rail, bound to the rail's address) and ``MptcpTransport`` (one MPTCP connection per peer,
the kernel spreads its subflows over the rails).
"""
from ..config import Config
from .base import Connection, Transport, recv_exact_into, send_vec  # noqa: F401
from .tcp import TcpTransport  # noqa: F401
from .mptcp import MptcpTransport, configure_mptcp_endpoints  # noqa: F401


def make_transport(name: str, rails, config: Config = Config()) -> Transport:
    """``config``: socket options and the timeout (TCP_USER_TIMEOUT's default)."""
    cls = {"tcp": TcpTransport, "mptcp": MptcpTransport}.get(name)
    if cls is not None:
        return cls(rails, config)
    raise ValueError(f"unknown transport {name!r}")
