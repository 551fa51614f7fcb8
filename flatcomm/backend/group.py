"""The ``flatcomm`` process group: torch.distributed's ops, with flatcomm's sums for float reductions.

torch 2.13 lets a Python ``dist.ProcessGroup`` subclass be a backend (``Backend.register_backend``
with a creator that returns one). Its inner backends, registered on it per device (gloo for CPU
tensors, NCCL for CUDA where torch has it, made from the same store under their own prefix), carry
every op flatcomm does not change: broadcast, barrier, send/recv, all-gather, all-to-all,
gather/scatter, and the reductions of integers or with MAX/MIN/PRODUCT/bitwise ops. Each is a
method here that calls the inner backend's binding (see the note above the pass-through methods).

torch calls these methods by these names from Python (``dist.all_reduce`` -> ``allreduce``,
``dist.reduce_scatter_tensor`` -> ``reduce_scatter_single``) and from C++ through pybind's trampoline
(DDP's reducer and functional collectives: ``allreduce``, ``allreduce_coalesced``, ``reduce_scatter``,
``reduce_scatter_tensor_coalesced``). ``reduce`` is overridden for Python callers only: C++ code
calling ``reduce`` on this group reaches gloo's sum.

flatcomm's collectives run on flatcomm's private copy of this group (itself a flatcomm group, made
by ``dist.new_group`` at the group's first float reduction: a collective of the group's members),
so they never pair with the caller's own ops on this group.
"""
from __future__ import annotations

import collections
import datetime
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # (not re-exported by torch.distributed)
from torch.distributed import PrefixStore

from .._snapshot import Snapshot
from ..collectives import CommStats, group_timeout
from ..comm.groups import forget
from . import reduce as _reduce
from .forms import checked_list, reduce_form, torch_forms
from .work import ReductionWork

__all__ = ["FlatcommGroup", "create"]

NAME = "flatcomm"


def _inner_backends(store, rank: int, size: int, timeout: datetime.timedelta, group_name: str,
                    ranks: List[int]) -> list:
    """(device, backend type, backend) of the inner transports: gloo for CPU, NCCL for CUDA."""
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout=timeout)
    gloo.options.global_ranks_in_group = ranks
    gloo.options.group_name = group_name  # type: ignore[assignment]  # (a str at run time)
    gloo._set_sequence_number_for_group()
    out: list = [(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)]
    if torch.cuda.is_available() and dist.is_nccl_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = ranks
        opts.group_name = group_name  # type: ignore[assignment]
        nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, opts)
        out.append((torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl))
    return out


class FlatcommGroup(dist.ProcessGroup):
    """A process group whose float SUM / AVG / PREMUL_SUM reductions are flatcomm's ordered or exact
    sums (:mod:`flatcomm.backend.settings` says which), everything else its inner backend's."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, group_name: str = "",
                 ranks: Optional[List[int]] = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # (torch's stub lists only the store form)
        self._timeout = timeout
        # What flatcomm's reductions on this group sent and took (read as :attr:`stats`); the
        # collectives add to it on the group's worker, in order.
        self.counters = CommStats()
        self.reductions = 0  # calls of this group's reduction methods that flatcomm ran
        # all-reduces (and reductions passed through) by route (flatcomm.comm.route): see route()
        self.routes: collections.Counter = collections.Counter()
        # (numel, dtype, op) -> (settings, flatcomm.comm.prepared.Prepared or None, groups.generation()):
        # see reduce.py
        self.prepared: dict = {}
        for device, kind, backend in _inner_backends(store, rank, size, timeout, group_name,
                                                     ranks if ranks is not None else list(range(size))):
            self._register_backend(device, kind, backend)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)

    def getBackendName(self) -> str:
        return NAME

    @property
    def stats(self) -> Snapshot:
        """flatcomm's reductions on this group so far, a read-only :class:`flatcomm.stats.Snapshot`
        (``source="backend"``; ``calls`` counts collectives, one per dtype of a coalesced call;
        detail: ``reductions``, the calls torch made; ``routes``, the all-reduces and the reductions
        passed through by route, :func:`flatcomm.backend.route`). Other passed-through ops are
        not counted.

        Example::

            dist.init_process_group("flatcomm")
            ...
            snap = flatcomm.backend.stats()   # or dist.group.WORLD.stats
            snap.wire_bytes, snap["reductions"]
        """
        return Snapshot.of("backend", self.counters, {"reductions": self.reductions, "routes": dict(self.routes)})

    def shutdown(self) -> None:
        """What ``destroy_process_group`` calls: also drop flatcomm's private copy of this group,
        so nothing of flatcomm's keeps its gloo threads alive (see :mod:`flatcomm.comm.groups`)."""
        forget(self)
        self.prepared.clear()
        super().shutdown()

    def _inner(self, t: torch.Tensor) -> Any:
        return self._get_backend(t.device)

    def _wait_limit(self, opts) -> Optional[datetime.timedelta]:
        t = getattr(opts, "timeout", None)
        if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
            return t
        return group_timeout(self) or self._timeout

    # ---- reductions flatcomm runs (the rest: the inner backend) ------------------------------------
    # Each method takes torch's canonical form; @torch_forms sends the others through torch's binding.

    @torch_forms("allreduce", 1, dist.AllreduceOptions)
    def allreduce(self, tensors: List[torch.Tensor], opts: Optional[dist.AllreduceOptions] = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensors = checked_list("allreduce", tensors, single=True)
        how = _reduce.plan(opts.reduceOp, tensors)
        if how is None:
            _reduce.guard(self, "all_reduce", tensors, opts.reduceOp)
            return self._inner(tensors[0]).allreduce(tensors, opts)
        return _reduce.all_reduce(self, tensors, how, lambda: self._wait_limit(opts))

    @torch_forms("allreduce_coalesced", 1, dist.AllreduceCoalescedOptions)
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Optional[dist.AllreduceCoalescedOptions] = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = checked_list("allreduce_coalesced", tensors, single=False, same_size=False)
        how = _reduce.plan(opts.reduceOp, tensors)
        if how is None:
            _reduce.guard(self, "all_reduce", tensors, opts.reduceOp)
            return self._inner(tensors[0]).allreduce_coalesced(tensors, opts)
        return _reduce.all_reduce(self, tensors, how, lambda: self._wait_limit(opts))

    def reduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        """``(tensors, opts=None)`` or ``(tensor, root, op=SUM, timeout=None)``, as torch binds it."""
        tensors, opts = reduce_form(args, kwargs)
        tensors = checked_list("reduce", tensors, single=True)
        how = _reduce.plan(opts.reduceOp, tensors)
        if how is None:
            _reduce.guard(self, "all_reduce", tensors, opts.reduceOp)
            return self._inner(tensors[0]).reduce(tensors, opts)
        return _reduce.reduce(self, tensors, opts.rootRank, how, lambda: self._wait_limit(opts))

    @torch_forms("reduce_scatter", 2, dist.ReduceScatterOptions, (0, 1))
    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: Optional[dist.ReduceScatterOptions] = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outputs = checked_list("reduce_scatter", outputs, single=True)
        if len(input_lists) != 1:
            raise ValueError(f"flatcomm: reduce_scatter takes one input list per output, got {len(input_lists)}")
        inputs = checked_list("reduce_scatter", input_lists[0], single=False)
        how = _reduce.plan(opts.reduceOp, outputs + inputs)
        if how is None:
            _reduce.guard(self, "reduce_scatter", inputs, opts.reduceOp)
            return self._inner(outputs[0]).reduce_scatter(outputs, [inputs], opts)
        return _reduce.reduce_scatter_lists(self, outputs, [inputs], how, self._wait_limit(opts))

    @torch_forms("reduce_scatter_single", 2, dist.ReduceScatterOptions, ())
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Optional[dist.ReduceScatterOptions] = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output, input = checked_list("reduce_scatter_single", [output, input], single=False, same_size=False)
        how = _reduce.plan(opts.reduceOp, [output, input])
        if how is None:
            _reduce.guard(self, "reduce_scatter", [input], opts.reduceOp)
            return self._inner(output)._reduce_scatter_base(output, input, opts)
        return _reduce.reduce_scatter(self, [output], [input], how, self._wait_limit(opts))

    _reduce_scatter_base = reduce_scatter_single

    @torch_forms("reduce_scatter_tensor_coalesced", 2, dist.ReduceScatterOptions, (0, 1))
    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Optional[dist.ReduceScatterOptions] = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outputs = checked_list("reduce_scatter_tensor_coalesced", outputs, single=False, same_size=False)
        inputs = checked_list("reduce_scatter_tensor_coalesced", inputs, single=False, same_size=False)
        how = _reduce.plan(opts.reduceOp, outputs + inputs)
        if how is None:
            _reduce.guard(self, "reduce_scatter", inputs, opts.reduceOp)
            inner = self._inner(outputs[0])
            return ReductionWork([inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs,
                                 None, None)
        return _reduce.reduce_scatter(self, outputs, inputs, how, self._wait_limit(opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- passed through, called on the inner backend from Python -----------------------------------
    # pybind's trampoline calls the base class's op while holding the GIL, and a gloo thread that
    # frees a finished work needs the GIL to drop its tensors' Python objects while it holds gloo's
    # queue lock: a deadlock with the next op enqueued under the GIL. The inner backend's Python
    # bindings release the GIL, so every op goes through one of them.

    @torch_forms("broadcast", 1, dist.BroadcastOptions)
    def broadcast(self, tensors: List[torch.Tensor], opts: Optional[dist.BroadcastOptions] = None) -> dist.Work:
        return self._inner(tensors[0]).broadcast(tensors, opts if opts is not None else dist.BroadcastOptions())

    @torch_forms("allgather", 2, AllgatherOptions, (0, 1))
    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Optional[AllgatherOptions] = None) -> dist.Work:
        return self._inner(inputs[0]).allgather(output_lists, inputs,
                                                opts if opts is not None else AllgatherOptions())

    @torch_forms("allgather_coalesced", 2, AllgatherOptions, (0, 1))
    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Optional[AllgatherOptions] = None) -> dist.Work:
        return self._inner(inputs[0]).allgather_coalesced(output_lists, inputs,
                                                          opts if opts is not None else AllgatherOptions())

    @torch_forms("all_gather_single", 2, AllgatherOptions, ())
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Optional[AllgatherOptions] = None) -> dist.Work:
        return self._inner(input)._allgather_base(output, input, opts if opts is not None else AllgatherOptions())

    _allgather_base = all_gather_single

    @torch_forms("allgather_into_tensor_coalesced", 2, AllgatherOptions, (0, 1))
    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Optional[AllgatherOptions] = None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        inner = self._inner(inputs[0])
        return ReductionWork([inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)], list(outputs),
                             None, None)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @torch_forms("all_to_all_single", 4, dist.AllToAllOptions, (2, 3))
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                          input_splits: List[int], opts: Optional[dist.AllToAllOptions] = None) -> dist.Work:
        return self._inner(input).alltoall_base(output, input, output_splits, input_splits,
                                                opts if opts is not None else dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    @torch_forms("alltoall", 2, dist.AllToAllOptions, (0, 1))
    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Optional[dist.AllToAllOptions] = None) -> dist.Work:
        return self._inner(inputs[0]).alltoall(outputs, inputs, opts if opts is not None else dist.AllToAllOptions())

    @torch_forms("gather", 2, dist.GatherOptions, (0, 1))
    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Optional[dist.GatherOptions] = None) -> dist.Work:
        return self._inner(inputs[0]).gather(output_lists, inputs, opts if opts is not None else dist.GatherOptions())

    @torch_forms("scatter", 2, dist.ScatterOptions, (0, 1))
    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Optional[dist.ScatterOptions] = None) -> dist.Work:
        return self._inner(outputs[0]).scatter(outputs, input_lists,
                                               opts if opts is not None else dist.ScatterOptions())

    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803 - torch's keyword names
        return self._inner(tensors[0]).send(tensors, dstRank, tag)

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        return self._inner(tensors[0]).recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._inner(tensors[0]).recv_anysource(tensors, tag)

    @torch_forms("barrier", 0, dist.BarrierOptions, ())
    def barrier(self, opts: Optional[dist.BarrierOptions] = None) -> dist.Work:
        cpu: Any = self._get_backend(torch.device("cpu"))  # (torch's stub lacks the ops of its backends)
        return cpu.barrier(opts if opts is not None else dist.BarrierOptions())

    def monitored_barrier(self, timeout: Optional[datetime.timedelta] = None, wait_all_ranks: bool = False) -> None:
        gloo: Any = self._get_backend(torch.device("cpu"))
        return gloo.monitored_barrier(timeout if timeout is not None else self._timeout, wait_all_ranks)


def create(dist_opts, backend_options=None) -> FlatcommGroup:
    """The creator ``Backend.register_backend(..., extended_api=True)`` calls for every group."""
    return FlatcommGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                         str(dist_opts.group_id), list(dist_opts.global_ranks_in_group))
