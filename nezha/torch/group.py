"""NezhaProcessGroup: torch.distributed's ProcessGroup interface over one nezha Context.

A Python subclass of ``torch.distributed.ProcessGroup`` (the pybind trampoline routes the C++
callers, DDP's reducer among them, to these methods). Each call checks its arguments on the
caller's thread (an unsupported dtype or op raises there, on every rank alike, before anything
is sent), then queues the collective on the group's worker (work.py) and returns its Work.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config
from ..context import Context
from . import tensors as T
from .store import C10dStore
from .tensors import UnsupportedCall
from .work import NezhaWork, Worker

SUPPORTED = ("allreduce (and coalesced), broadcast, allgather, all_gather_into_tensor (and "
             "coalesced), reduce_scatter, reduce_scatter_tensor (and coalesced), barrier")


def _pairs(outputs, inputs, call: str) -> list:
    if len(outputs) != len(inputs):
        raise ValueError(f"{call}: {len(outputs)} outputs for {len(inputs)} inputs")
    return list(zip(outputs, inputs))


def _refused(call: str) -> Callable[..., NoReturn]:
    """A method for a collective the backend does not provide: it says so, and what it has."""
    def method(self, *args, **kwargs) -> NoReturn:
        raise UnsupportedCall(f"{call} is not supported by the nezha backend (supported: "
                              f"{SUPPORTED}; reduction ops {T.SUPPORTED_OPS})")
    method.__name__ = call
    return method


class NezhaProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run on Nezha's rails (see nezha/torch/__init__.py)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta,
                 config: Config | None = None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name, self._group_desc = "", ""
        secs = timeout.total_seconds()
        self.ctx = Context(rank, size, store=C10dStore(store, secs), timeout=secs,
                           config=config if config is not None else Config.from_env())
        self._worker = Worker(f"nezha-pg-r{rank}")

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "nezha"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"NezhaProcessGroup(rank={self._rank}, size={self._size}, rails={self.ctx.rail_addrs})"

    def _submit(self, name: str, job: Callable[[], None], result: list) -> NezhaWork:
        return self._worker.submit(name, job, result)

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None) -> NezhaWork:
        """Every tensor of the list reduced over the group, in place, one after the other."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        red = T.reduction(opts if opts is not None else dist.ReduceOp.SUM, "allreduce")
        for t in tensors:
            T.check_reducible(t, red, "allreduce")

        def job() -> None:
            for t in tensors:
                work = T.staged(t)
                self.ctx.allreduce(T.numpy_of(work), op=red.op)
                T.finish(t, work, red, self._size)
        return self._submit("allreduce", job, tensors)

    def allreduce_coalesced(self, tensors, opts=None) -> NezhaWork:
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=None) -> NezhaWork:
        """outputs[i] = reduction over ranks of inputs[i][rank] (list form, size-long lists)."""
        red = T.reduction(opts if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        plans = [self._rs_plan(out, list(ins), red)
                 for out, ins in _pairs(outputs, inputs, "reduce_scatter")]
        return self._submit("reduce_scatter", lambda: [p() for p in plans], list(outputs))

    def reduce_scatter_single(self, output, input, opts=None) -> NezhaWork:
        """output = this rank's block of the reduction of ``input`` (size x output.numel())."""
        red = T.reduction(opts if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        plan = self._rs_plan(output, [input], red)
        return self._submit("reduce_scatter_tensor", plan, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> NezhaWork:
        """reduce_scatter_tensor for each pair, as one job (torch's coalescing manager)."""
        red = T.reduction(opts if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        plans = [self._rs_plan(o, [i], red) for o, i in _pairs(outputs, inputs, "reduce_scatter")]
        return self._submit("reduce_scatter_tensor", lambda: [p() for p in plans], list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _rs_plan(self, out: torch.Tensor, ins: list, red: T.Reduction) -> Callable[[], None]:
        """Check one reduce-scatter and return the job that runs it."""
        call = "reduce_scatter"
        for t in [out] + ins:
            T.check_reducible(t, red, call)
            if t.dtype != out.dtype:
                raise ValueError(f"{call}: dtype {t.dtype} among inputs of {out.dtype}")
        total = sum(t.numel() for t in ins)
        listed = len(ins) > 1 and (len(ins) != self._size
                                   or any(t.numel() != out.numel() for t in ins))
        if total != self._size * out.numel() or listed:
            raise ValueError(f"{call}: the input must hold group size x output = "
                             f"{self._size} x {out.numel()} elements, got {total}")
        wide = T.WIDEN.get(out.dtype, out.dtype)

        def job() -> None:
            flat = torch.cat([t.detach().reshape(-1) for t in ins]) if len(ins) > 1 \
                else ins[0].detach().reshape(-1)
            flat = flat.to(wide, memory_format=torch.contiguous_format)
            work = T.staged(out)
            self.ctx.reduce_scatter(T.numpy_of(flat), T.numpy_of(work), op=red.op)
            T.finish(out, work, red, self._size)
        return job

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None) -> NezhaWork:
        """Every tensor of the list from ``opts.rootRank``, as bytes (any dtype)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = opts.rootRank if opts is not None else 0
        T.check_cpu(tensors, "broadcast")
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast: root {root} is outside 0..{self._size - 1}")

        def job() -> None:
            for t in tensors:
                data, back = T.contiguous_bytes(t)
                arr, unpad = T.words(data)
                self.ctx.broadcast(arr, root=root)
                unpad()
                back()
        return self._submit("broadcast", job, tensors)

    def allgather(self, outputs, inputs, opts=None) -> NezhaWork:
        """outputs[i][r] = rank r's inputs[i] (list form; any dtype, as bytes)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"allgather: {len(outputs)} output lists for {len(inputs)} inputs")
        for outs, t in zip(outputs, inputs):
            self._check_gather(list(outs), t, "allgather")

        def job() -> None:
            for outs, t in zip(outputs, inputs):
                blocks = self._gather_bytes(t)
                for r, o in enumerate(outs):
                    T.write_bytes(o, blocks[r])
        return self._submit("allgather", job, list(outputs))

    def all_gather_single(self, output, input, opts=None) -> NezhaWork:
        """``output`` (size x input.numel()) gets every rank's ``input`` in rank order."""
        return self._submit("all_gather_into_tensor", self._gather_plan(output, input), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> NezhaWork:
        """all_gather_into_tensor for each pair, as one job (torch's coalescing manager)."""
        plans = [self._gather_plan(o, i) for o, i in _pairs(outputs, inputs, "all_gather")]
        return self._submit("all_gather_into_tensor", lambda: [p() for p in plans], list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gather_plan(self, output: torch.Tensor, input: torch.Tensor) -> Callable[[], None]:
        """Check one all_gather_into_tensor and return the job that runs it: zero-copy when
        both are contiguous whole words, else through the padded byte path."""
        T.check_cpu([output, input], "all_gather_into_tensor")
        if output.dtype != input.dtype or output.numel() != self._size * input.numel():
            raise ValueError(f"all_gather_into_tensor: output must hold group size x input = "
                             f"{self._size} x {input.numel()} elements of {input.dtype}, got "
                             f"{output.numel()} of {output.dtype}")

        def job() -> None:
            if T.nbytes(input) % 4 == 0 and output.is_contiguous() and input.is_contiguous():
                self.ctx.allgather(T.byte_view(input).numpy().view(np.int32),
                                   T.byte_view(output).numpy().view(np.int32))
            else:
                T.write_bytes(output, np.concatenate(self._gather_bytes(input)))
        return job

    def _check_gather(self, outs: list, t: torch.Tensor, call: str) -> None:
        T.check_cpu(outs + [t], call)
        if len(outs) != self._size:
            raise ValueError(f"{call}: {len(outs)} output tensors for a group of {self._size}")
        for o in outs:
            if o.dtype != t.dtype or o.numel() != t.numel():
                raise ValueError(f"{call}: output {tuple(o.shape)} {o.dtype} for input "
                                 f"{tuple(t.shape)} {t.dtype}")

    def _gather_bytes(self, t: torch.Tensor) -> list:
        """Every rank's bytes of ``t``, in rank order (uint8 arrays), via a padded allgather."""
        data, _ = T.contiguous_bytes(t)
        arr, _ = T.words(data)
        out = np.empty(self._size * arr.size, dtype=np.int32)
        self.ctx.allgather(arr, out)
        raw, n, step = out.view(np.uint8), data.numel(), arr.size * 4
        return [raw[r * step:r * step + n] for r in range(self._size)]

    def barrier(self, opts=None) -> NezhaWork:
        return self._submit("barrier", self.ctx.barrier, [])

    # ------------------------------------------------------------------ not provided
    send = _refused("send")
    recv = _refused("recv")
    recv_anysource = _refused("recv_anysource")
    alltoall = _refused("alltoall")
    alltoall_base = _refused("all_to_all_single")
    all_to_all_single = _refused("all_to_all_single")
    gather = _refused("gather")
    scatter = _refused("scatter")
    reduce = _refused("reduce")
    allgather_coalesced = _refused("allgather_coalesced")
    monitored_barrier = _refused("monitored_barrier")

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """destroy_process_group: finish the queued collectives, then close the Context."""
        self._worker.close("the process group was shut down")
        self.ctx.close()

    def abort(self) -> None:
        """Fail the queued collectives and close the Context now (a running one fails)."""
        self._worker.fail_queued("the process group was aborted")
        self.ctx.close()
        self._worker.close("the process group was aborted", drain=False)
