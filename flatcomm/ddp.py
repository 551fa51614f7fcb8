"""DistributedDataParallel communication hook built on :func:`flatcomm.collectives.all_reduce`.

Usage::

    ddp = DistributedDataParallel(model)
    state = flatcomm.ddp.register(ddp, "int8")          # or: ddp.register_comm_hook(State("int8"), hook)
    ...
    ckpt["flatcomm"] = state.state_dict()        # this rank's state, no communication (any rank)
    state.load_state_dict(ckpt["flatcomm"])      # same rank, same world size: continues bit for bit
    total = state.resharded_state_dict()         # a collective: loads at any world size

The hook averages like DDP's default hook (``op="avg"``): every rank ends with the same bits.

**Process group.** flatcomm's traffic runs on its private copy of the DDP group (or of ``group=``),
:func:`flatcomm.collectives.private_group`, created at the first hook call (DDP calls the hook in
the same order on every rank, so this is safe) with that group's timeout. Keeping it off DDP's own
group means DDP's collectives (the unused-parameter bitmap, the bucket rebuild broadcast) never
interleave with flatcomm's in a different order on different ranks.

**Ordering.** The hook calls ``all_reduce(bucket.buffer(), ..., async_op=True)`` and returns
``handle.get_future()`` (its value is the bucket buffer, averaged in place). flatcomm runs every
collective of a group on that group's single worker thread in submission order, so all ranks issue
them in the same order; backward computation overlaps communication, and nothing blocks inside a
future callback (the statistics callback only reads norms). Every call's small header (numel,
codec, dtype, ...) is checked on every rank; ``validate=False`` after a bucket layout's first call
only skips that check where it would cost a host sync (NCCL-only groups).

**Error feedback, keyed by parameter.** DDP rebuilds its buckets after the first iteration (and may
differ with ``static_graph``, ``gradient_as_bucket_view`` or unused parameters), so residuals are
not keyed by bucket index. Each distinct bucket (key = the tuple of ``id(p)`` of its parameters, in
``bucket.parameters()`` order, which is the buffer layout: offsets are read from the
``bucket.gradients()`` views and checked) owns one flat :class:`~flatcomm.collectives.ErrorFeedback`
(client + server residual, fp32, bucket numel). A map parameter -> (key, offset, numel) remembers
where each parameter's residual lives. When a new key appears its residual is assembled once from
the old buffers, parameter by parameter (zeros for parameters never seen). The server residual is
only valid for the shard layout it was made with, so it is folded into the client residual on that
copy: ``client += server / scale`` (the total that the next step adds is unchanged, see below). An
old buffer is freed when no parameter refers to it any more.

**What a residual is worth.** With ``scale = 1/W`` (averaging over W ranks) the next step effectively
adds ``T = scale * sum_r client_r + server_owner`` to the averaged gradient, where ``server_owner``
is the server residual of the rank that reduces that shard (other ranks hold zeros there, so it is
``sum_r server_r``). :meth:`State.resharded_state_dict` computes ``T`` per parameter (a SUM
all-reduce of ``scale * client_r + server_r``, flatcomm's ordered fp32 sum, so it is deterministic;
:func:`reshard` gives the same bits from every rank's :meth:`State.state_dict` without
communication); loading it at any world size W' sets ``client = T / (scale' * W') = T`` on every
rank and ``server = 0``, so the next step adds ``scale' * W' * T = T`` again.

**Checkpoints.** :meth:`State.state_dict` is this rank's own state (client and server residual per
parameter, the bucket layout, ``auto`` decisions, the GradScaler scale last seen): no communication.
Loaded on the same rank at the same world size, the run continues bit for bit: DDP's first
iteration after a restart puts every parameter in one bucket, so that step reduces each saved
bucket's values as they were laid out (a copy) and DDP's rebuilt buckets then match the saved ones.
Every load checks keys, shapes, dtype, finiteness, codec and world size, naming the parameter.

**AMP / GradScaler.** A non-finite value in any rank's bucket makes the codec send that block as NaN,
so the averaged gradient is non-finite on every rank (GradScaler skips the step), and the block keeps
its previous residual (residuals stay finite). Finite blocks of the skipped step are lost with the
step, as they are without compression. Residuals are in the units of the scaled gradient: pass
``grad_scaler=`` and the hook multiplies them by new_scale / old_scale when the scale changes.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import checkpoint as check
from . import collectives as C
from . import ddp_accordion as _accordion
from . import ddp_adapt as _adapt
from . import ddp_tiers as _tiers
from .autotune import BACKEND as _BACKEND
from .codecs import Codec, resolve

__all__ = ["State", "hook", "register", "reshard"]

STATE_DICT_VERSION = 2
# What register(ddp, "sign") uses unless block_size= / start_step= say otherwise. Sign sends every
# value of a block at the block's mean magnitude: with 256-value blocks Adam's second moment grew
# 1.8x (median, 4x at p90) and the residual reached 6x the gradient early in training; smaller
# blocks and lossless first steps keep both close (tools/bench/adam_probe.py, convergence.py).
CODEC_DEFAULTS = {"sign": {"block_size": 64, "start_step": 20}}
# all_reduce(validate=False) skips only a call header that costs a host sync (NCCL-only group).
_HAS_VALIDATE = "validate" in inspect.signature(C.all_reduce).parameters


def _norms_to_floats(rec: dict) -> None:
    """Turn a record's lazy norms (0-dim tensors: read only when stats are asked for) into floats."""
    lazy = rec.pop("_norms", None)
    if lazy is None:
        return
    c_sq, s_sq, v_sq, rel = lazy
    v = float(v_sq) if v_sq is not None else None
    if c_sq is not None:
        c = float(c_sq)
        rec["client_residual_norm"] = math.sqrt(c)
        rec["server_residual_norm"] = math.sqrt(float(s_sq))
        rec["input_norm"] = math.sqrt(max(v, 0.0))
        rec["rel_error"] = math.sqrt(c / v) if v > 0 else 0.0
    else:
        rec["client_residual_norm"] = rec["server_residual_norm"] = 0.0
        rec["input_norm"] = math.sqrt(max(v, 0.0)) if v is not None else 0.0
        rec["rel_error"] = rel


@dataclasses.dataclass
class _Buf:
    ef: C.ErrorFeedback
    layout: List[Tuple[int, int, int]]  # (id(p), offset, numel) in buffer order
    client_sq: Any = 0.0  # ||client||^2 after the last step, a float64 0-dim tensor once measured
    carry: Optional[torch.Tensor] = None  # hierarchical: residual brought in, added to the next gradient


class State:
    """State of the flatcomm DDP comm hook (see the module docstring).

    codec: ``fp32`` (lossless, ordered sum), ``bf16``/``fp16``, ``int8``, ``int4``, ``sign``, ``topk``
    or a :class:`flatcomm.Codec`; ``block_size`` / ``ratio`` override its parameters.
    error_feedback: keep client/server residuals for lossy codecs.
    mode: ``ordered`` or ``exact`` (fp32 only, rank-count independent bits); None (default): not
        asked, i.e. ``ordered``, and ``codec="auto"`` may use the backend's all-reduce (see register).
    group: process group for flatcomm's traffic (default: a dedicated copy of DDP's group).
    chunks: pipeline chunks per all-reduce (default: automatic).
    model: the DDP model (or its module), for parameter names in checkpoints; :func:`register` sets it.
    grad_scaler: a GradScaler whose scale changes rescale the residuals.
    track_norms: compute the residual/gradient norms for :meth:`stats` (two dot products over the
        bucket before sending and one norm of each residual after).
    history: how many steps :meth:`stats` keeps.
    topology: a :class:`flatcomm.Topology`, ``"flat"``, or None (default: from torchrun's
        ``LOCAL_WORLD_SIZE``, flat when unset; built at the first hook call). Hierarchical: see
        :mod:`flatcomm.ddp_tiers` for where the residuals live.
    codec="auto": a :class:`flatcomm.autotune.Tuner` (``tuner=``, default error budget int8) picks the
        codec of each bucket at its first hook call; ``decisions`` / ``stats()["decisions"]`` say what
        and why. With a hierarchical topology the inter-node codec (or the backend's all-reduce) is
        chosen by the two-level cost model (:mod:`flatcomm.autotune_tiers`; the node tier stays
        fp32). A parameter that moves (bucket rebuild) from a lossy bucket into one where fp32 was
        chosen brings its residual along: it is added once to that bucket's lossless all-reduce.
    start_step: steps (hook rounds, counted like ``state_dict()["step"]``) sent in lossless fp32 before
        the codec starts (like PowerSGD's ``start_powerSGD_iter``): early gradients are large and
        change fast, and an adaptive optimizer's variance estimate forms from them. Residuals start
        at zero when the codec does; a checkpoint's step count carries the warm-up across restarts.
        Default 0, except for ``codec="sign"`` given by name: see ``CODEC_DEFAULTS`` (block_size too).
    keep_fp32: parameters always sent in lossless fp32 (no residual): a predicate ``f(name, param)``,
        a list of fnmatch name patterns, or ``"small"`` (biases, norms, embeddings; see
        :mod:`flatcomm.ddp_adapt`). A DDP bucket that mixes both is sent as two all-reduces, one
        per kind, each over a copy of its parameters' ranges (the kept part first-class fp32).
    backoff: ``codec="auto"`` only: a :class:`flatcomm.ddp_adapt.Backoff` (default ``Backoff()``,
        every 50 steps; ``False`` turns it off) that moves a bucket to a more precise codec when the
        error measured in training exceeds the budget; ``adaptations`` / ``stats()`` say when and why.
    accordion: adaptive switching (:mod:`flatcomm.ddp_accordion`): a precise codec (``"int8"``, or an
        :class:`~flatcomm.ddp_accordion.Accordion`; ``True``: its defaults) in intervals where the
        gradient norm changes fast, this State's codec otherwise. Not with ``codec="auto"``.
    """

    def __init__(self, codec: Any = "int8", *, error_feedback: bool = True, mode: Optional[str] = None,
                 group=None, chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, model: Optional[torch.nn.Module] = None,
                 grad_scaler=None, track_norms: bool = True, history: int = 100, tuner=None,
                 topology=None, start_step: Optional[int] = None, keep_fp32: Any = None,
                 backoff: Any = None, accordion: Any = None):
        # mode None: the caller did not ask for determinism (see register()); fixed codecs run ordered
        self._open = mode is None and isinstance(codec, str) and codec == "auto"
        mode = "ordered" if mode is None else mode
        if mode not in C.MODES:
            raise ValueError(f"flatcomm: mode must be one of {C.MODES}, got {mode!r}")
        # codec="auto": flatcomm.autotune picks a codec per bucket key at its first hook call (the same
        # on every rank); self.decisions[key] holds the Decision (codec, chunks, reason, predicted_s).
        self._auto = isinstance(codec, str) and codec == "auto"
        defaults = CODEC_DEFAULTS.get(codec, {}) if isinstance(codec, str) else {}
        block_size = defaults.get("block_size") if block_size is None else block_size
        start_step = defaults.get("start_step", 0) if start_step is None else start_step
        self._block_size = block_size
        self.decisions: Dict[Tuple[int, ...], Any] = {}
        if self._auto:
            from .autotune import Tuner
            if mode != "ordered":
                raise ValueError("flatcomm: codec='auto' needs mode='ordered'")
            self.tuner = tuner if tuner is not None else Tuner()
        self.codec: Codec = resolve("fp32" if self._auto else codec, block_size, ratio)
        if mode == "exact" and self.codec.name != "fp32":
            raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' with it")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"flatcomm: start_step must be an int >= 0, got {start_step!r}")
        self.start_step = start_step
        self._keep_fn = _adapt.keep_predicate(keep_fp32)
        if self.codec.lossless and not self._auto:
            self._keep_fn = None  # everything is lossless already: no need to split buckets
        self._kept: Dict[int, bool] = {}  # id(p) -> keep_fp32(name, p), asked once per parameter
        if backoff is not None and backoff is not False and not isinstance(backoff, _adapt.Backoff):
            raise TypeError(f"flatcomm: backoff must be a flatcomm.ddp_adapt.Backoff or False, got {backoff!r}")
        self.backoff = None if backoff is False or not self._auto else (backoff or _adapt.Backoff())
        self.accordion = _accordion.policy(accordion)
        if self.accordion is not None and self._auto:
            raise ValueError("flatcomm: accordion= picks between two fixed codecs; it does not combine with codec='auto'")
        self.adaptations: List[dict] = []
        self._window: Dict[Tuple[int, ...], List[Any]] = {}  # key -> [c_sq, v_sq, g_sq] since the last check
        self._key_where: Dict[Tuple[int, ...], Tuple[int, int]] = {}  # auto key -> (DDP bucket index, numel)
        self._measured: Dict[Tuple[int, ...], Tuple[float, float]] = {}  # key -> (rel_error, residual ratio)
        self.mode = mode
        self.error_feedback = bool(error_feedback) and (self._auto or not self.codec.lossless) and mode == "ordered"
        self.chunks = chunks
        self.group = group
        self._topology_arg = topology
        self.topology = None  # resolved at the first hook call (creating groups is collective)
        self.model = model
        self.grad_scaler = grad_scaler
        self.track_norms = track_norms
        self.history = history
        self._bufs: Dict[Tuple[int, ...], _Buf] = {}
        self._where: Dict[int, Tuple[Tuple[int, ...], int, int]] = {}
        self._refs: Dict[Tuple[int, ...], int] = {}
        # Loaded per-rank client residuals (server folded in) of parameters not yet in a buffer.
        self._pending: Dict[str, torch.Tensor] = {}
        # After a same-world-size load: the saved buffer keys, replayed by the first step (_launch).
        self._replay: Optional[List[Tuple[int, ...]]] = None
        self._replay_tiered = False  # whether the replayed buffers were saved by a hierarchical State
        self._names: Optional[Dict[int, str]] = None
        self._seen: set = set()
        self._inflight = 0
        self._cond = threading.Condition()
        self._step = 0
        self._new_step = True
        self._scale_seen: Optional[float] = None
        self._records: List[dict] = []
        self._lock = threading.Lock()

    # ---- groups and names ------------------------------------------------------------------------

    def _ddp_group(self):
        pg = getattr(self.model, "process_group", None)
        return pg if pg is not None else dist.group.WORLD

    def _ensure_group(self):
        # flatcomm's private copy of DDP's group (or of group=), with that group's timeout; cached.
        self.group = C.private_group(self.group if self.group is not None else self._ddp_group())
        return self.group

    def _scale(self) -> float:
        return 1.0 / dist.get_world_size(self.group)

    def _name_map(self) -> Dict[int, str]:
        if self._names is None:
            if self.model is None:
                raise RuntimeError("flatcomm: State has no model; use flatcomm.ddp.register(ddp_model, ...) "
                                   "or State(..., model=ddp_model) to name parameters in checkpoints")
            mod = getattr(self.model, "module", self.model)
            self._names = {id(p): n for n, p in mod.named_parameters()}
        return self._names

    # ---- residual buffers keyed by parameters ------------------------------------------------------

    @staticmethod
    def _layout(bucket) -> List[Tuple[int, int, int]]:
        buf = bucket.buffer()
        params = bucket.parameters()
        grads = bucket.gradients()
        out, off = [], 0
        base = buf.data_ptr()
        esz = buf.element_size()
        for p, g in zip(params, grads):
            n = p.numel()
            goff = (g.data_ptr() - base) // esz
            if g.numel() != n or goff != off:
                raise RuntimeError(f"flatcomm: DDP bucket layout is not the cumulative parameter order "
                                   f"(parameter of {n} values at offset {goff}, expected {off})")
            out.append((id(p), off, n))
            off += n
        if off != buf.numel():
            raise RuntimeError(f"flatcomm: DDP bucket parameters hold {off} values, buffer {buf.numel()}")
        return out

    def _buffer_for(self, key: Tuple[int, ...], params, layout: List[Tuple[int, int, int]], n: int,
                    dev: torch.device) -> _Buf:
        b = self._bufs.get(key)
        if b is not None:
            return b
        ef = C.ErrorFeedback.zeros(n, device=dev)
        carry = _tiers.new_carry(n, dev) if self._tiered() else None
        scale = self._scale()
        names = self._name_map() if self._pending else None
        dropped = set()
        for (pid, off, ln), p in zip(layout, params):
            old = self._where.get(pid)
            dst = ef.client[off:off + ln] if not self._tiered() else _tiers.carry_slice(carry, off, ln)
            if old is not None:
                okey, ooff, oln = old
                ob = self._bufs[okey]
                # Fold the server residual into the client one: the shard layout changes.
                _tiers.fold(ob, ooff, oln, scale, self._tiered(), out=dst)
                self._refs[okey] -= 1
                if self._refs[okey] == 0:
                    dropped.add(okey)
            elif names is not None and names.get(pid) in self._pending:
                # A per-rank client residual (server folded in): the next step adds scale * sum_r of it.
                dst.copy_(self._pending.pop(names[pid]).reshape(-1).to(device=dev))
            self._where[pid] = (key, off, ln)
        for okey in dropped:
            del self._bufs[okey], self._refs[okey]
        b = _Buf(ef, layout, float(ef.client.square().sum()) if self.track_norms else 0.0,
                 _tiers.nonzero_or_none(carry))
        self._bufs[key] = b
        self._refs[key] = len(layout)
        return b

    def _carries(self, params) -> bool:
        """Whether a parameter of this bucket still has a residual (from a lossy bucket or a checkpoint)."""
        if any(id(p) in self._where for p in params):
            return True
        if not self._pending:
            return False
        names = self._name_map()
        return any(names.get(id(p)) in self._pending for p in params)

    def _flush_into_lossless(self, key, params, layout, n, dev) -> _Buf:
        """codec="auto" chose fp32 for a bucket whose parameters carry residuals: assemble them once
        (server folded into client, so the buffer holds ``T / scale`` per rank, see the module docs)
        and forget them. The fp32 encode adds the client residual to the gradient and zeroes it, so
        the averaged result gains ``scale * sum_r client_r = T``: nothing is lost, nothing is kept."""
        b = self._buffer_for(key, params, layout, n, dev)
        for pid, _, _ in b.layout:
            self._where.pop(pid, None)
        del self._bufs[key], self._refs[key]
        b.ef.client.add_(b.ef.server, alpha=1.0 / self._scale())  # a fresh buffer's server is zero
        b.ef.server.zero_()
        return b

    def _rescale_for_scaler(self) -> None:
        s = float(self.grad_scaler.get_scale())
        old = self._scale_seen
        self._scale_seen = s
        if old is None or s == old or s == 0.0:
            return
        f = s / old
        for b in self._bufs.values():
            b.ef.client.mul_(f)
            b.ef.server.mul_(f)
            b.client_sq = b.client_sq * (f * f)  # rebind: the old tensor is in a stats record

    # ---- the hook --------------------------------------------------------------------------------

    def _tiered(self) -> bool:
        return self.topology is not None and not self.topology.flat

    def _launch(self, bucket) -> torch.futures.Future:
        group = self._ensure_group()
        if self.topology is None:
            self.topology = _tiers.resolve_topology(self._topology_arg, group)
            if self._replay is not None and self._replay_tiered != self._tiered():
                raise ValueError(
                    "flatcomm: this rank's state_dict() was saved with a "
                    f"{'hierarchical' if self._replay_tiered else 'flat'} topology and this State is "
                    f"{'hierarchical' if self._tiered() else 'flat'}: the residuals live in other places. "
                    "Load the list of every rank's state_dict() (or a resharded_state_dict()) instead")
        if self._new_step:
            self._new_step = False
            if self.grad_scaler is not None and self.error_feedback:
                self._rescale_for_scaler()
            if self.backoff is not None and self.backoff.every and self._step and \
                    self._step % self.backoff.every == 0:
                self._check_errors(group, bucket.buffer().device)
        step, index = self._step, bucket.index()
        params = list(bucket.parameters())
        key = tuple(id(p) for p in params)
        known = self._bufs.get(key)
        layout = known.layout if known is not None and not self._replay else self._layout(bucket)
        tensor = bucket.buffer()
        parts = self._replay_parts(params, layout) if self._replay else None
        if self._keep_fn is not None:
            parts = self._split_kept(parts if parts is not None else [(key, params, None)])
        if bucket.is_last():
            self._step += 1
            self._new_step = True
            self._replay = None  # only the first step after a load can have DDP's initial layout
        if parts is None:
            return self._reduce(group, tensor, key, params, layout, step, index, f"bucket{index}")
        if len(parts) == 1 and parts[0][0] == key:  # the whole bucket is one kind: no copy
            return self._reduce(group, tensor, key, params, layout, step, index, f"bucket{index}", parts[0][2])
        # The first step after a same-world-size load: DDP's first iteration puts every parameter in
        # one bucket, the saved buffers are its rebuilt buckets. Reduce each saved bucket's values as
        # they were laid out then (a copy), so the codec's blocks and shards, hence the bits, are
        # those of an uninterrupted run; then copy the results back into DDP's buffer.
        flat = tensor.view(-1)
        offs = {pid: (off, ln) for pid, off, ln in layout}
        futs, temps = [], []
        for j, (key, ps, force) in enumerate(parts):
            tmp = torch.cat([flat[offs[id(p)][0]:offs[id(p)][0] + p.numel()] for p in ps])
            lay, o = [], 0
            for p in ps:
                lay.append((id(p), o, p.numel()))
                o += p.numel()
            futs.append(self._reduce(group, tmp, key, ps, lay, step, index, f"bucket{index}.{j}", force))
            temps.append((tmp, ps))

        def scatter(fut: torch.futures.Future) -> torch.Tensor:
            for f in fut.value():
                f.value()  # re-raise a failed part
            for tmp, ps in temps:
                o = 0
                for p in ps:
                    a = offs[id(p)][0]
                    flat[a:a + p.numel()].copy_(tmp[o:o + p.numel()])
                    o += p.numel()
            return tensor

        return torch.futures.collect_all(futs).then(scatter)

    def _is_kept(self, p) -> bool:
        k = self._kept.get(id(p))
        if k is None:
            name = self._name_map().get(id(p), "")
            k = self._kept[id(p)] = bool(self._keep_fn(name, p))
        return k

    def _split_kept(self, parts):
        """Each part split into its codec parameters and its keep_fp32 ones (forced lossless fp32),
        in that order on every rank (DDP's bucket order is the same everywhere)."""
        out = []
        for key, ps, force in parts:
            kept = [p for p in ps if self._is_kept(p)]
            if not kept:
                out.append((key, ps, force))
                continue
            rest = [p for p in ps if not self._is_kept(p)]
            if rest:
                out.append((tuple(id(p) for p in rest), rest, force))
            out.append((tuple(id(p) for p in kept), kept, resolve("fp32")))
        return out

    def _replay_parts(self, params, layout) -> Optional[List[Tuple[Tuple[int, ...], list, Any]]]:
        """The saved buckets wholly inside this bucket (in saved parameter order), plus one part for
        the remaining parameters; None when the bucket is itself a saved one or holds none."""
        key = tuple(id(p) for p in params)
        if key in self._bufs:
            return None
        by_id = {id(p): p for p in params}
        parts, used = [], set()
        for skey in self._replay:
            if skey in self._bufs and all(pid in by_id for pid in skey):
                parts.append((skey, [by_id[pid] for pid in skey], None))
                used.update(skey)
        if not parts:
            return None
        rest = [p for p in params if id(p) not in used]
        if rest:
            parts.append((tuple(id(p) for p in rest), rest, None))
        return parts

    def _reduce(self, group, tensor: torch.Tensor, key: Tuple[int, ...], params, layout, step: int,
                index: int, tuner_key: str, force: Optional[Codec] = None) -> torch.futures.Future:
        """One flatcomm all-reduce of a bucket's values (``layout``: (id(p), offset, numel));
        ``force``: the codec of keep_fp32 parameters, whatever the State's codec."""
        codec, chunks = self.codec, self.chunks
        if force is not None:
            codec = force
        elif self._auto:
            d = self.decisions.get(key)
            if d is None:  # pure given the (MAX-agreed) costs: every rank picks the same
                # A hierarchical topology: the tuner picks the inter-node codec (or the backend) by
                # the two-level model; the State's residual layout is tiered, so the path stays.
                tiers = dict(topology=self.topology, paths=("hierarchical",)) if self._tiered() else {}
                d = self.decisions[key] = self.tuner.choose(tensor.numel(), key=tuner_key, group=group,
                                                            device=tensor.device, deterministic=not self._open,
                                                            **tiers)
            self._key_where[key] = (index, tensor.numel())
            if d.codec == _BACKEND and not (self.error_feedback and self._carries(params)):
                return self._backend(tensor, step, index)
            # (a bucket still carrying residuals from a lossy one sends them once through fp32)
            codec = resolve("fp32" if d.codec == _BACKEND else d.codec, self._block_size)
            chunks = chunks or d.chunks
        if step < self.start_step:  # warm-up: lossless; a residual loaded from a checkpoint is flushed
            codec = resolve("fp32")
        elif self.accordion is not None and force is None:
            codec = self.accordion.choose(key, step, codec)
        res = None
        where = (key, params, layout, tensor.numel(), tensor.device)
        if self.error_feedback and not codec.lossless:
            res = self._buffer_for(*where)
        elif codec.lossless and self.mode == "ordered" and self._carries(params):
            res = self._flush_into_lossless(*where)
        if self._tiered():
            _tiers.add_carry(tensor, res)
        kwargs = {}
        if _HAS_VALIDATE:  # the consistency round trip only for a bucket layout not seen before
            kwargs["validate"] = key not in self._seen
        self._seen.add(key)
        t0 = time.perf_counter()
        v_sq: List[float] = []
        g_sq: List[float] = []
        if self.track_norms:
            # ||g + client_old||^2 = g.g + 2 g.r + r.r (r.r kept from the last step): two read passes,
            # queued on the group's worker thread just before the all-reduce, off the backward thread.
            # The norms stay 0-dim tensors (float64 sums of the fp32 dots, as Python floats would
            # be) until stats() reads them: on CUDA no host sync per bucket.
            def pre():
                flat = tensor.reshape(-1).float()
                g = v = flat.dot(flat).double()
                if res is not None:
                    v = v + 2.0 * flat.dot(res.ef.client).double() + res.client_sq
                v_sq.append(v)
                g_sq.append(g)

            if self._tiered():
                _tiers.submit(self.topology, pre)
            else:
                C._submit(group, tensor.device, pre)  # CUDA: on the all-reduce's side stream, in order
        cs = C.CommStats()
        with self._cond:
            self._inflight += 1
        try:
            if self._tiered():
                h = _tiers.all_reduce(tensor, self.topology, codec, self.mode, res, chunks, cs, kwargs)
            else:
                h = C.all_reduce(tensor, codec=codec, op="avg", mode=self.mode, group=group, async_op=True,
                                 residual=res.ef if res is not None else None, chunks=chunks, stats=cs,
                                 **kwargs)
        except BaseException:
            self._finished()
            raise
        fut = h.get_future()

        def record(f: torch.futures.Future) -> None:
            try:
                f.value()  # raises if the collective failed: DDP sees that error, no record
                self._record(step, index, tensor, res, cs, time.perf_counter() - t0, v_sq[0] if v_sq else None,
                             codec)
                if self.backoff is not None and force is None and res is not None and v_sq:
                    self._accumulate(key, res, v_sq[0], g_sq[0])
            except BaseException:  # noqa: BLE001 - statistics never break training
                pass
            finally:
                self._finished()

        fut.add_done_callback(record)  # runs on the worker thread; does not block
        if self.accordion is not None and force is None:
            fut = self.accordion.watch(key, step, fut)  # DDP waits for it: decisions before the next step
        return fut

    # ---- codec="auto": the measured error against the budget -------------------------------------

    def _accumulate(self, key, res: _Buf, v_sq, g_sq) -> None:
        """Add this step's ||client||^2, ||g + old client||^2, ||g||^2 of a bucket to its window
        (0-dim tensors: no host sync until the check reads them)."""
        with self._lock:
            w = self._window.get(key)
            new = [res.client_sq, v_sq, g_sq]
            self._window[key] = new if w is None else [a + b for a, b in zip(w, new)]

    def _check_errors(self, group, device) -> None:
        """Every ``backoff.every`` steps, at the first bucket of a step (the same point on every
        rank): sum the windows over the ranks and move a bucket whose error is over the budget one
        codec up. Buckets in ``decisions`` order, which is the same on every rank."""
        from .autotune import PRECISION, Decision

        self.wait()
        keys = [k for k, d in self.decisions.items() if d.codec in PRECISION[1:]]
        with self._lock:
            rows = [self._window.get(k, [0.0, 0.0, 0.0]) for k in keys]
            self._window = {}
        sums = _adapt.agreed_sums(rows, lambda t: C.all_reduce(t, codec="fp32", op="sum", mode="ordered",
                                                               group=group), device)
        budget = self.tuner.error_budget
        for k, (c, v, g) in zip(keys, sums):
            d = self.decisions[k]
            move = self.backoff.judge(d.codec, budget, c, v, g, PRECISION)
            if v > 0:  # (a bucket DDP no longer uses, e.g. before its rebuild, sends nothing)
                self._measured[k] = (math.sqrt(c / v), math.sqrt(c / g) if g > 0 else 0.0)
            if move is None:
                continue
            reason = (f"backed off from {move['from']} at step {self._step}: {move['why']} over the last "
                      f"{self.backoff.every} steps, all ranks")
            self.decisions[k] = Decision(move["to"], d.chunks, reason, {})
            index, numel = self._key_where.get(k, (None, None))
            self.adaptations.append({"step": self._step, "bucket": index, "numel": numel, **move})

    def _backend(self, tensor: torch.Tensor, step: int, index: int) -> torch.futures.Future:
        """codec="auto" chose the backend's own all-reduce: exactly torch's default hook (divide,
        ``dist.all_reduce`` on DDP's group, its future), plus a statistics record."""
        pg = self._ddp_group()
        world = dist.get_world_size(pg)
        t0 = time.perf_counter()
        with self._cond:
            self._inflight += 1
        try:
            tensor.div_(world)
            fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()
        except BaseException:
            self._finished()
            raise

        def done(f: torch.futures.Future) -> torch.Tensor:
            try:
                out = f.value()[0]
                ring = int(2 * (world - 1) * 4 * tensor.numel() // world)
                with self._lock:
                    self._records.append({"step": step, "bucket": index, "numel": tensor.numel(),
                                          "codec": _BACKEND, "wire_bytes": ring, "fp32_bytes": ring,
                                          "encode_s": 0.0, "exchange_s": time.perf_counter() - t0,
                                          "decode_s": 0.0, "comm_s": time.perf_counter() - t0,
                                          "client_residual_norm": 0.0, "server_residual_norm": 0.0})
                return out
            finally:
                self._finished()

        return fut.then(done)

    def _finished(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every all-reduce launched by the hook (and its statistics) has finished."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)

    # ---- statistics ------------------------------------------------------------------------------

    def _record(self, step, index, tensor, res, cs: C.CommStats, comm_s, v_sq, codec=None) -> None:
        codec = codec or self.codec
        n = tensor.numel()
        world = dist.get_world_size(self.group)
        rec = {
            "step": step, "bucket": index, "numel": n, "codec": codec.name,
            "wire_bytes": cs.wire_bytes,
            # What a plain fp32 (ring) all-reduce puts on the wire per rank: 2 (W-1)/W * 4n.
            "fp32_bytes": int(2 * (world - 1) * 4 * n // world),
            "encode_s": cs.encode_s, "exchange_s": cs.exchange_s, "decode_s": cs.decode_s,
            "comm_s": comm_s,
        }
        if self.track_norms:
            if res is not None:
                c_sq = res.ef.client.square().sum().double()
                res.client_sq = c_sq
                rec["_norms"] = (c_sq, res.ef.server.square().sum().double(), v_sq, None)
            else:
                rec["_norms"] = (None, None, v_sq, 0.0 if codec.lossless else float("nan"))
        with self._lock:
            self._records.append(rec)
            if self._records and self._records[-1]["step"] - self._records[0]["step"] >= self.history:
                first = self._records[-1]["step"] - self.history + 1
                self._records = [r for r in self._records if r["step"] >= first]

    def stats(self) -> dict:
        """Per step and per bucket, on this rank (plain dicts; the last ``history`` steps).

        Per bucket: ``wire_bytes`` (this rank put on the wire), ``fp32_bytes`` (a plain fp32 ring
        all-reduce: 2(W-1)/W * 4 * numel), seconds in ``encode_s`` / ``exchange_s`` (waiting for
        the network) / ``decode_s`` and ``comm_s`` (launch to result). With ``track_norms``:
        ``input_norm`` = ||g + client_old|| (what this rank meant to send), ``client_residual_norm``
        and ``server_residual_norm`` after the step, and ``rel_error`` = ||client_new|| /
        ||g + client_old||: the relative error of this rank's encoding this step (error feedback
        sends it later; 0 for fp32, NaN for a lossy codec without error feedback where it is not
        measured). Per step: the sums, ``compression`` = fp32_bytes / wire_bytes, and ``rel_error``
        = sqrt(sum ||client_new||^2 / sum ||g + client_old||^2) over the buckets.
        """
        self.wait()
        with self._lock:
            for r in self._records:
                _norms_to_floats(r)
            recs = [dict(r) for r in self._records]
        steps: Dict[int, dict] = {}
        for r in recs:
            s = steps.setdefault(r["step"], {"step": r["step"], "buckets": [], "wire_bytes": 0, "fp32_bytes": 0,
                                             "encode_s": 0.0, "exchange_s": 0.0, "decode_s": 0.0,
                                             "comm_s": 0.0, "_c": 0.0, "_v": 0.0})
            s["buckets"].append(r)
            for k in ("wire_bytes", "fp32_bytes", "encode_s", "exchange_s", "decode_s", "comm_s"):
                s[k] += r[k]
            if "rel_error" in r:
                s["_c"] += r["client_residual_norm"] ** 2
                s["_v"] += r["input_norm"] ** 2
        out = []
        for k in sorted(steps):
            s = steps[k]
            c, v = s.pop("_c"), s.pop("_v")
            s["compression"] = s["fp32_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("inf")
            if self.track_norms:
                s["rel_error"] = math.sqrt(c / v) if v > 0 else 0.0
                s["residual_norm"] = math.sqrt(sum(b["client_residual_norm"] ** 2 + b["server_residual_norm"] ** 2
                                                   for b in s["buckets"]))
            s["buckets"].sort(key=lambda b: b["bucket"])
            out.append(s)
        return {"codec": "auto" if self._auto else self.codec.name, "block_size": self.codec.block_size,
                "mode": self.mode, "error_feedback": self.error_feedback,
                # codec="auto": per bucket, what the tuner chose and why
                "decisions": [{"codec": d.codec, "chunks": d.chunks, "reason": d.reason,
                               "predicted_s": dict(d.predicted_s),
                               **self._measured_fields(k)} for k, d in self.decisions.items()],
                # codec="auto" with backoff: each move to a more precise codec, with its numbers
                "adaptations": [dict(a) for a in self.adaptations],
                "world_size": dist.get_world_size(self.group) if self.group is not None else None,
                "topology": self.topology.describe() if self.topology is not None else None,
                "steps": out}

    def _measured_fields(self, key) -> dict:
        m = self._measured.get(key)
        return {} if m is None else {"measured_rel_error": m[0], "measured_residual_ratio": m[1]}

    # ---- checkpoints -----------------------------------------------------------------------------

    def _params(self) -> Dict[str, torch.nn.Parameter]:
        if self.model is None:
            self._name_map()  # raises with the how-to
        mod = getattr(self.model, "module", self.model)
        return dict(mod.named_parameters())

    def _world_rank(self) -> Tuple[int, int]:
        g = self.group if self.group is not None else self._ddp_group()
        return dist.get_world_size(g), dist.get_rank(g)

    def _meta(self) -> dict:
        return {"codec": "auto" if self._auto else self.codec.name, "block_size": self.codec.block_size,
                "mode": self.mode, "error_feedback": self.error_feedback, "step": self._step,
                "tiered": self._tiered(),
                "scale_seen": self._scale_seen}

    def _rank_residuals(self, name: str, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(client, server) of one parameter on this rank, fp32 views or fresh zeros."""
        loc = self._where.get(id(p))
        if loc is not None:
            key, off, ln = loc
            ef = self._bufs[key].ef
            return ef.client[off:off + ln], ef.server[off:off + ln]
        z = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        return (self._pending[name].to(p.device) if name in self._pending else z), z

    def state_dict(self) -> dict:
        """This rank's state: its own client and server residuals per parameter name, as they are.

        No communication: call it on any rank(s), e.g. every rank saving its own file (like torch's
        DCP does), and :meth:`load_state_dict` it on the same rank at the same world size to continue
        bit for bit. To change the world size, load the list of every rank's dicts (or
        :func:`reshard` it), or save :meth:`resharded_state_dict` (a collective) instead. Plain
        tensors, strings and numbers (``torch.load(weights_only=True)``).
        """
        self.wait()
        world, rank = self._world_rank()
        client: Dict[str, torch.Tensor] = {}
        server: Dict[str, torch.Tensor] = {}
        buckets: List[List[str]] = []
        decisions: List[list] = []
        if self.model is not None:
            names = self._name_map()
            for n, p in self._params().items():
                c, s = self._rank_residuals(n, p)
                client[n] = c.reshape(p.shape).cpu().clone()
                server[n] = s.reshape(p.shape).cpu().clone()
            buckets = [[names[pid] for pid, _, _ in b.layout] for b in self._bufs.values()]
            decisions = [[[names[pid] for pid in key], d.codec, d.chunks] for key, d in self.decisions.items()
                         if all(pid in names for pid in key)]
        out = {"version": STATE_DICT_VERSION, "form": "per_rank", **self._meta(), "world_size": world,
               "rank": rank, "buckets": buckets, "decisions": decisions, "client": client, "server": server}
        if self.accordion is not None and self.model is not None:  # its intervals (the same on every rank)
            out["accordion"] = self.accordion.state_dict(self._name_map())
        return out

    def resharded_state_dict(self) -> dict:
        """The world-size-independent form: per parameter, the total ``T`` that the next step adds
        to the averaged gradient (see the module docs). A collective on flatcomm's group: call it
        on every rank at the same point; every rank gets the same dict, loadable at any world size
        (not bit for bit: the residuals are re-spread over the new ranks)."""
        self.wait()
        world, _ = self._world_rank()
        residual: Dict[str, torch.Tensor] = {}
        if self.model is not None:
            params = self._params()
            parts = []
            for n, p in params.items():
                c, s = self._rank_residuals(n, p)
                # what this rank adds to T (see ddp_tiers for the hierarchical form)
                parts.append((c + s) * (1.0 / world) if self._tiered() else c * (1.0 / world) + s)
            flat = torch.cat(parts) if parts else torch.zeros(0)
            if flat.numel():
                C.all_reduce(flat, codec="fp32", op="sum", mode="ordered", group=self._ensure_group())
            for (n, p), t in zip(params.items(), torch.split(flat, [p.numel() for p in params.values()])):
                residual[n] = t.reshape(p.shape).cpu().clone()
        return {"version": STATE_DICT_VERSION, "form": "total", **self._meta(), "world_size": world,
                "residual": residual}

    def load_state_dict(self, sd, *, allow_codec_change: bool = False) -> None:
        """Restore a state saved by :meth:`state_dict` (this rank's own, same world size: the run
        continues bit for bit), by :meth:`resharded_state_dict`, or a list of every rank's
        :meth:`state_dict` (any world size). Every entry is checked (keys, shapes, dtype,
        finiteness, codec, world size, rank); errors name the parameter. Residuals saved with
        another codec, block size or mode load only with ``allow_codec_change=True`` (the next steps
        send them with this State's codec). No communication.
        """
        if isinstance(sd, (list, tuple)):
            sd = reshard(sd)
        version = check.field(sd, "version", int)
        if version != STATE_DICT_VERSION:
            raise ValueError(f"flatcomm: DDP state version {version} is not supported (this flatcomm "
                             f"reads version {STATE_DICT_VERSION})")
        form = check.field(sd, "form", str)
        if form not in ("per_rank", "total"):
            raise ValueError(f"flatcomm: unknown DDP state form {form!r} (per_rank or total)")
        self.wait()
        changed = self._check_codec(sd, allow_codec_change)
        params = self._params()
        world, rank = self._world_rank()
        if form == "per_rank":
            sw, sr = check.field(sd, "world_size", int), check.field(sd, "rank", int)
            if sw != world:
                raise ValueError(
                    f"flatcomm: this DDP state was saved by rank {sr} of {sw} ranks and this run has {world}: "
                    f"a per-rank state_dict() loads only at the world size it was saved at. To change the "
                    f"world size, pass the list of every rank's state_dict() to load_state_dict (or save "
                    f"state.resharded_state_dict(), a collective, instead)")
            if sr != rank:
                raise ValueError(f"flatcomm: this DDP state is rank {sr}'s and this is rank {rank}: each rank "
                                 f"loads the state_dict() its own rank saved")
            client = self._checked(sd, "client", params)
            server = self._checked(sd, "server", params)
        else:
            # every rank's client = T / (scale * W): the next step adds scale * sum_r client_r = T
            client = {n: t / (self._scale_for(world) * world)
                      for n, t in self._checked(sd, "residual", params).items()}
            server = {}
        self._restore(params, client, server, sd.get("buckets", []) if form == "per_rank" else [], world,
                      sd.get("tiered", False))
        if self._auto and not changed and form == "per_rank":
            self._restore_decisions(params, check.field(sd, "decisions", list))
        self._step = check.field(sd, "step", int)
        if self.accordion is not None and sd.get("accordion") is not None:
            self.accordion.load_state_dict(sd["accordion"], params)
        scale_seen = sd.get("scale_seen")
        self._scale_seen = float(scale_seen) if scale_seen is not None else None

    @staticmethod
    def _scale_for(world: int) -> float:
        return 1.0 / world  # the hook averages

    def _check_codec(self, sd: dict, allow: bool) -> bool:
        saved = (check.field(sd, "codec", str), check.field(sd, "block_size", int), check.field(sd, "mode", str))
        mine = ("auto" if self._auto else self.codec.name, self.codec.block_size, self.mode)
        if saved == mine:
            return False
        if not allow:
            raise ValueError(f"flatcomm: the DDP state was saved with codec={saved[0]!r}, block_size={saved[1]}, "
                             f"mode={saved[2]!r}; this State has codec={mine[0]!r}, block_size={mine[1]}, "
                             f"mode={mine[2]!r}. Create the State with the saved settings, or pass "
                             f"allow_codec_change=True to send the saved residuals with the new codec")
        return True

    def _checked(self, sd: dict, field: str, params) -> Dict[str, torch.Tensor]:
        """sd[field] checked against the model; an empty dict (saved without error feedback) is zeros."""
        d = check.field(sd, field, dict)
        if not d:
            return {}
        check.keys(d, params, f"{field} residuals")
        out = {n: check.residual(n, d[n], params[n].shape, f"{field} residual") for n in params}
        held = [n for n, t in out.items() if t.any()]
        if held and not (self.error_feedback or (self.codec.lossless and self.mode == "ordered")):
            raise ValueError(f"flatcomm: the checkpoint holds residuals (e.g. for {held[0]!r}) but this State "
                             f"cannot send them (codec={self.codec.name!r}, error_feedback={self.error_feedback}, "
                             f"mode={self.mode!r}); they would be dropped. Use error feedback or an ordered "
                             f"fp32 State, or zero them yourself to discard them on purpose")
        return out

    def _restore(self, params, client, server, buckets, world: int, tiered: bool = False) -> None:
        self._bufs.clear()
        self._where.clear()
        self._refs.clear()
        self._pending = {}
        self._replay = None
        placed = set()
        if not isinstance(buckets, list):
            raise TypeError("flatcomm: checkpoint field 'buckets' is not a list")
        for names in buckets:
            for n in names:
                if n not in client or n in placed:
                    raise ValueError(f"flatcomm: checkpoint bucket lists {n!r} "
                                     f"{'twice' if n in placed else 'without its residuals'}")
                placed.add(n)
            ps = [params[n] for n in names]
            key = tuple(id(p) for p in ps)
            c = torch.cat([client[n].reshape(-1) for n in names]).to(ps[0].device)
            s = torch.cat([server[n].reshape(-1) for n in names]).to(ps[0].device)
            layout, off = [], 0
            for p in ps:
                layout.append((id(p), off, p.numel()))
                self._where[id(p)] = (key, off, p.numel())
                off += p.numel()
            self._bufs[key] = _Buf(C.ErrorFeedback(c, s), layout, float(c.square().sum()) if self.track_norms else 0.0)
            self._refs[key] = len(layout)
        if self._bufs:
            self._replay = list(self._bufs)
            self._replay_tiered = bool(tiered)
        for n, c in client.items():
            if n in placed:
                continue
            # Not in a buffer: fold the server residual into the client one (client + server / scale).
            # (hierarchical: the server residual is already in client units, see ddp_tiers)
            t = (c.reshape(-1) + server[n].reshape(-1) * (1 if tiered else world) if n in server
                 else c.reshape(-1).clone())
            if t.any():
                self._pending[n] = t

    def _restore_decisions(self, params, saved: list) -> None:
        from .autotune import Decision

        self.decisions = {}
        for names, codec, chunks in saved:
            key = tuple(id(params[n]) for n in names if n in params)
            self.decisions[key] = Decision(str(codec), int(chunks), "restored from a checkpoint", {})

    def total_residual(self) -> Dict[str, torch.Tensor]:
        """``T`` per parameter name (a collective, like :meth:`resharded_state_dict`)."""
        return self.resharded_state_dict()["residual"]


def reshard(states) -> dict:
    """Every rank's :meth:`State.state_dict` (one save, any order) combined into the
    world-size-independent form of :meth:`State.resharded_state_dict`, with the same bits, without
    communication: ``T = sum over ranks r, in rank order, of client_r / W + server_r``."""
    states = list(states)
    if not states or not all(isinstance(s, dict) and s.get("form") == "per_rank" for s in states):
        raise ValueError("flatcomm: reshard takes the list of every rank's state_dict() (per-rank form)")
    world = len(states)
    by_rank = {check.field(s, "rank", int): s for s in states}
    if sorted(by_rank) != list(range(world)) or any(s.get("world_size") != world for s in states):
        raise ValueError(f"flatcomm: reshard needs the state_dict() of every rank of one save: got ranks "
                         f"{sorted(s.get('rank') for s in states)} of world sizes "
                         f"{sorted({s.get('world_size') for s in states})}")
    meta = ("codec", "block_size", "mode", "step")
    for s in states:
        if any(s.get(k) != states[0].get(k) for k in meta):
            raise ValueError(f"flatcomm: reshard: the ranks' states disagree on {meta} (not one save)")
    first = by_rank[0]
    names = list(first["client"])
    residual = {}
    for n in names:
        acc = None
        for r in range(world):
            s = by_rank[r]
            if n not in s["client"] or n not in s["server"]:
                raise KeyError(f"flatcomm: reshard: rank {r}'s state has no residual for {n!r}")
            shape = getattr(first["client"][n], "shape", ())
            c = check.residual(n, s["client"][n], shape, f"rank {r} client residual")
            srv = check.residual(n, s["server"][n], c.shape, f"rank {r} server residual")
            v = (c + srv) * (1.0 / world) if first.get("tiered") else c * (1.0 / world) + srv
            acc = v if acc is None else acc + v
        residual[n] = acc
    out = {k: first[k] for k in ("version", "codec", "block_size", "mode", "error_feedback", "step", "scale_seen")}
    return {**out, "form": "total", "world_size": world, "residual": residual}


def hook(state: State, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: flatcomm all-reduce (average) of the bucket; the future holds the buffer."""
    return state._launch(bucket)


# Real objects, not the strings `from __future__ import annotations` leaves: DDP compares them.
hook.__annotations__ = {"state": State, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, codec: Any = "int8", *,
             error_feedback: bool = True, mode: Optional[str] = None, group: Optional[dist.ProcessGroup] = None,
             chunks: Optional[int] = None, block_size: Optional[int] = None, ratio: Optional[float] = None,
             grad_scaler: Optional[Any] = None, track_norms: bool = True, history: int = 100,
             tuner: Optional[Any] = None, topology: Optional[Any] = None,
             start_step: Optional[int] = None, keep_fp32: Any = None, backoff: Any = None,
             accordion: Any = None) -> State:
    """Create a :class:`State` that knows ``ddp_model`` and register :func:`hook` on it.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` (anything else raises TypeError).
        codec: ``"int8"`` (default), ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int4"``, ``"sign"``,
            ``"topk"``, ``"auto"`` or a :class:`flatcomm.Codec`. The default is int8 with error
            feedback because a DDP hook exists to cut gradient traffic (4x less than fp32, the same
            final loss in the demo), while the collectives and ``flatcomm.fsdp.apply`` default to
            lossless fp32 like the ``torch.distributed`` calls they stand in for.
        error_feedback: keep client/server residuals so a lossy codec loses nothing over time.
        mode: None (the default) means the caller did not ask for determinism: fixed codecs run
            ``"ordered"`` (flatcomm's sums are the same bits every run anyway), and ``codec="auto"``
            may also hand a bucket to the backend's own all-reduce (torch's default hook: gloo's /
            NCCL's algorithm, whose bits flatcomm does not control) where that is predicted fastest,
            so auto never costs more than the default hook beyond the model's error.
            ``"ordered"`` or ``"exact"`` (fp32 only) asks for determinism: auto then chooses among
            flatcomm's own collectives only.
        group: process group for flatcomm's traffic (default: a private copy of DDP's group).
        chunks: pipeline chunks per all-reduce (default: automatic).
        block_size, ratio: override the codec's block size / topk ratio.
        grad_scaler: a ``GradScaler`` whose scale changes rescale the residuals.
        track_norms, history: residual/gradient norms for :meth:`State.stats`, and how many steps it keeps.
        tuner: a :class:`flatcomm.autotune.Tuner` for ``codec="auto"``.
        topology: a :class:`flatcomm.Topology`, ``"flat"`` or None (from torchrun's ``LOCAL_WORLD_SIZE``).
        start_step: steps sent in lossless fp32 before the codec starts (see :class:`State`).
        keep_fp32: parameters always sent in lossless fp32: a predicate ``f(name, param)``, name
            patterns, or ``"small"`` (see :class:`State`).
        backoff: ``codec="auto"`` only: when measured compression error moves a bucket to a more
            precise codec (see :class:`State`; ``False`` turns it off).
        accordion: a precise codec in critical intervals, ``codec`` otherwise (Accordion; see
            :class:`State` and :mod:`flatcomm.ddp_accordion`): ``"int8"``, ``True`` or an ``Accordion``.

    Returns the :class:`State` (for ``state_dict()``, ``stats()``, ``decisions``).
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"flatcomm.ddp.register needs a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first (DistributedDataParallel(model)), or for "
                        f"FSDP use flatcomm.fsdp.apply")
    state = State(codec, error_feedback=error_feedback, mode=mode, group=group, chunks=chunks,
                  block_size=block_size, ratio=ratio, model=ddp_model, grad_scaler=grad_scaler,
                  track_norms=track_norms, history=history, tuner=tuner, topology=topology,
                  start_step=start_step, keep_fp32=keep_fp32, backoff=backoff, accordion=accordion)
    ddp_model.register_comm_hook(state, hook)
    return state
