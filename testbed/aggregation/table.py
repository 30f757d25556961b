"""The switch's table of keys in progress: contributions reduced as they arrive, bounded.

A key is (job, op_id, chunk). Its first contribution fixes dtype, op, element count and world;
every later one must match them and come from a rank not yet counted, or it is refused and the
key is left exactly as it was. Each key holds one accumulator (the running reduction), never a
copy per rank, so a key costs its chunk's bytes whatever the world size; a job may hold at most
``max_keys`` keys and ``max_bytes`` bytes of them, at most ``max_jobs`` jobs hold keys at once,
and a contribution that would open a key beyond that is refused (E_BUSY), not buffered. Floating-point sums follow arrival order, and
every rank receives the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import numpy as np

from nezha import aggwire
from nezha.aggwire import Header

_UFUNCS = {1: np.add, 2: np.maximum, 3: np.minimum}


class Refused(Exception):
    """One contribution refused; ``code`` is an aggwire E_* code. The key is unchanged."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """What one job may hold in the switch at once, and for how long."""
    max_keys: int = 256
    max_bytes: int = 256 << 20
    max_jobs: int = 4
    key_timeout: float = 10.0
    max_chunk: int = aggwire.MAX_CHUNK
    max_world: int = aggwire.MAX_WORLD


@dataclass
class Entry:
    """One key in progress: its shape, who has contributed (and where to answer them)."""
    dtype: int
    redop: int
    count: int
    world: int
    acc: np.ndarray
    started: float
    contributors: dict[int, Hashable] = field(default_factory=dict)   # rank -> connection

    @property
    def nbytes(self) -> int:
        return self.acc.nbytes

    def matches(self, h: Header) -> Optional[str]:
        """None if ``h`` describes the same reduction, else what differs."""
        for name, mine, theirs in (("dtype", self.dtype, h.dtype), ("op", self.redop, h.redop),
                                   ("count", self.count, h.count), ("world", self.world, h.world)):
            if mine != theirs:
                return f"{name} {theirs} where the key has {mine}"
        return None


@dataclass
class JobUsage:
    keys: int = 0
    bytes: int = 0


class Table:
    """Keys in progress for every job the switch serves (they share one secret)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.entries: dict[tuple[str, int, int], Entry] = {}
        self.usage: dict[str, JobUsage] = {}

    @property
    def pending_bytes(self) -> int:
        return sum(u.bytes for u in self.usage.values())

    def contribute(self, job: str, h: Header, payload: bytes | bytearray | memoryview,
                   conn: Hashable, now: float) -> Optional[Entry]:
        """Fold one contribution in. Returns the entry (removed from the table) when it was
        the last one the key needed; raises Refused, the table unchanged, otherwise."""
        key = (job, h.op_id, h.chunk)
        data = np.frombuffer(payload, dtype=aggwire.dtype_of(h.dtype), count=h.count)
        entry = self.entries.get(key)
        if entry is None:
            entry = self._open(job, key, h, data, now)
        else:
            why = entry.matches(h)
            if why:
                raise Refused(aggwire.E_MISMATCH, f"op {h.op_id} chunk {h.chunk}: {why}")
            if h.rank in entry.contributors:
                raise Refused(aggwire.E_DUPLICATE, f"op {h.op_id} chunk {h.chunk}: rank "
                              f"{h.rank} already contributed")
            _UFUNCS[h.redop](entry.acc, data, out=entry.acc)
        entry.contributors[h.rank] = conn
        if len(entry.contributors) < entry.world:
            return None
        return self.pop(key)

    def _open(self, job: str, key: tuple[str, int, int], h: Header, data: np.ndarray,
              now: float) -> Entry:
        """A new key, if the job has room for it (checked before the accumulator exists)."""
        if job not in self.usage and len(self.usage) >= self.limits.max_jobs:
            raise Refused(aggwire.E_BUSY, f"op {h.op_id} chunk {h.chunk}: {len(self.usage)} "
                          f"jobs hold keys (at most {self.limits.max_jobs}); retry later")
        use = self.usage.setdefault(job, JobUsage())
        if use.keys + 1 > self.limits.max_keys or use.bytes + h.length > self.limits.max_bytes:
            if not use.keys:
                del self.usage[job]
            raise Refused(aggwire.E_BUSY, f"op {h.op_id} chunk {h.chunk}: job {job!r} holds "
                          f"{use.keys} keys / {use.bytes} bytes (at most {self.limits.max_keys}"
                          f" / {self.limits.max_bytes}); retry after results arrive")
        entry = Entry(h.dtype, h.redop, h.count, h.world, data.copy(), now)
        self.entries[key] = entry
        use.keys += 1
        use.bytes += entry.nbytes
        return entry

    def pop(self, key: tuple[str, int, int]) -> Optional[Entry]:
        """Remove a key (complete, or given up) and release what its job was charged."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            use = self.usage[key[0]]
            use.keys -= 1
            use.bytes -= entry.nbytes
            if not use.keys:
                del self.usage[key[0]]
        return entry

    def expired(self, now: float) -> list[tuple[tuple[str, int, int], Entry]]:
        """Remove and return every key older than the timeout."""
        old = [k for k, e in self.entries.items() if now - e.started >= self.limits.key_timeout]
        return [(k, e) for k in old for e in [self.pop(k)] if e is not None]

    def drop_connection(self, conn: Hashable) -> None:
        """A connection is gone: its ranks stay counted in the keys they contributed to (their
        contribution is in the accumulator), the result just has nowhere to go for them."""
        for entry in self.entries.values():
            for rank, c in list(entry.contributors.items()):
                if c == conn:
                    entry.contributors[rank] = None
