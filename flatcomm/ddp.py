"""DistributedDataParallel communication hook built on :func:`flatcomm.collectives.all_reduce`.

Usage::

    ddp = DistributedDataParallel(model)
    state = flatcomm.ddp.register(ddp, "int8")          # or: ddp.register_comm_hook(State("int8"), hook)
    ...
    ckpt["flatcomm"] = state.state_dict()                # a collective: call it on every rank
    state.load_state_dict(ckpt["flatcomm"])             # any world size

The hook averages like DDP's default hook (``op="avg"``): every rank ends with the same bits.

**Process group.** By default flatcomm's traffic runs on a dedicated group created at the first hook
call with ``dist.new_group(ranks of the DDP group)`` (DDP calls the hook in the same order on every
rank, so this is safe; it works on gloo). Keeping it off DDP's own group means DDP's collectives (the
unused-parameter bitmap, the bucket rebuild broadcast) never interleave with flatcomm's in a
different order on different ranks. Pass ``group=`` to use another one.

**Ordering.** The hook calls ``all_reduce(bucket.buffer(), ..., async_op=True)`` and returns
``handle.get_future()`` (its value is the bucket buffer, averaged in place). flatcomm runs every
collective of a group on that group's single worker thread in submission order, so all ranks issue
them in the same order; backward computation overlaps communication, and nothing blocks inside a
future callback (the statistics callback only reads norms). When ``collectives.all_reduce`` takes
``validate=``, its consistency all-gather runs only the first time a bucket layout is seen.

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
``sum_r server_r``). :meth:`State.state_dict` computes ``T`` per parameter (a SUM all-reduce of
``scale * client_r + server_r``, flatcomm's ordered fp32 sum, so it is deterministic) and stores it
under the parameter's name; :meth:`State.load_state_dict` at any world size W' sets
``client = T / (scale' * W') = T`` on every rank and ``server = 0``, so the next step adds
``scale' * W' * T = T`` again.

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

from . import collectives as C
from .codecs import Codec, resolve

__all__ = ["State", "hook", "register"]

STATE_DICT_VERSION = 1
# What register(ddp, "sign") uses unless block_size= / start_step= say otherwise. Sign sends every
# value of a block at the block's mean magnitude: with 256-value blocks Adam's second moment grew
# 1.8x (median, 4x at p90) and the residual reached 6x the gradient early in training; smaller
# blocks and lossless first steps keep both close (tools/bench/adam_probe.py, convergence.py).
CODEC_DEFAULTS = {"sign": {"block_size": 64, "start_step": 20}}
# collectives.all_reduce(validate=...) skips the per-call consistency all-gather when False.
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


class State:
    """State of the flatcomm DDP comm hook (see the module docstring).

    codec: ``fp32`` (lossless, ordered sum), ``bf16``/``fp16``, ``int8``, ``int4``, ``sign``, ``topk``
    or a :class:`flatcomm.Codec`; ``block_size`` / ``ratio`` override its parameters.
    error_feedback: keep client/server residuals for lossy codecs.
    mode: ``ordered`` or ``exact`` (fp32 only, rank-count independent bits).
    group: process group for flatcomm's traffic (default: a dedicated copy of DDP's group).
    chunks: pipeline chunks per all-reduce (default: automatic).
    model: the DDP model (or its module), for parameter names in checkpoints; :func:`register` sets it.
    grad_scaler: a GradScaler whose scale changes rescale the residuals.
    track_norms: compute the residual/gradient norms for :meth:`stats` (two dot products over the
        bucket before sending and one norm of each residual after).
    history: how many steps :meth:`stats` keeps.
    codec="auto": a :class:`flatcomm.autotune.Tuner` (``tuner=``, default error budget int8) picks the
        codec of each bucket at its first hook call; ``decisions`` / ``stats()["decisions"]`` say what
        and why. A parameter that moves (bucket rebuild) from a lossy bucket into one where fp32 was
        chosen brings its residual along: it is added once to that bucket's lossless all-reduce.
    start_step: steps (hook rounds, counted like ``state_dict()["step"]``) sent in lossless fp32 before
        the codec starts (like PowerSGD's ``start_powerSGD_iter``): early gradients are large and
        change fast, and an adaptive optimizer's variance estimate forms from them. Residuals start
        at zero when the codec does; a checkpoint's step count carries the warm-up across restarts.
        Default 0, except for ``codec="sign"`` given by name: see ``CODEC_DEFAULTS`` (block_size too).
    """

    def __init__(self, codec: Any = "int8", *, error_feedback: bool = True, mode: str = "ordered",
                 group=None, chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, model: Optional[torch.nn.Module] = None,
                 grad_scaler=None, track_norms: bool = True, history: int = 100, tuner=None,
                 start_step: Optional[int] = None):
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
        self.mode = mode
        self.error_feedback = bool(error_feedback) and (self._auto or not self.codec.lossless) and mode == "ordered"
        self.chunks = chunks
        self.group = group
        self._dedicated = group is None
        self.model = model
        self.grad_scaler = grad_scaler
        self.track_norms = track_norms
        self.history = history
        self._bufs: Dict[Tuple[int, ...], _Buf] = {}
        self._where: Dict[int, Tuple[Tuple[int, ...], int, int]] = {}
        self._refs: Dict[Tuple[int, ...], int] = {}
        self._pending: Dict[str, torch.Tensor] = {}
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
        if self.group is None:
            ddp_pg = self._ddp_group()
            ranks = dist.get_process_group_ranks(ddp_pg)
            if len(ranks) == dist.get_world_size():
                self.group = dist.new_group(ranks)
            else:  # only the members call the hook: synchronise among them only
                self.group = dist.new_group(ranks, use_local_synchronization=True)
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

    def _buffer_for(self, bucket) -> _Buf:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        b = self._bufs.get(key)
        if b is not None:
            return b
        layout = self._layout(bucket)
        n = bucket.buffer().numel()
        dev = bucket.buffer().device
        ef = C.ErrorFeedback.zeros(n, device=dev)
        scale = self._scale()
        world = dist.get_world_size(self.group)
        names = self._name_map() if self._pending else None
        dropped = set()
        for (pid, off, ln), p in zip(layout, params):
            old = self._where.get(pid)
            dst = ef.client[off:off + ln]
            if old is not None:
                okey, ooff, oln = old
                ob = self._bufs[okey]
                # Fold the server residual into the client one: the shard layout changes.
                torch.add(ob.ef.client[ooff:ooff + oln], ob.ef.server[ooff:ooff + oln], alpha=1.0 / scale,
                          out=dst)
                self._refs[okey] -= 1
                if self._refs[okey] == 0:
                    dropped.add(okey)
            elif names is not None and names.get(pid) in self._pending:
                t = self._pending.pop(names[pid])
                dst.copy_(t.reshape(-1).to(device=dev, dtype=torch.float32) / (scale * world))
            self._where[pid] = (key, off, ln)
        for okey in dropped:
            del self._bufs[okey], self._refs[okey]
        b = _Buf(ef, layout, float(ef.client.square().sum()) if self.track_norms else 0.0)
        self._bufs[key] = b
        self._refs[key] = len(layout)
        return b

    def _carries(self, bucket) -> bool:
        """Whether a parameter of this bucket still has a residual (from a lossy bucket or a checkpoint)."""
        if any(id(p) in self._where for p in bucket.parameters()):
            return True
        if not self._pending:
            return False
        names = self._name_map()
        return any(names.get(id(p)) in self._pending for p in bucket.parameters())

    def _flush_into_lossless(self, bucket) -> _Buf:
        """codec="auto" chose fp32 for a bucket whose parameters carry residuals: assemble them once
        (server folded into client, so the buffer holds ``T / scale`` per rank, see the module docs)
        and forget them. The fp32 encode adds the client residual to the gradient and zeroes it, so
        the averaged result gains ``scale * sum_r client_r = T``: nothing is lost, nothing is kept."""
        b = self._buffer_for(bucket)
        key = tuple(id(p) for p in bucket.parameters())
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

    def _launch(self, bucket) -> torch.futures.Future:
        group = self._ensure_group()
        if self._new_step:
            self._new_step = False
            if self.grad_scaler is not None and self.error_feedback:
                self._rescale_for_scaler()
        step, index = self._step, bucket.index()
        if bucket.is_last():
            self._step += 1
            self._new_step = True
        tensor = bucket.buffer()
        key = tuple(id(p) for p in bucket.parameters())
        codec, chunks = self.codec, self.chunks
        if self._auto:
            d = self.decisions.get(key)
            if d is None:  # pure given the (MAX-agreed) costs: every rank picks the same
                d = self.decisions[key] = self.tuner.choose(tensor.numel(), key=f"bucket{index}", group=group,
                                                            device=tensor.device)
            codec = resolve(d.codec, self._block_size)
            chunks = chunks or d.chunks
        if step < self.start_step:  # warm-up: lossless; a residual loaded from a checkpoint is flushed
            codec = resolve("fp32")
        res = None
        if self.error_feedback and not codec.lossless:
            res = self._buffer_for(bucket)
        elif self.error_feedback and self._carries(bucket):
            res = self._flush_into_lossless(bucket)
        kwargs = {}
        if _HAS_VALIDATE:  # the consistency round trip only for a bucket layout not seen before
            kwargs["validate"] = key not in self._seen
        self._seen.add(key)
        t0 = time.perf_counter()
        v_sq: List[float] = []
        if self.track_norms:
            # ||g + client_old||^2 = g.g + 2 g.r + r.r (r.r kept from the last step): two read passes,
            # queued on the group's worker thread just before the all-reduce, off the backward thread.
            # The norms stay 0-dim tensors (float64 sums of the fp32 dots, as Python floats would
            # be) until stats() reads them: on CUDA no host sync per bucket.
            def pre():
                flat = tensor.reshape(-1).float()
                v = flat.dot(flat).double()
                if res is not None:
                    v = v + 2.0 * flat.dot(res.ef.client).double() + res.client_sq
                v_sq.append(v)

            C._submit(group, tensor.device, pre)  # CUDA: on the all-reduce's side stream, in order
        cs = C.CommStats()
        with self._cond:
            self._inflight += 1
        try:
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
            except BaseException:  # noqa: BLE001 - statistics never break training
                pass
            finally:
                self._finished()

        fut.add_done_callback(record)  # runs on the worker thread; does not block
        return fut

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
                               "predicted_s": dict(d.predicted_s)} for d in self.decisions.values()],
                "world_size": dist.get_world_size(self.group) if self.group is not None else None,
                "steps": out}

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The residuals as one tensor per parameter name, in averaged-gradient units (``T``).

        A collective on flatcomm's group: call it on every rank at the same point. Every rank gets
        the same dict; it holds only tensors, strings and numbers (``torch.load(weights_only=True)``).
        """
        self.wait()
        residual: Dict[str, torch.Tensor] = {}
        if self._where:
            names = self._name_map()
            group = self._ensure_group()
            scale = self._scale()
            mod = getattr(self.model, "module", self.model)
            entries = [(n, p) for n, p in mod.named_parameters() if id(p) in self._where]
            parts = []
            for n, p in entries:
                key, off, ln = self._where[id(p)]
                ef = self._bufs[key].ef
                parts.append(ef.client[off:off + ln] * scale + ef.server[off:off + ln])
            flat = torch.cat(parts) if parts else torch.zeros(0)
            C.all_reduce(flat, codec="fp32", op="sum", mode="ordered", group=group)
            for (n, p), t in zip(entries, torch.split(flat, [p.numel() for _, p in entries])):
                residual[n] = t.reshape(p.shape).cpu().clone()
            del names
        for n, t in self._pending.items():  # loaded, not yet used: already a global total
            residual[n] = t.clone()
        return {"version": STATE_DICT_VERSION, "codec": "auto" if self._auto else self.codec.name,
                "block_size": self.codec.block_size,
                "world_size": dist.get_world_size(self.group) if self.group is not None else dist.get_world_size(),
                "step": self._step, "residual": residual}

    def load_state_dict(self, sd: dict) -> None:
        """Restore residuals saved by :meth:`state_dict`, at any world size (see the module docs).

        Residuals are placed when their parameters' buckets next reach the hook.
        """
        if sd.get("version") != STATE_DICT_VERSION:
            raise ValueError(f"flatcomm: unsupported DDP state version {sd.get('version')!r}")
        self.wait()
        names = set(self._name_map().values())
        unknown = sorted(set(sd["residual"]) - names)
        if unknown:
            raise KeyError(f"flatcomm: checkpoint has residuals for unknown parameters: {unknown[:5]}")
        self._bufs.clear()
        self._where.clear()
        self._refs.clear()
        self._pending = {n: t.detach().to(torch.float32).clone() for n, t in sd["residual"].items()}
        self._step = int(sd.get("step", 0))
        self._scale_seen = None

    def total_residual(self) -> Dict[str, torch.Tensor]:
        """``T`` per parameter name (a collective, like :meth:`state_dict`)."""
        return self.state_dict()["residual"]


def hook(state: State, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: flatcomm all-reduce (average) of the bucket; the future holds the buffer."""
    return state._launch(bucket)


# Real objects, not the strings `from __future__ import annotations` leaves: DDP compares them.
hook.__annotations__ = {"state": State, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def register(ddp_model, codec: Any = "int8", *, error_feedback: bool = True, mode: str = "ordered",
             **opts) -> State:
    """Create a :class:`State` that knows ``ddp_model`` and register :func:`hook` on it."""
    state = State(codec, error_feedback=error_feedback, mode=mode, model=ddp_model, **opts)
    ddp_model.register_comm_hook(state, hook)
    return state
