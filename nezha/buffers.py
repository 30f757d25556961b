"""User buffers -> flat numpy arrays sharing their memory (numpy arrays or any writable
object with the buffer protocol), and the copy back for a non-contiguous array; and the
receive buffer the ring keeps between operations (Scratch)."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .errors import ConfigError
from .kinds import DTYPES

_FORMATS = {"f": "float32", "d": "float64", "e": "float16", "i": "int32", "q": "int64",
            "l": "int64", "b": "int8", "B": "uint8"}

WriteBack = Optional[Callable[[], None]]


def as_array(buf, dtype=None) -> tuple[np.ndarray, WriteBack]:
    """-> (1-D contiguous writable ndarray sharing memory with buf, write-back or None)."""
    if isinstance(buf, np.ndarray):
        arr, wb = _from_ndarray(buf, dtype), None
        if not buf.flags.c_contiguous:
            def wb():
                buf[...] = arr.reshape(buf.shape)
    else:
        arr, wb = _from_buffer(buf, dtype), None
    if arr.dtype.name not in DTYPES:
        raise ConfigError(f"unsupported dtype {arr.dtype.name} (supported: {', '.join(DTYPES)})")
    return arr, wb


def _from_ndarray(buf: np.ndarray, dtype) -> np.ndarray:
    if dtype is not None and np.dtype(dtype) != buf.dtype:
        raise ConfigError(f"dtype {dtype} given for an array of {buf.dtype}")
    if not buf.flags.writeable:
        raise ConfigError("buffer is read-only")
    if buf.flags.c_contiguous:
        return buf.reshape(-1)
    return np.ascontiguousarray(buf).reshape(-1)


def _from_buffer(buf, dtype) -> np.ndarray:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ConfigError(f"{type(buf).__name__} supports neither numpy nor the buffer protocol")
    if mv.readonly:
        raise ConfigError("buffer is read-only")
    if not mv.c_contiguous:
        raise ConfigError("buffer is not contiguous")
    if dtype is None:
        dtype = _FORMATS.get(mv.format)
        if dtype is None or dtype not in DTYPES:
            raise ConfigError(f"cannot infer a dtype from buffer format {mv.format!r}: pass dtype=")
    dt = np.dtype(dtype)
    raw = mv.cast("B")
    if len(raw) % dt.itemsize:
        raise ConfigError(f"buffer of {len(raw)} bytes is not a whole number of {dt.name}")
    return np.frombuffer(raw, dtype=dt)


def written_back(buf, wb: WriteBack):
    """Finish an in-place call: copy the result into a non-contiguous ``buf``; return buf."""
    if wb:
        wb()
    return buf


class Scratch:
    """A receive buffer kept from one operation to the next. Fresh memory costs the kernel
    a page fault and a page clear at first touch: on 2 ranks x 2 rails of 4 Gbit/s, 16 MiB,
    the ring's new receive buffer per operation put 2 % of both cores in ``clear_page_erms``
    (under the receives' copies; ``perf record -a``). Buffers above ``keep_max`` bytes are
    not kept (an occasional huge operation does not pin its size in memory); one operation
    at a time uses it (Context runs them under a lock), and ``release`` lets it go."""

    def __init__(self, keep_max: int = 256 << 20):
        self.keep_max = keep_max
        self._buf = np.empty(0, np.uint8)

    def take(self, nbytes: int, dtype) -> np.ndarray:
        """``nbytes`` of scratch as a 1-D array of ``dtype`` (contents undefined)."""
        if nbytes > self.keep_max:
            return np.empty(nbytes, np.uint8).view(dtype)
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(nbytes, np.uint8)
        return self._buf[:nbytes].view(dtype)

    @property
    def kept(self) -> int:
        """Bytes held between operations."""
        return self._buf.nbytes

    def release(self) -> None:
        """Hold nothing (the context is closed)."""
        self._buf = np.empty(0, np.uint8)
