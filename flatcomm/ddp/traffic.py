"""The DDP hook's traffic: one bucket in, one future out (see :mod:`flatcomm.ddp`).

:meth:`flatcomm.ddp.State._launch` is what :func:`flatcomm.ddp.hook` runs for each bucket, as
named steps from this module: :func:`first_call` (the group and topology, once), :func:`new_step`
(at a step's first bucket: GradScaler rescale, the ``auto`` backoff check and revisits),
:func:`plan_parts` (where the bucket must be split: the first step after a load replays the saved
buckets; ``keep_fp32`` parameters go in their own lossless all-reduce), then :func:`reduce` per
part (its codec: fixed, ``auto``'s decision, lossless during ``start_step``; its residual buffer;
the all-reduce) and, for a split bucket, :func:`reduce_parts` (each part over a copy, copied back).
flatcomm runs every collective of a group on that group's worker thread in submission order, so
all ranks issue them in the same order; nothing blocks inside a future callback (the statistics
callback only reads norms).
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .. import collectives as C
from ..comm import worker
from . import tiers as _tiers
from ..autotune import BACKEND as _BACKEND
from ..ops.codecs import Codec, resolve
from .residuals import bucket_layout

__all__ = ["Part", "Piece", "first_call", "new_step", "plan_parts", "reduce", "reduce_parts"]

Layout = List[Tuple[int, int, int]]  # (id(p), offset, numel) of each parameter in a flat tensor


class Part(NamedTuple):
    """A group of a bucket's parameters sent as one all-reduce: its residual key (the parameter
    ids), the parameters, and the codec forced on it (keep_fp32: lossless fp32) or None."""

    key: Tuple[int, ...]
    params: list
    force: Optional[Codec] = None


class Piece(NamedTuple):
    """One all-reduce of the hook: the values (the bucket's buffer or a copy of a part's ranges),
    their layout, and where they come from (step, DDP bucket index, the tuner's key)."""

    tensor: torch.Tensor
    part: Part
    layout: Layout
    step: int
    bucket: int  # DDP's bucket index
    name: str


def first_call(state, group) -> None:
    """At the hook's first call: warn about a State without a model, resolve the topology
    (creating its groups is collective: every rank's first bucket), check a replayed load."""
    if state.model is None and (state.auto or (state.error_feedback and not state.codec.lossless)):
        warnings.warn("flatcomm: this DDP State has no model (ddp.register_comm_hook(State(...), hook)): "
                      "its error-feedback residuals cannot be named in a checkpoint, and state_dict() "
                      "raises until you call state.attach(ddp_model) (or use flatcomm.ddp.register)",
                      stacklevel=2)
    state.topology = _tiers.resolve_topology(state.topology_arg, group)
    if state.replay is not None and state.replay_tiered != state.tiered():
        raise ValueError(
            "flatcomm: this rank's state_dict() was saved with a "
            f"{'hierarchical' if state.replay_tiered else 'flat'} topology and this State is "
            f"{'hierarchical' if state.tiered() else 'flat'}: the residuals live in other places. "
            "Load the list of every rank's state_dict() (or a resharded_state_dict()) instead")


def new_step(state, group, device: torch.device) -> None:
    """At a step's first bucket (the same point on every rank): the GradScaler's scale change
    into the residuals, the ``auto`` backoff check and the revisits of raced decisions when due."""
    if state.grad_scaler is not None and state.error_feedback:
        state.rescale_for_scaler()
    if state.backoff is not None and state.monitor.due(state.step):
        _check_errors(state, group, device)
    if state.auto and _revisit_due(state.step):
        _revisit(state, group, device)


def plan_parts(state, bucket) -> Tuple[Part, Layout, Optional[List[Part]]]:
    """The bucket as a whole (its key and parameters), its layout in DDP's buffer, and the parts
    it must be sent as, or None when it goes as one all-reduce of the buffer itself."""
    params = list(bucket.parameters())
    whole = Part(tuple(id(p) for p in params), params)
    known = state.residuals.bufs.get(whole.key)
    layout = known.layout if known is not None and not state.replay else bucket_layout(bucket)
    parts = _replay_parts(state, params) if state.replay else None
    if state.keep_fn is not None:
        parts = _split_kept(state, parts if parts is not None else [whole])
    if parts is not None and len(parts) == 1 and parts[0].key == whole.key:  # one kind: no copy
        whole, parts = parts[0], None
    return whole, layout, parts


def reduce_parts(state, group, tensor: torch.Tensor, layout: Layout, parts: List[Part], step: int,
                 index: int) -> torch.futures.Future:
    """Each part's values reduced in a copy laid out as the part alone (after a same-world-size
    load: DDP's first iteration puts every parameter in one bucket, and the saved buffers are its
    rebuilt buckets; reduced as they were laid out then, the codec's blocks and shards, hence the
    bits, are those of an uninterrupted run), then copied back into DDP's buffer."""
    flat = tensor.view(-1)
    offs = {pid: off for pid, off, _ in layout}
    futs, temps = [], []
    for j, part in enumerate(parts):
        tmp = torch.cat([flat[offs[id(p)]:offs[id(p)] + p.numel()] for p in part.params])
        lay, o = [], 0
        for p in part.params:
            lay.append((id(p), o, p.numel()))
            o += p.numel()
        futs.append(reduce(state, group, Piece(tmp, part, lay, step, index, f"bucket{index}.{j}")))
        temps.append((tmp, part.params))

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        for f in fut.value():
            f.value()  # re-raise a failed part
        for tmp, ps in temps:
            o = 0
            for p in ps:
                a = offs[id(p)]
                flat[a:a + p.numel()].copy_(tmp[o:o + p.numel()])
                o += p.numel()
        return tensor

    return torch.futures.collect_all(futs).then(scatter)


def _is_kept(state, p) -> bool:
    k = state._kept.get(id(p))
    if k is None:
        name = state.name_map().get(id(p), "")
        k = state._kept[id(p)] = bool(state.keep_fn(name, p))
    return k


def _split_kept(state, parts: List[Part]) -> List[Part]:
    """Each part split into its codec parameters and its keep_fp32 ones (forced lossless fp32),
    in that order on every rank (DDP's bucket order is the same everywhere)."""
    out = []
    for part in parts:
        kept = [p for p in part.params if _is_kept(state, p)]
        if not kept:
            out.append(part)
            continue
        rest = [p for p in part.params if not _is_kept(state, p)]
        if rest:
            out.append(Part(tuple(id(p) for p in rest), rest, part.force))
        out.append(Part(tuple(id(p) for p in kept), kept, resolve("fp32")))
    return out


def _replay_parts(state, params) -> Optional[List[Part]]:
    """The saved buckets wholly inside this bucket (in saved parameter order), plus one part for
    the remaining parameters; None when the bucket is itself a saved one or holds none."""
    key = tuple(id(p) for p in params)
    saved = set(state.residuals.bufs) | state.replay_backend
    if key in saved:
        return None
    by_id = {id(p): p for p in params}
    parts, used = [], set()
    for skey in state.replay:
        if skey in saved and all(pid in by_id for pid in skey):
            parts.append(Part(skey, [by_id[pid] for pid in skey]))
            used.update(skey)
    if not parts:
        return None
    rest = [p for p in params if id(p) not in used]
    if rest:
        parts.append(Part(tuple(id(p) for p in rest), rest))
    return parts


def reduce(state, group, piece: Piece) -> torch.futures.Future:
    """One flatcomm all-reduce of a piece of a bucket; ``piece.part.force``: the codec of keep_fp32
    parameters, whatever the State's codec."""
    tensor, (key, params, force), layout, step, index = piece.tensor, piece.part, piece.layout, piece.step, piece.bucket
    codec, chunks = state.codec, state.chunks
    if force is not None:
        codec = force
    elif state.auto:
        d = state.decisions.get(key)
        if d is None:  # pure given the (MAX-agreed) costs: every rank picks the same
            # A hierarchical topology: the tuner picks the inter-node codec (or the backend) by
            # the two-level model; the State's residual layout is tiered, so the path stays.
            tiers = dict(topology=state.topology, paths=("hierarchical",)) if state.tiered() else {}
            d = state.decisions[key] = state.tuner.choose(tensor.numel(), key=piece.name, group=group,
                                                          device=tensor.device, deterministic=not state.backend_allowed,
                                                          **tiers)
        state._key_where[key] = (index, tensor.numel())
        if d.codec == _BACKEND and not (state.error_feedback and state.residuals.carries(params, state.name_of)):
            state.backend_sent[key] = step
            return _backend(state, tensor, step, index)
        # (a bucket still carrying residuals from a lossy one sends them once through fp32)
        codec = resolve("fp32" if d.codec == _BACKEND else d.codec, state.block_size)
        chunks = chunks or d.chunks
    if step < state.start_step:  # warm-up: lossless; a residual loaded from a checkpoint is flushed
        codec = resolve("fp32")
    elif state.accordion is not None and force is None:
        codec = state.accordion.choose(key, step, codec)
    res = None
    where = (key, layout, tensor.numel(), tensor.device)
    if state.error_feedback and not codec.lossless:
        res = state.residuals.buffer_for(*where, **state.where_kw())
    elif codec.lossless and state.mode == "ordered" and state.residuals.carries(params, state.name_of):
        res = state.residuals.flush_into_lossless(*where, **state.where_kw())
    if state.tiered():
        _tiers.add_carry(tensor, res)
    # The consistency round trip only for a bucket layout not seen before (validate=False skips
    # only a call header that costs a host sync, on an NCCL-only group).
    kwargs: Dict[str, Any] = {"validate": key not in state._seen_layouts}
    state._seen_layouts.add(key)
    t0 = time.perf_counter()
    v_sq: List[float] = []
    g_sq: List[float] = []
    if state.track_norms:
        # ||g + client_old||^2 = g.g + 2 g.r + r.r (r.r kept from the last step): two read passes,
        # queued on the group's worker thread just before the all-reduce, off the backward thread.
        # The norms stay 0-dim tensors (float64 sums of the fp32 dots, as Python floats would
        # be) until stats reads them: on CUDA no host sync per bucket.
        def pre():
            flat = tensor.reshape(-1).float()
            g = v = flat.dot(flat).double()
            if res is not None:
                v = v + 2.0 * flat.dot(res.ef.client).double() + res.client_sq
            v_sq.append(v)
            g_sq.append(g)

        if state.tiered():
            _tiers.submit(state.topology, pre, tensor)  # CUDA: on the two-level side stream, in order
        else:
            worker.submit(worker.key_of(group), tensor.device, pre)  # CUDA: on the all-reduce's side stream, in order
    cs = C.CommStats()
    state.started()
    try:
        if state.tiered():
            h = _tiers.all_reduce(tensor, state.topology, codec, state.mode, res, chunks, cs, kwargs)
        else:
            h = C.all_reduce(tensor, codec=codec, op="avg", mode=state.mode, group=group, async_op=True,
                             residual=res.ef if res is not None else None, chunks=chunks, stats=cs,
                             **kwargs)
    except BaseException:
        state.finished()
        raise
    fut = h.get_future()

    def record(f: torch.futures.Future) -> None:
        try:
            f.value()  # raises if the collective failed: DDP sees that error, no record
            state.recorder.bucket(step, index, tensor.numel(), dist.get_world_size(group), codec, cs,
                                   time.perf_counter() - t0, res, v_sq[0] if v_sq else None)
            if state.backoff is not None and force is None and res is not None and v_sq:
                state.monitor.accumulate(key, res.client_sq, v_sq[0], g_sq[0])
        except BaseException:  # noqa: BLE001 - statistics never break training
            pass
        finally:
            state.finished()

    fut.add_done_callback(record)  # runs on the worker thread; does not block
    if state.accordion is not None and force is None:
        fut = state.accordion.watch(key, step, fut)  # DDP waits for it: decisions before the next step
    return fut

# ---- codec="auto": the measured error against the budget -------------------------------------


def _check_errors(state, group, device) -> None:
    """Every ``backoff.every`` steps, at the first bucket of a step (the same point on every
    rank): the measured errors against the budget (:class:`flatcomm._training.adapt.Monitor`).
    Buckets in ``decisions`` order, which is the same on every rank."""
    from ..autotune import PRECISION

    state.wait()
    keys = [k for k, d in state.decisions.items() if d.codec in PRECISION[1:]]

    def where(k) -> dict:
        index, numel = state._key_where.get(k, (None, None))
        return {"bucket": index, "numel": numel}

    state.monitor.check(state.decisions, keys, state.tuner.error_budget, state.step,
                         lambda t: C.all_reduce(t, codec="fp32", op="sum", mode="ordered", group=group),
                         device, where)
    state.monitor.clear()  # (the windows of buckets not checked, e.g. fp32 ones, start over too)


# codec="auto": raced decisions are raced again at these steps (then every REVISIT_EVERY), so a
# choice that training conditions turned slower than its alternative does not stay.
REVISIT_FIRST, REVISIT_EVERY = 50, 1000


def _revisit_due(step: int) -> bool:
    return step == REVISIT_FIRST or (step > REVISIT_FIRST and (step - REVISIT_FIRST) % REVISIT_EVERY == 0)


def _revisit(state, group, device) -> None:
    """At the first bucket of a step (the same point on every rank), in ``decisions`` order (the
    same on every rank): race each raced decision's two candidates again at its bucket's size."""
    state.wait()
    for key, d in list(state.decisions.items()):
        index, numel = state._key_where.get(key, (None, None))
        if not d.raced or numel is None:
            continue
        new = state.tuner.revisit(d, numel, group=group, device=device, key=f"bucket{index}")
        if new.codec != d.codec:
            state.adaptations.append({"step": state.step, "bucket": index, "numel": numel, "from": d.codec,
                                      "to": new.codec, "reason": new.reason})
        state.decisions[key] = new


def _backend(state, tensor: torch.Tensor, step: int, index: int) -> torch.futures.Future:
    """codec="auto" chose the backend's own all-reduce: exactly torch's default hook (divide,
    ``dist.all_reduce`` on DDP's group, its future), plus a statistics record."""
    pg = state.ddp_group()
    world = dist.get_world_size(pg)
    t0 = time.perf_counter()
    state.started()
    try:
        tensor.div_(world)
        fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()
    except BaseException:
        state.finished()
        raise

    def done(f: torch.futures.Future) -> torch.Tensor:
        try:
            out = f.value()[0]
            state.recorder.backend(step, index, tensor.numel(), world, _BACKEND, time.perf_counter() - t0)
            return out
        finally:
            state.finished()

    return fut.then(done)
