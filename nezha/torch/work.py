"""Asynchronous work: one background thread per process group runs its collectives.

A nezha Context takes one collective at a time, and every rank must issue them in the same
order. torch issues them from several threads (DDP's gradient buckets come from the autograd
engine while the main thread may broadcast), so each call becomes a job on one FIFO queue and
one worker thread runs the jobs in submission order; the caller gets a ``Work`` at once, which
is what lets DDP overlap the reduction of a bucket with the rest of the backward pass.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import CommError


class NezhaWork(dist.Work):
    """The handle of one queued collective: ``wait()``, ``is_completed()``, ``get_future()``
    (a torch Future completed with ``result``, the output tensors, or with the error)."""

    def __init__(self, name: str, result: list, runner: threading.Thread | None = None):
        super().__init__()
        self.name = name
        self._runner = runner
        self._result = result
        self._future: torch.futures.Future = torch.futures.Future()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        """Called once, by the worker thread (never holding a lock: the future's callbacks,
        e.g. DDP's division by the world size, run here)."""
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise the collective's error. ``timeout`` (0 or None: none)."""
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._done.is_set() and threading.current_thread() is self._runner:
            raise CommError(f"nezha {self.name}: waited for on the group's own worker thread (in "
                            f"a future callback?), which would never run it")
        if not self._done.wait(secs if secs else None):
            raise TimeoutError(f"nezha {self.name}: not complete within {secs:g} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future

    def synchronize(self) -> None:
        """CPU tensors: nothing to order on a stream."""


class Worker:
    """The FIFO queue of one process group and the thread that drains it."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed: str | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, name: str, job: Callable[[], None], result: list) -> NezhaWork:
        """Queue ``job`` (runs on the worker thread); the Work completes with ``result``."""
        work = NezhaWork(name, result, self._thread)
        with self._lock:
            if self._closed is not None:
                raise CommError(f"nezha {name}: {self._closed}")
            self._q.put((work, job))
        return work

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            work, job = item
            try:
                job()
            except BaseException as e:     # handed to whoever waits on the work
                work._finish(e)
            else:
                work._finish(None)

    def close(self, why: str, drain: bool = True) -> None:
        """No more submissions; finish what is queued (``drain``) or fail it with ``why``."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = why
            if not drain:
                self.fail_queued(why)
            self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def fail_queued(self, why: str) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0]._finish(CommError(f"nezha {item[0].name}: {why}"))
