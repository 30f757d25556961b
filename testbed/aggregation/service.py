"""The aggregation switch: an asyncio server that reduces the job's contributions and answers.

Runs inside an aggregation rail's switch namespace (the fabric starts it there:
``python -m testbed.aggregation.service --listen ADDR:PORT [--rate RATE]``), on the rail's
bridge, so every byte a rank sends it crosses the rank's shaped link exactly as a switch
port's would. The protocol is nezha/aggwire.py. The job secret comes from the environment
(NEZHA_JOB_SECRET), never the command line; a connection that does not prove it is refused
before a single contribution is read, and an authenticated rank can only contribute as itself.
Everything an input can make large is bounded: a frame (header checked before its payload is
read), the keys and bytes a job holds (table.Limits), the time a key may wait for its last
contribution, the connections, the payload bytes being read at once (READ_BUDGET: a reader
beyond it waits, and TCP holds its sender back), and the results queued for a rank that stops
reading. Memory: at most max_jobs x max_bytes in keys, plus READ_BUDGET, plus what is queued.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from nezha import aggwire, auth
from nezha.aggwire import Header
from nezha.errors import ConfigError, ProtocolError
from nezha.transport.base import set_congestion, set_rto_min
from testbed.aggregation.pacing import TokenBucket
from testbed.aggregation.table import Entry, Limits, Refused, Table

log = logging.getLogger("testbed.aggregation")
HANDSHAKE_TIMEOUT = 5.0           # s a connection has for its whole handshake
MAX_CONNECTIONS = 256
MAX_QUEUED = 64 << 20              # bytes of results queued for one connection before it is cut
READ_BUFFER = 4 << 20             # StreamReader buffer (flow control), not a bound on frames
READ_BUDGET = 64 << 20            # payload bytes being read at once, all connections together
JOB_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_LOGGED = 100                   # refusal lines logged per process (then counted only)


class Rejected(Exception):
    """A connection the switch will not serve (bad handshake): answered with ERROR, closed."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(eq=False)
class Conn:
    """One authenticated rank connection (hashable by identity: the table's answer address)."""
    writer: asyncio.StreamWriter
    job: str
    rank: int
    world: int

    def send(self, *parts: bytes) -> None:
        """Queue frames; a rank that lets more than MAX_QUEUED pile up is cut off."""
        if self.writer.is_closing():
            return
        for p in parts:
            self.writer.write(p)
        if self.writer.transport.get_write_buffer_size() > MAX_QUEUED:
            log.warning("job %s rank %d reads no results: connection closed", self.job, self.rank)
            self.writer.transport.abort()


class ByteBudget:
    """Bytes that may be in the middle of being read; a reader waits for its share."""

    def __init__(self, total: int) -> None:
        self.free = total
        self.cond = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.free >= n)
            self.free -= n

    async def give(self, n: int) -> None:
        async with self.cond:
            self.free += n
            self.cond.notify_all()


class Service:
    """Serve one job secret's ranks: reduce per key, answer every contributor."""

    def __init__(self, secret: bytes = b"", limits: Limits = Limits(),
                 rate_bps: Optional[int] = None, max_connections: int = MAX_CONNECTIONS,
                 congestion: str = "", rto_min_ms: float = 0.0) -> None:
        self.secret = secret
        self.congestion = congestion      # the ranks' (their TCP rails'): the same TCP
        self.rto_min_ms = rto_min_ms      # ...and the same least RTO (accepted sockets inherit)
        self.limits = limits
        self.table = Table(limits)
        self.bucket = TokenBucket(rate_bps)
        self.budget = ByteBudget(max(READ_BUDGET, limits.max_chunk))
        self.max_connections = max_connections
        self.connections = 0
        self.refusals = 0
        self.server: Optional[asyncio.AbstractServer] = None
        self._handlers: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._sweeper: Optional[asyncio.Task] = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (0 picks a free one)."""
        self.server = await asyncio.start_server(self._handle, host, port,
                                                 limit=READ_BUFFER)
        for s in self.server.sockets:     # accepted connections inherit both
            set_congestion(s, self.congestion, "--congestion")
            set_rto_min(s, self.rto_min_ms)
        self._sweeper = asyncio.create_task(self._sweep())
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and end every connection (their keys die with the service), also
        one accepted just before: its handler starts a turn of the loop later, and left
        pending it was ended by the garbage collector on a closed loop (a warning in a full
        suite)."""
        if self._sweeper:
            self._sweeper.cancel()
        if self.server:
            self.server.close()
        await asyncio.sleep(0)                 # handlers of connections accepted just now
        while self._handlers:
            for writer in list(self._handlers.values()):
                writer.transport.abort()       # their reads end; the handlers return
            await asyncio.gather(*list(self._handlers), return_exceptions=True)
            await asyncio.sleep(0)
        if self.server:
            await self.server.wait_closed()

    def _refuse(self, what: str) -> None:
        self.refusals += 1
        if self.refusals <= MAX_LOGGED:
            log.warning("refused: %s", what)

    # ------------------------------------------------------------------ connections
    async def _read(self, reader: asyncio.StreamReader) -> tuple[Header, bytes]:
        """One frame; its payload is read within the read budget, which the caller gives back
        (``_serve`` for a CONTRIB once it is folded in; here for anything else)."""
        h = aggwire.unpack(await reader.readexactly(aggwire.HEADER_SIZE),
                           self.limits.max_chunk, self.limits.max_world)
        if not h.length:
            return h, b""
        await self.budget.take(h.length)
        try:
            payload = await reader.readexactly(h.length)
        except BaseException:
            await self.budget.give(h.length)
            raise
        if h.type != aggwire.CONTRIB:
            await self.budget.give(h.length)
        return h, payload

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            self._refuse(f"connection beyond {self.max_connections}")
            writer.close()
            return
        self.connections += 1
        task = asyncio.current_task()
        self._handlers[task] = writer
        conn: Optional[Conn] = None
        try:
            conn = await asyncio.wait_for(self._greet(reader, writer), HANDSHAKE_TIMEOUT)
            if conn is not None:
                await self._serve(reader, conn)
        except (Rejected, ProtocolError) as e:
            self._refuse(str(e))
            writer.write(aggwire.error(getattr(e, "code", aggwire.E_PROTOCOL), str(e)))
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError):
            pass                                   # gone, truncated or too slow: just close
        finally:
            self.connections -= 1
            self._handlers.pop(task, None)
            if conn is not None:
                self.table.drop_connection(conn)
            writer.close()

    async def _greet(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> Optional[Conn]:
        """PING -> PONG (None: nothing more on this connection), or the handshake."""
        h, payload = await self._read(reader)
        if h.type == aggwire.PING:
            writer.write(aggwire.control(aggwire.PONG, {
                "version": aggwire.VERSION, "keys": len(self.table.entries),
                "bytes": self.table.pending_bytes}))
            await writer.drain()
            return None
        if h.type != aggwire.HELLO:
            raise ProtocolError(f"{aggwire.TYPE_NAMES[h.type]} before HELLO")
        return await self._authenticate(reader, writer, _hello(payload, self.limits.max_world))

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            hello: tuple[str, int, int, bytes]) -> Conn:
        job, rank, world, nonce_rank = hello
        nonce_switch = auth.nonce()
        t = aggwire.transcript(nonce_rank, nonce_switch, job, rank, world)
        writer.write(aggwire.control(aggwire.CHALLENGE, {
            "nonce": nonce_switch.hex(),
            "proof": auth.mac(self.secret, aggwire.SWITCH_LABEL, *t).hex()}))
        h, payload = await self._read(reader)
        if h.type != aggwire.PROOF:
            raise ProtocolError(f"{aggwire.TYPE_NAMES[h.type]} where a PROOF belongs")
        proof = _hex(aggwire.parse_json(payload, "PROOF"), "proof", auth.TAG_BYTES)
        if not auth.same(proof, auth.mac(self.secret, aggwire.RANK_LABEL, *t)):
            raise Rejected(aggwire.E_AUTH, f"job {job!r} rank {rank}: wrong proof of the job "
                           "secret (NEZHA_JOB_SECRET differs, or is missing on one side)")
        writer.write(aggwire.control(aggwire.WELCOME, {}))
        return Conn(writer, job, rank, world)

    async def _serve(self, reader: asyncio.StreamReader, conn: Conn) -> None:
        """Contributions until the rank closes; refusals are answered, never fatal."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                h, payload = await self._read(reader)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise ProtocolError("connection closed in the middle of a frame") from None
                return
            if h.type != aggwire.CONTRIB:
                raise ProtocolError(f"{aggwire.TYPE_NAMES[h.type]} where a CONTRIB belongs")
            try:
                entry = self._fold(conn, h, payload, loop.time())
            finally:
                await self.budget.give(h.length)
            if entry is not None:
                await self._answer(h, entry)
            await conn.writer.drain()

    def _fold(self, conn: Conn, h: Header, payload: bytes, now: float) -> Optional[Entry]:
        """One contribution into the table: the entry if it completed its key; a refusal is
        answered to the rank (never fatal to the connection)."""
        try:
            if h.rank != conn.rank or h.world != conn.world:
                raise Refused(aggwire.E_AUTH, f"contribution as rank {h.rank}/{h.world} on "
                              f"the connection of rank {conn.rank}/{conn.world}")
            return self.table.contribute(conn.job, h, payload, conn, now)
        except Refused as r:
            self._refuse(f"job {conn.job!r} rank {conn.rank}: {r}")
            conn.send(aggwire.error(r.code, str(r), op_id=h.op_id, chunk=h.chunk,
                                    rank=conn.rank, world=conn.world))
            return None

    async def _answer(self, h: Header, entry: Entry) -> None:
        """Pace the result at the switch's rate, then send it to every contributor."""
        await self.bucket.take(entry.nbytes)
        data = entry.acc.tobytes()
        for rank, c in entry.contributors.items():
            if c is not None:
                c.send(aggwire.header(type=aggwire.RESULT, dtype=entry.dtype, redop=entry.redop,
                                      rank=rank, world=entry.world, count=entry.count,
                                      op_id=h.op_id, chunk=h.chunk, length=len(data)), data)

    async def _sweep(self) -> None:
        """Give up keys whose contributions did not all arrive in time: tell who did."""
        loop = asyncio.get_running_loop()
        every = max(0.005, min(0.1, self.limits.key_timeout / 10))
        while True:
            await asyncio.sleep(every)
            for (job, op_id, chunk), entry in self.table.expired(loop.time()):
                missing = sorted(set(range(entry.world)) - set(entry.contributors))
                reason = (f"op {op_id} chunk {chunk}: ranks {_ranges(missing)} did not "
                          f"contribute within {self.limits.key_timeout:g} s")
                self._refuse(f"job {job!r} {reason}")
                for rank, c in entry.contributors.items():
                    if c is not None:
                        c.send(aggwire.error(aggwire.E_TIMEOUT, reason, op_id=op_id,
                                             chunk=chunk, rank=rank, world=entry.world))


def _hex(body: dict, key: str, size: int) -> bytes:
    v = body.get(key)
    try:
        b = bytes.fromhex(v) if isinstance(v, str) else b""
    except ValueError:
        b = b""
    if len(b) != size:
        raise ProtocolError(f"{key}: expected {size} bytes in hex")
    return b


def _hello(payload: bytes, max_world: int) -> tuple[str, int, int, bytes]:
    """(job, rank, world, nonce) of a HELLO, every field checked."""
    body = aggwire.parse_json(payload, "HELLO")
    job, rank, world = body.get("job"), body.get("rank"), body.get("world")
    if not isinstance(job, str) or not JOB_RE.fullmatch(job):
        raise ProtocolError(f"HELLO job {str(job)[:40]!r}: expected 1-64 letters, digits, . _ : -")
    if type(world) is not int or not 1 <= world <= max_world:
        raise ProtocolError(f"HELLO world {str(world)[:20]}: expected 1 to {max_world}")
    if type(rank) is not int or not 0 <= rank < world:
        raise ProtocolError(f"HELLO rank {str(rank)[:20]}: expected 0 to {world - 1}")
    return job, rank, world, _hex(body, "nonce", auth.NONCE_BYTES)


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:16])) + ("..." if len(ranks) > 16 else "")


# ---------------------------------------------------------------------- command line
def _args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m testbed.aggregation.service",
                                description="Emulated in-network aggregation switch "
                                            "(job secret: NEZHA_JOB_SECRET)")
    p.add_argument("--listen", required=True, help="ADDR:PORT to listen on")
    p.add_argument("--rate", default=None, help="reduction rate, e.g. 200mbit (default: none)")
    p.add_argument("--congestion", default="",
                   help="TCP congestion control of its connections, e.g. cubic (the ranks'; "
                        "default: the namespace's)")
    p.add_argument("--rto-min-ms", type=float, default=5.0,
                   help="least TCP retransmission timeout of its connections, ms (TCP_RTO_MIN_US,"
                        " Linux >= 6.15; 0: the kernel's 200 ms; default 5, Nezha's default)")
    p.add_argument("--key-timeout", type=float, default=Limits.key_timeout)
    p.add_argument("--max-keys", type=int, default=Limits.max_keys)
    p.add_argument("--max-bytes", type=int, default=Limits.max_bytes)
    p.add_argument("--max-jobs", type=int, default=Limits.max_jobs)
    p.add_argument("--max-chunk", type=int, default=Limits.max_chunk)
    p.add_argument("--max-world", type=int, default=Limits.max_world)
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    return p.parse_args(argv)


def _config(a: argparse.Namespace) -> tuple[str, int, Limits, Optional[int]]:
    """(host, port, limits, rate) from the arguments; ConfigError naming the bad one (a
    congestion control the kernel does not have is refused here, not per connection)."""
    from testbed.model.units import parse_rate     # the topology's rate syntax
    host, _, port = a.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {a.listen!r}: expected ADDR:PORT, e.g. 198.18.1.254:29400")
    for name in ("key_timeout", "max_keys", "max_bytes", "max_jobs", "max_chunk", "max_world",
                 "max_connections"):
        if not getattr(a, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(a, name)}: expected > 0")
    if a.max_chunk > aggwire.MAX_CHUNK or a.max_world > aggwire.MAX_WORLD:
        raise ConfigError(f"--max-chunk / --max-world: at most {aggwire.MAX_CHUNK} / "
                          f"{aggwire.MAX_WORLD}")
    rate = parse_rate(a.rate, "--rate") if a.rate else None
    if not 0 <= a.rto_min_ms <= 200:
        raise ConfigError(f"--rto-min-ms {a.rto_min_ms}: expected 0 (the kernel's) to 200")
    if a.congestion:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            set_congestion(probe, a.congestion, "--congestion")
    limits = Limits(max_keys=a.max_keys, max_bytes=a.max_bytes, max_jobs=a.max_jobs,
                    key_timeout=a.key_timeout, max_chunk=a.max_chunk, max_world=a.max_world)
    return host, int(port), limits, rate


async def _main(a: argparse.Namespace) -> None:
    host, port, limits, rate = _config(a)
    service = Service(auth.secret_bytes(os.environ.get("NEZHA_JOB_SECRET"), "NEZHA_JOB_SECRET"),
                      limits, rate, a.max_connections, a.congestion, a.rto_min_ms)
    await service.start(host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"aggregation service listening on {host}:{port}", flush=True)
    await stop.wait()
    await service.stop()


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="aggregation: %(message)s")
    try:
        asyncio.run(_main(_args(argv)))
    except Exception as e:       # noqa: BLE001 - a bad argument or address: say it, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
