"""A small TCP key-value store for rendezvous (like torch's TCPStore).

Protocol: every request and reply is ``u32 length`` + JSON object; values travel as
latin-1 strings of bytes. Commands: set, get (waits up to a timeout), add (atomic
counter), wait (several keys), check. A wait ends early with an error when the store's
abort key is set: that is how one failing rank makes every other rank fail fast.

Served by rank 0 inside its Context (or stand-alone: ``python -m nezha.store --port P``).
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
import time

from .errors import StoreError, StoreTimeout, RendezvousAborted

_LEN = struct.Struct("!I")
ABORT_KEY = "__abort__"


def _send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("store connection closed")
        got += k
    return bytes(buf)


def _recv(sock):
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > 64 << 20:
        raise StoreError(f"store message too large ({n} bytes)")
    return json.loads(_recv_exact(sock, n))


class StoreServer:
    """Threaded store server. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self._data: dict[str, str] = {}
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise StoreError(f"cannot serve the store on {host}:{port}: {e}") from e
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._clients: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, name="nezha-store", daemon=True)
        self._thread.start()

    def _accept_loop(self):
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._clients.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="nezha-store-client").start()

    def _wait_for(self, keys, timeout):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if ABORT_KEY in self._data:
                    return {"abort": self._data[ABORT_KEY]}
                if all(k in self._data for k in keys):
                    return {"ok": True}
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return {"timeout": [k for k in keys if k not in self._data]}
                self._cond.wait(min(left, 0.5))

    def _serve(self, conn):
        try:
            while True:
                req = _recv(conn)
                cmd = req.get("cmd")
                if cmd == "set":
                    with self._cond:
                        self._data[req["key"]] = req["value"]
                        self._cond.notify_all()
                    rep = {"ok": True}
                elif cmd == "add":
                    with self._cond:
                        v = int(self._data.get(req["key"], "0")) + int(req["delta"])
                        self._data[req["key"]] = str(v)
                        self._cond.notify_all()
                    rep = {"value": v}
                elif cmd == "get":
                    rep = self._wait_for([req["key"]], float(req["timeout"]))
                    if "ok" in rep:
                        with self._cond:
                            rep = {"value": self._data[req["key"]]}
                elif cmd == "wait":
                    rep = self._wait_for(list(req["keys"]), float(req["timeout"]))
                elif cmd == "check":
                    with self._cond:
                        rep = {"value": all(k in self._data for k in req["keys"])}
                elif cmd == "delete":
                    with self._cond:
                        rep = {"value": self._data.pop(req["key"], None) is not None}
                else:
                    rep = {"error": f"unknown command {cmd!r}"}
                _send(conn, rep)
        except (OSError, ValueError, KeyError, ConnectionError):
            pass
        finally:
            conn.close()

    def close(self):
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in list(self._clients):
            try:
                c.close()
            except OSError:
                pass


class StoreClient:
    """Client of a StoreServer. Each call is one request/reply; thread-safe."""

    def __init__(self, host: str, port: int, timeout: float = 30.0):
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self._lock = threading.Lock()
        deadline = time.monotonic() + self.timeout
        last = None
        while True:
            try:
                self._sock = socket.create_connection((host, self.port), timeout=min(2.0, self.timeout))
                break
            except OSError as e:
                last = e
                if time.monotonic() >= deadline:
                    raise StoreTimeout(f"cannot reach the store at {host}:{port} within "
                                       f"{self.timeout:g} s: {last}") from e
                time.sleep(0.05)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call(self, req, timeout=None):
        with self._lock:
            try:
                self._sock.settimeout((timeout if timeout is not None else self.timeout) + 5.0)
                _send(self._sock, req)
                rep = _recv(self._sock)
            except (OSError, ConnectionError, ValueError) as e:
                raise StoreError(f"store at {self.host}:{self.port} failed: {e}") from e
        if "error" in rep:
            raise StoreError(rep["error"])
        if "abort" in rep:
            raise RendezvousAborted(rep["abort"])
        if "timeout" in rep:
            raise StoreTimeout(f"store keys not set within {timeout:g} s: {rep['timeout']}")
        return rep

    def set(self, key: str, value) -> None:
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("latin-1")
        self._call({"cmd": "set", "key": key, "value": str(value)})

    def get(self, key: str, timeout: float | None = None) -> str:
        t = self.timeout if timeout is None else timeout
        return self._call({"cmd": "get", "key": key, "timeout": t}, t)["value"]

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._call({"cmd": "add", "key": key, "delta": int(delta)})["value"])

    def wait(self, keys, timeout: float | None = None) -> None:
        t = self.timeout if timeout is None else timeout
        self._call({"cmd": "wait", "keys": list(keys), "timeout": t}, t)

    def check(self, keys) -> bool:
        return bool(self._call({"cmd": "check", "keys": list(keys)})["value"])

    def delete(self, key: str) -> bool:
        return bool(self._call({"cmd": "delete", "key": key})["value"])

    def abort(self, reason: str) -> None:
        """Make every current and future wait on this store fail with ``reason``."""
        try:
            self.set(ABORT_KEY, reason)
        except StoreError:
            pass

    def close(self):
        try:
            self._sock.close()
        except OSError:
            pass


def main(argv=None):
    p = argparse.ArgumentParser(description="Run a stand-alone nezha store.")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args(argv)
    srv = StoreServer(a.host, a.port)
    print(f"nezha store listening on {srv.host}:{srv.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.close()


if __name__ == "__main__":
    main()
