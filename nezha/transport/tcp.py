"""TCP transport: one connection per peer per rail, bound to the rail's local address."""
from __future__ import annotations

import socket

from .base import Transport


class TcpTransport(Transport):
    name = "tcp"

    def new_socket(self) -> socket.socket:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
