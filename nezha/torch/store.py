"""The c10d store torch hands a backend, behind the interface nezha's rendezvous expects.

Why this store and not Nezha's own (``nezha/store.py``): torch already runs one for every
process group (torchrun's TCPStore, wrapped in a PrefixStore per group), so there is no second
port to pick or to find taken, the process that serves it need not be group rank 0 on
MASTER_ADDR, and ``new_group`` sub-groups get their own key space for free. What it costs: the
c10d store is not authenticated, so NEZHA_JOB_SECRET protects the rail connections (the rail
key is an HMAC of the secret; rendezvous.py) but not the store requests, the same trust torch's
own backends place in it.

The rendezvous uses set, get (with a timeout), add, wait (several keys), check and abort; a wait
fails early once another rank has aborted, as with Nezha's store. c10d's own wait cannot be
interrupted by the abort key, so waits poll ``check`` every POLL seconds.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from ..errors import RendezvousAborted, StoreError, StoreTimeout
from ..store import ABORT_KEY

POLL = 0.01       # s between two checks of a waited-for key


class C10dStore:
    """Adapter: ``nezha.store.StoreClient``'s methods over a ``torch.distributed.Store``."""

    def __init__(self, store, timeout: float):
        self._store = store
        self.timeout = float(timeout)

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:      # DistStoreError, DistNetworkError, RuntimeError
            raise StoreError(f"c10d store {what} failed: {e}") from e

    def set(self, key: str, value) -> None:
        data = bytes(value) if isinstance(value, (bytes, bytearray)) else str(value).encode()
        self._call("set", self._store.set, key, data)

    def get(self, key: str, timeout: float | None = None) -> str:
        self.wait([key], timeout)
        return self._call("get", self._store.get, key).decode()

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._call("add", self._store.add, key, int(delta)))

    def check(self, keys: Iterable[str]) -> bool:
        return bool(self._call("check", self._store.check, list(keys)))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Until every key is set; StoreTimeout after ``timeout`` s, RendezvousAborted as soon
        as a rank has aborted the rendezvous."""
        keys = list(keys)
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
        while True:
            if self.check([ABORT_KEY]):
                raise RendezvousAborted(self._call("get", self._store.get, ABORT_KEY).decode())
            if self.check(keys):
                return
            if time.monotonic() >= deadline:
                missing = [k for k in keys if not self.check([k])]
                raise StoreTimeout(f"store keys not set within {timeout:g} s: {missing}"
                                   if timeout is not None else f"store keys not set: {missing}")
            time.sleep(POLL)

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", self._store.delete_key, key))

    def abort(self, reason: str) -> None:
        """Make every current and later wait on this store fail with ``reason``."""
        try:
            self.set(ABORT_KEY, reason)
        except StoreError:
            pass

    def close(self) -> None:
        """Nothing to close: torch owns the store."""
