"""The DDP hook's traffic: one bucket in, one future out (see :mod:`flatcomm.ddp`).

:meth:`flatcomm.ddp.State._launch` is what :func:`flatcomm.ddp.hook` runs for each bucket, as
named steps from this module: :func:`first_call` (the group and topology, once), :func:`new_step`
(at a step's first bucket: GradScaler rescale, the ``auto`` backoff check and revisits), the
State's plan of the bucket (:meth:`flatcomm.ddp.buckets.Buckets.plan`: the first step after a load
replays the saved buckets; ``keep_fp32`` parameters go in their own lossless all-reduce), then
:func:`reduce` per part (its codec: fixed, ``auto``'s decision, lossless during ``start_step``; its
residual buffer; the all-reduce) and, for a split bucket, :func:`reduce_parts` (each part over a
copy, copied back). flatcomm runs every collective of a group on that group's worker thread in
submission order, so all ranks issue them in the same order; nothing blocks inside a future
callback (the statistics callback only reads norms).
"""
from __future__ import annotations

import dataclasses
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
from .buckets import Layout, Part
from .stats import Sent

__all__ = ["Piece", "first_call", "new_step", "reduce", "reduce_parts"]


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


def reduce(state, group, piece: Piece) -> torch.futures.Future:
    """One flatcomm all-reduce of a piece of a bucket; ``piece.part.force``: the codec of keep_fp32
    parameters, whatever the State's codec."""
    key, step, force = piece.part.key, piece.step, piece.part.force
    codec, chunks = _codec_of(state, group, piece)
    if codec is None:  # auto handed it to the backend
        state.buckets.sent_by_backend(key, step)
        return _backend(state, piece.tensor, step, piece.bucket)
    res = _residual_of(state, piece, codec)
    if state.tiered():
        _tiers.add_carry(piece.tensor, res)
    # The consistency round trip only for a bucket layout not seen before (validate=False skips
    # only a call header that costs a host sync, on an NCCL-only group).
    kwargs: Dict[str, Any] = {"validate": state.buckets.first_sight(key)}
    t0 = time.perf_counter()
    norms = _Norms()
    if state.track_norms:
        _queue_norms(state, group, piece.tensor, res, norms)
    cs = C.CommStats()
    state.started()
    try:
        if state.tiered():
            h = _tiers.all_reduce(piece.tensor, state.topology, codec, state.mode, res, chunks, cs, kwargs)
        else:
            h = C.all_reduce(piece.tensor, codec=codec, op="avg", mode=state.mode, group=group, async_op=True,
                             residual=res.ef if res is not None else None, chunks=chunks, stats=cs,
                             **kwargs)
    except BaseException:
        state.finished()
        raise
    fut = h.get_future()
    sent = Sent(step, piece.bucket, piece.tensor.numel(), dist.get_world_size(group), codec)
    fut.add_done_callback(_recorder(state, piece.part, sent, (cs, t0, res, norms)))  # on the worker thread
    if state.accordion is not None and force is None:
        fut = state.accordion.watch(key, step, fut)  # DDP waits for it: decisions before the next step
    return fut


def _codec_of(state, group, piece: Piece) -> Tuple[Optional[Codec], Optional[int]]:
    """The codec and chunks of a piece: forced (keep_fp32), auto's decision, lossless during
    ``start_step``, Accordion's choice, or the State's. (None, None): auto's choice is the
    backend's all-reduce (a bucket still carrying residuals from a lossy one sends them once
    through fp32 instead)."""
    (key, params, force), tensor = piece.part, piece.tensor
    codec, chunks = state.codec, state.chunks
    if force is not None:
        codec = force
    elif state.auto:
        def choose():
            # A hierarchical topology: the tuner picks the inter-node codec (or the backend) by
            # the two-level model; the State's residual layout is tiered, so the path stays.
            tiers = dict(topology=state.topology, paths=("hierarchical",)) if state.tiered() else {}
            return state.tuner.choose(tensor.numel(), key=piece.name, group=group, device=tensor.device,
                                      deterministic=not state.backend_allowed, **tiers)

        d = state.buckets.decide(key, choose, piece.bucket, tensor.numel())
        if d.codec == _BACKEND and not (state.error_feedback and state.residuals.carries(params, state.name_of)):
            return None, None
        codec = resolve("fp32" if d.codec == _BACKEND else d.codec, state.block_size)
        chunks = chunks or d.chunks
    if piece.step < state.start_step:  # warm-up: lossless; a residual loaded from a checkpoint is flushed
        codec = resolve("fp32")
    elif state.accordion is not None and force is None:
        codec = state.accordion.choose(key, piece.step, codec)
    return codec, chunks


def _residual_of(state, piece: Piece, codec: Codec):
    """The piece's residual buffer: error feedback for a lossy codec; for ordered fp32, the
    residuals its parameters still carry (flushed once); else None."""
    where = (piece.part.key, piece.layout, piece.tensor.numel(), piece.tensor.device)
    if state.error_feedback and not codec.lossless:
        return state.residuals.buffer_for(*where, **state.where_kw())
    if codec.lossless and state.mode == "ordered" and state.residuals.carries(piece.part.params, state.name_of):
        return state.residuals.flush_into_lossless(*where, **state.where_kw())
    return None


@dataclasses.dataclass
class _Norms:
    """||g + client_old||^2 and ||g||^2 of a piece, appended by the queued pass (0-dim tensors)."""

    v_sq: List[Any] = dataclasses.field(default_factory=list)
    g_sq: List[Any] = dataclasses.field(default_factory=list)


def _queue_norms(state, group, tensor: torch.Tensor, res, norms: _Norms) -> None:
    """||g + client_old||^2 = g.g + 2 g.r + r.r (r.r kept from the last step): two read passes,
    queued on the group's worker thread just before the all-reduce, off the backward thread. The
    norms stay 0-dim tensors (float64 sums of the fp32 dots, as Python floats would be) until
    stats reads them: on CUDA no host sync per bucket."""
    def pre():
        flat = tensor.reshape(-1).float()
        g = v = flat.dot(flat).double()
        if res is not None:
            v = v + 2.0 * flat.dot(res.ef.client).double() + res.client_sq
        norms.v_sq.append(v)
        norms.g_sq.append(g)

    if state.tiered():
        _tiers.submit(state.topology, pre, tensor)  # CUDA: on the two-level side stream, in order
    else:
        worker.submit(worker.key_of(group), tensor.device, pre)  # CUDA: on the all-reduce's side stream, in order


def _recorder(state, part: Part, sent: Sent, measured: tuple):
    """The completion callback of a piece's all-reduce: its statistics record and the backoff's
    error window; it never raises (statistics never break training) and ends the in-flight count."""
    cs, t0, res, norms = measured

    def record(f: torch.futures.Future) -> None:
        try:
            f.value()  # raises if the collective failed: DDP sees that error, no record
            v_sq = norms.v_sq[0] if norms.v_sq else None
            state.recorder.bucket(sent, cs, time.perf_counter() - t0, res, v_sq)
            if state.backoff is not None and part.force is None and res is not None and norms.v_sq:
                state.monitor.accumulate(part.key, res.client_sq, norms.v_sq[0], norms.g_sq[0])
        except BaseException:  # noqa: BLE001 - statistics never break training
            pass
        finally:
            state.finished()

    return record

# ---- codec="auto": the measured error against the budget -------------------------------------


def _check_errors(state, group, device) -> None:
    """Every ``backoff.every`` steps, at the first bucket of a step (the same point on every
    rank): the measured errors against the budget (:class:`flatcomm._training.adapt.Monitor`).
    Buckets in ``decisions`` order, which is the same on every rank."""
    from ..autotune import PRECISION

    state.wait()
    keys = [k for k, d in state.decisions.items() if d.codec in PRECISION[1:]]

    def where(k) -> dict:
        index, numel = state.buckets.where(k)
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
        index, numel = state.buckets.where(key)
        if not d.raced or numel is None:
            continue
        new = state.tuner.revisit(d, numel, group=group, device=device, key=f"bucket{index}")
        if new.codec != d.codec:
            state.adaptations.append({"step": state.step, "bucket": index, "numel": numel, "from": d.codec,
                                      "to": new.codec, "reason": new.reason})
        state.buckets.decisions[key] = new


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
