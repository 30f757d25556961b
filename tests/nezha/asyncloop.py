"""Helpers for tests that run an asyncio service on an event loop in a thread of its own."""
from __future__ import annotations

import asyncio


async def cancel_the_rest() -> None:
    """Cancel what is still pending on this loop and wait for it, so that no coroutine is left
    for the garbage collector to end on a closed loop (an aggregation handler ended that way
    wrote to a closed loop: a PytestUnraisableExceptionWarning in a full suite)."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in rest:
        t.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
