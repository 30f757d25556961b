"""The signal guard: Ctrl-C and SIGTERM become KeyboardInterrupt at points where unwinding is safe,
so a build or a run is torn down by the code that built it and nothing half-built is left."""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Callable, Iterator

_pending_signal: list[int] = []


def checkpoint() -> None:
    """Raise KeyboardInterrupt here if Ctrl-C or SIGTERM arrived during a build."""
    if _pending_signal:
        signum = _pending_signal.pop()
        _pending_signal.clear()
        raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def _signal_handlers(signals: tuple, on_signal: Callable[[int], None]) -> Iterator[None]:
    """Route ``signals`` to ``on_signal`` in this process for the block; a forked helper of
    pyroute2's (it forks to enter namespaces) that inherits the handler just exits."""
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            os._exit(128 + signum)
        on_signal(signum)
    try:
        old = {sig: signal.signal(sig, handler) for sig in signals}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def interrupts_at_checkpoints():
    """During a build, SIGINT and SIGTERM only set a flag that ``checkpoint()`` turns into
    KeyboardInterrupt between kernel operations. Raising from the signal handler itself can
    land in an at-fork hook (pyroute2 forks to enter namespaces; logging hooks every fork),
    where Python prints "Exception ignored" and the build carries on, leaving a fabric that
    nobody asked for."""
    return _signal_handlers((signal.SIGINT, signal.SIGTERM), _pending_signal.append)


def _raise_interrupt(signum: int) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def sigterm_as_interrupt():
    """During a run, SIGTERM unwinds like Ctrl-C so everything built is removed."""
    return _signal_handlers((signal.SIGTERM,), _raise_interrupt)
