"""Torch tensors -> the flat numpy arrays a nezha Context works on in place, and back.

Reductions: float32, float64, float16, int32 and int64 are reduced by Nezha as they are (the
tensor's own memory when it is contiguous). The others are widened first, reduced, and
narrowed back, which keeps every rank's result identical because every rank narrows the same
bits the same way:

* bfloat16 -> float32: each partial sum is kept in float32 and rounded to bfloat16 once, at
  the end (round to nearest even): more accurate than summing in bfloat16, never less.
* int8, int16, uint8 -> int32: integer sums and products wrap modulo 2**32 and are then cut
  to the low 8 or 16 bits, which is exactly the wrap-around of summing in the narrow type;
  max and min are exact.

AVG is SUM followed by a division by the group size on the (possibly widened) result, so
only floating types take it. bool, complex and the bitwise ops are refused.

Data movement (broadcast, allgather) does not look at values: any dtype travels as its bytes,
padded to whole 4-byte words (Nezha's int32) when its size is odd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError

NATIVE = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64)
WIDEN = {torch.bfloat16: torch.float32, torch.int8: torch.int32, torch.int16: torch.int32,
         torch.uint8: torch.int32}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_OPS = [(dist.ReduceOp.SUM, "sum", False), (dist.ReduceOp.AVG, "sum", True),
        (dist.ReduceOp.PRODUCT, "prod", False), (dist.ReduceOp.MIN, "min", False),
        (dist.ReduceOp.MAX, "max", False)]
SUPPORTED_OPS = "SUM, AVG, MAX, MIN, PRODUCT"
SUPPORTED_DTYPES = "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8"


class UnsupportedCall(ConfigError, NotImplementedError):
    """A collective, reduction op or dtype the nezha backend does not provide."""


@dataclass(frozen=True)
class Reduction:
    """What a ReduceOp means to Nezha: the op to run, and whether to divide by the size."""
    op: str
    average: bool


def reduction(op, call: str) -> Reduction:
    """The Reduction for a ``ReduceOp`` (or options carrying one in ``reduceOp``)."""
    rop = getattr(op, "reduceOp", op)
    for known, name, avg in _OPS:
        if rop == known:
            return Reduction(name, avg)
    raise UnsupportedCall(f"{call}: reduction op {op_name(rop)} is not supported by the nezha "
                          f"backend (supported: {SUPPORTED_OPS})")


def op_name(rop) -> str:
    """'BAND', 'PREMUL_SUM'...: a ReduceOp's repr does not say which it is."""
    for name in dist.ReduceOp.RedOpType.__members__:
        if rop == getattr(dist.ReduceOp, name):
            return name
    return repr(rop)


def check_reducible(t: torch.Tensor, red: Reduction, call: str) -> None:
    """Refuse, on the caller's thread and before any byte moves, what cannot be reduced."""
    if t.device.type != "cpu":
        raise UnsupportedCall(f"{call}: the nezha backend takes CPU tensors, got {t.device}")
    if t.dtype not in NATIVE and t.dtype not in WIDEN:
        raise UnsupportedCall(f"{call}: dtype {t.dtype} cannot be reduced by the nezha backend "
                              f"(supported: {SUPPORTED_DTYPES})")
    if red.average and t.dtype not in FLOATS:
        raise UnsupportedCall(f"{call}: AVG needs a floating dtype, got {t.dtype} "
                              f"(use SUM and divide)")


def check_cpu(tensors, call: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise UnsupportedCall(f"{call}: the nezha backend takes CPU tensors, got {t.device}")


def numpy_of(t: torch.Tensor) -> np.ndarray:
    """A flat numpy array sharing ``t``'s memory (``t`` contiguous, a dtype numpy has)."""
    return t.detach().reshape(-1).numpy()


def staged(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when Nezha can work in its memory, else a contiguous copy in the dtype
    Nezha reduces (widened)."""
    wide = WIDEN.get(t.dtype)
    if wide is not None:
        return t.detach().to(wide, memory_format=torch.contiguous_format)
    return t if t.is_contiguous() else t.detach().contiguous()


def finish(t: torch.Tensor, work: torch.Tensor, red: Reduction, size: int) -> None:
    """AVG's division (on the wide result), then the copy into ``t`` if Nezha did not work in
    its memory (narrowing: rounds bfloat16 to nearest even, wraps integers)."""
    if red.average:
        work.div_(size)
    if work is not t:
        t.detach().copy_(work.reshape(t.shape))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8)


def words(data: torch.Tensor) -> tuple[np.ndarray, Callable[[], None]]:
    """(int32 array over the bytes of ``data``, uint8 1-D, and the copy back). Zero-copy when
    the size is a multiple of 4 bytes; else a zero-padded copy, copied back by the callable."""
    raw = data.numpy()
    if raw.size % 4 == 0:
        return raw.view(np.int32), lambda: None
    buf = np.zeros(-(-raw.size // 4) * 4, dtype=np.uint8)
    buf[:raw.size] = raw

    def back() -> None:
        raw[:] = buf[:raw.size]
    return buf.view(np.int32), back


def contiguous_bytes(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """(uint8 view of ``t``'s bytes or of a contiguous copy, write-back to ``t``)."""
    if t.is_contiguous():
        return byte_view(t), lambda: None
    stage = t.detach().contiguous()
    return byte_view(stage), lambda: t.detach().copy_(stage)


def write_bytes(t: torch.Tensor, data: np.ndarray) -> None:
    """Fill tensor ``t`` (any layout) with ``data`` (uint8, exactly t's size in bytes)."""
    view, back = contiguous_bytes(t)
    view.numpy()[:] = data
    back()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
