"""The switch's reduction throughput (``aggregation_rate``), emulated by pacing its results.

A token bucket in bytes: a completed key's result (s bytes, whatever the world size: each
element is reduced once across all ranks, as a switch does at line rate) waits until the
bucket has paid for it. Debt-based: the bucket may go negative by one result and the waiter
sleeps the debt off, so a result larger than the burst is never stuck. Burst: 10 ms of rate
(more would let the first results of an operation through above the rate). No rate: no pacing (the rail's tc shaping already limits
the wire)."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

BURST_SECONDS = 0.010


class TokenBucket:
    def __init__(self, rate_bps: Optional[int], min_burst: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate {rate_bps} bit/s: expected a positive rate or None")
        self.rate = None if rate_bps is None else rate_bps / 8.0     # bytes per second
        self.burst = 0.0 if self.rate is None else max(float(min_burst),
                                                       self.rate * BURST_SECONDS)
        self.tokens = self.burst
        self.clock = clock
        self.stamp = clock()
        self.lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may leave at the rate (FIFO among waiters)."""
        if self.rate is None:
            return
        async with self.lock:
            self._refill()
            self.tokens -= nbytes
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)
