"""The reductions the flatcomm backend runs itself, through :mod:`flatcomm.collectives`.

Which calls: float tensors (fp32, bf16, fp16) with op SUM, AVG or PREMUL_SUM (:func:`plan`); every
other reduction (integers, MAX/MIN/PRODUCT/bitwise) goes to the inner backend, where it is exact
anyway. Each element's result depends only on the ranks' values for that element, so a tensor
reduced alone, at an offset of a larger one, in pieces, or coalesced with others gets the same bits;
that is why a coalesced call may simply be staged into one flat buffer per dtype.

The op is read by :func:`flatcomm.comm.args.reduce_op`, the translation the collectives and the
FSDP backends use too: PREMUL_SUM(f) multiplies each rank's input by f (in the input's dtype) before
the sum, as NCCL does; AVG divides the sum by the group size once, after the sum.
"""
from __future__ import annotations

import datetime
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import collectives
from ..comm import groups, header, prepared, rejected, worker
from ..comm.args import premultiplied, reduce_op
from ..comm.fields import pairs
from ..comm.route import Route
from ..comm.spec import CallSpec
from .settings import settings_for, topology_for
from .work import ReductionWork

__all__ = ["FLOATS", "all_reduce", "guard", "plan", "reduce", "reduce_scatter", "reduce_scatter_lists", "route"]

FLOATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def plan(op, tensors: Sequence[torch.Tensor]) -> Optional[Tuple[str, object]]:
    """(flatcomm op, pre-factor or None) when flatcomm reduces these tensors, None to pass through."""
    if not tensors or any(not isinstance(t, torch.Tensor) or t.dtype not in FLOATS or t.layout != torch.strided
                          or t.device.type not in ("cpu", "cuda") for t in tensors):
        _warn_float64_sum(op, tensors)
        return None
    return reduce_op(op)


_float64_warned = False


def _warn_float64_sum(op, tensors: Sequence[torch.Tensor]) -> None:
    """A float64 sum passes through to the inner backend (its order, not the same-bits sum): say so,
    once per process, rather than silently."""
    global _float64_warned
    if _float64_warned or not any(op == o for o in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)):
        return  # (op == o, not `op in`: a PREMUL_SUM op compares equal only from its side)
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors):
        _float64_warned = True
        warnings.warn("flatcomm backend: float64 sums run on the inner backend (gloo / NCCL), in its order: not "
                      "flatcomm's same-bits sum (fp32, bf16 and fp16 only); cast to float32 for it. Said once.",
                      RuntimeWarning, stacklevel=3)


def guard(pg, kind: str, tensors: Sequence[torch.Tensor], op) -> None:
    """Before a reduction passes through to the inner backend: the ranks' call headers, exchanged
    and checked on flatcomm's private group, in order with flatcomm's own calls there. Ranks that
    disagree (one reduces floats with flatcomm's sum, another integers; another op, size or
    dtype) then all raise the header's error naming the field and every rank's value, at once,
    instead of meeting in mismatched exchanges (a wait for the timeout, or gloo aborting the
    process on a size mismatch). One small exchange, waited for here (bounded by the group's
    timeout). CPU tensors only (a CUDA reduction's check would synchronise the host); on the world
    group always, on a subgroup once a float reduction made flatcomm's private copy of it."""
    pg.routes[str(Route.PASSED_THROUGH)] += 1
    t = tensors[0]
    if not groups.exchanges(pg):
        return
    if t.device.type not in ("cpu", "cuda"):  # (a meta tensor, say): its peers learn of it, in step
        _refuse(pg, kind, t)
    if t.device.type != "cpu":
        return
    if pg is not dist.group.WORLD and not groups.has_private(pg):
        # A subgroup's private copy is made only by a float reduction: made here, by an integer one,
        # it would take its name from each member's count of groups (use_local_synchronization),
        # which may differ between members (see docs/backend.md): such calls pass unchecked.
        return
    dtype = t.dtype
    fields = pairs(collective=header.KIND_IDS[kind], numel=sum(x.numel() for x in tensors),
                   dtype=header.ALL_DTYPES.index(dtype) if dtype in header.ALL_DTYPES else len(header.ALL_DTYPES),
                   reduce_op=int(getattr(op, "op", op)) + 1, device=header.DEVICE_TYPES.index("cpu"))
    priv = groups.private_group(pg)
    key, cpu = worker.key_of(priv), torch.device("cpu")
    posted = worker.post_if_idle(key, lambda: header.CallHeader(priv, fields, cpu))
    if posted is None:  # flatcomm calls in flight on the group: in order after them, on its worker
        worker.call(key, lambda: header.CallHeader(priv, fields, cpu).finish())
    else:
        posted.finish()


def _refuse(pg, kind: str, t: torch.Tensor) -> None:
    """Raise, on every rank of the call, that this rank's tensor is on a device flatcomm's backend
    has no transport for: its call header goes out marked failed (rejected.fail_in_step)."""
    err = ValueError(f"flatcomm backend: {kind} of a tensor on the {t.device.type} device: the backend's "
                     "transports take CPU and CUDA tensors")
    if pg is not dist.group.WORLD and not groups.has_private(pg):
        raise err
    fut = rejected.fail_in_step(groups.private_group(pg), header.KIND_IDS[kind], err)
    if fut is None:
        raise err
    try:
        fut.result()
    except Exception as agreed:  # noqa: BLE001 - always: the future holds the agreed error
        raise agreed from None
    raise err


def _call_args(pg, dtype: torch.dtype) -> dict:
    """codec / mode / group-or-topology of a reduction on ``pg`` (the group's :class:`Settings`)."""
    s = settings_for(pg)
    codec = "fp32" if s.mode == "exact" else (s.codec or FLOATS[dtype])
    topo = topology_for(pg, s, pg is dist.group.WORLD)
    where = {"topology": topo} if topo is not None and not topo.flat else {"group": pg}
    return dict(codec=codec, mode=s.mode, async_op=True, stats=pg.counters, **where)


_PREPARED_MAX = 64  # prepared all-reduces kept per group (by numel, dtype and op)


def _prepared(pg, t: torch.Tensor, name: str) -> Optional[prepared.Prepared]:
    """The group's :class:`flatcomm.comm.prepared.Prepared` call for this numel, dtype and op (made
    at the first such call, again when the group's settings or private group change); None: the
    full path (not on the CPU, a two-level call, ``codec="auto"``)."""
    if t.device.type != "cpu":
        return None
    s, made = settings_for(pg), groups.generation()  # (a private group made or dropped: made changes)
    key = (t.numel(), t.dtype, name)
    entry = pg.prepared.get(key)
    if entry is None or entry[0] is not s or entry[2] != made:
        priv = groups.private_group(pg)
        kw = _call_args(pg, t.dtype)
        ok = "group" in kw and kw["codec"] != "auto"  # flat, and one codec for every size
        spec = CallSpec(codec=kw["codec"], op=name, mode=kw["mode"], async_op=True, stats=kw["stats"])
        if len(pg.prepared) >= _PREPARED_MAX:
            pg.prepared.clear()
        entry = pg.prepared[key] = (s, prepared.prepare_all_reduce(priv, t.view(-1), spec) if ok else None,
                                    groups.generation())
    return entry[1]


def route(pg, t: torch.Tensor, op) -> str:
    """The route (:mod:`flatcomm.comm.route`) an all-reduce of ``t`` with ``op`` takes on ``pg``
    now, without running it."""
    how = plan(op, [t])
    if how is None:
        return str(Route.PASSED_THROUGH)
    if not (t.is_contiguous() and how[1] is None and groups.exchanges(pg)):
        return str(Route.FULL)
    p = _prepared(pg, t, how[0])
    return str(p.route if p is not None else Route.FULL)


def _counted(pg) -> None:
    pg.reductions += 1


def _staged(tensors: Sequence[torch.Tensor], factor) -> torch.Tensor:
    """One flat copy of ``tensors`` (the same dtype), pre-multiplied by ``factor`` if given."""
    if factor is not None and len(tensors) == 1:
        return premultiplied(tensors[0].reshape(-1), factor)
    buf = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
    return premultiplied(buf, factor, out=buf) if factor is not None else buf


def _copy_back(pairs: List[Tuple[List[torch.Tensor], torch.Tensor]]) -> Callable[[], None]:
    def finish():
        for dst, flat in pairs:
            off = 0
            for t in dst:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()
    return finish


Limit = Callable[[], Optional[datetime.timedelta]]  # the wait limit of a call's Python Work, asked when one is made


def all_reduce(pg, tensors: List[torch.Tensor], how: Tuple[str, object], limit: Limit,
               root: Optional[int] = None) -> dist.Work:
    """All-reduce ``tensors`` in place (coalesced: staged per dtype). ``root``: a reduce, where
    only that rank's tensors receive the result. ``limit``: asked only for a Python Work (a native
    route's C++ Work is bounded by the group's own timeout)."""
    name, factor = how
    t = tensors[0]
    _counted(pg)
    if len(tensors) == 1 and t.is_contiguous() and factor is None and root is None:
        p = _prepared(pg, t, name)
        pg.routes[(p.route if p is not None else Route.FULL).value] += 1
        handle = p.post(t) if p is not None else None
        if isinstance(handle, dist.Work):  # a native route: its Work is C++ all the way
            return handle
        if handle is None:
            handle = collectives.all_reduce(t.view(-1), op=name, **_call_args(pg, t.dtype))
        return ReductionWork([handle], tensors, None, limit())
    pg.routes[str(Route.FULL)] += 1
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for x in tensors:
        by_dtype.setdefault(x.dtype, []).append(x)
    handles, pairs = [], []
    for dtype, group in by_dtype.items():
        buf = _staged(group, factor)
        handles.append(collectives.all_reduce(buf, op=name, **_call_args(pg, dtype)))
        pairs.append((group, buf))
    keep = root is None or pg.rank() == root
    return ReductionWork(handles, tensors, _copy_back(pairs) if keep else None, limit())


def reduce(pg, tensors: List[torch.Tensor], root: int, how, limit: Limit) -> dist.Work:
    return all_reduce(pg, tensors, how, limit, root=root)


def reduce_scatter(pg, outputs: List[torch.Tensor], inputs: List[torch.Tensor], how,
                   timeout: Optional[datetime.timedelta]) -> ReductionWork:
    """Reduce-scatter each ``inputs[i]`` (group size x ``outputs[i]`` values) into ``outputs[i]``."""
    name, factor = how
    if len(outputs) != len(inputs):
        raise ValueError(f"flatcomm.backend: {len(outputs)} outputs for {len(inputs)} inputs")
    _counted(pg)
    handles, pairs = [], []
    for out, src in zip(outputs, inputs):  # sizes and dtypes: checked by the collective, on every rank
        flat_in = _staged([src], factor) if factor is not None or not src.is_contiguous() else src.view(-1)
        flat_out = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype,
                                                                          device=out.device)
        handles.append(collectives.reduce_scatter(flat_out, flat_in, op=name, **_call_args(pg, src.dtype)))
        if not out.is_contiguous():
            pairs.append(([out], flat_out))
    return ReductionWork(handles, outputs, _copy_back(pairs) if pairs else None, timeout)


def reduce_scatter_lists(pg, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], how,
                         timeout) -> ReductionWork:
    """``reduce_scatter``'s list form: rank r's output is the reduction of every rank's ``[r]``."""
    inputs = [torch.cat([p.reshape(-1) for p in parts]) for parts in input_lists]
    return reduce_scatter(pg, outputs, inputs, how, timeout)
