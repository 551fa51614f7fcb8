"""FSDP reduce backends built on :func:`flatcomm.collectives.reduce_scatter` (FSDP2 and FSDP1).

FSDP2 (``fully_shard``)::

    model = ...; fully_shard(block) for each block; fully_shard(model)
    rs = flatcomm.fsdp.apply(model, codec="int8")     # every FSDPModule (the setter is not recursive)
    ...                                               # train as usual
    rs.stats.wire_bytes                               # bytes this rank sent
    dcp.save({"model": ..., "flatcomm": rs.state_dict()}, checkpoint_id=path)

or by hand: ``module.set_custom_reduce_scatter(flatcomm.fsdp.ReduceScatter("int8"))`` on each
``FSDPModule`` (one instance may serve several modules).

FSDP1::

    fsdp = FullyShardedDataParallel(model, ...)
    state = flatcomm.fsdp.FSDP1State("int8", model=fsdp)
    fsdp.register_comm_hook(state, flatcomm.fsdp.fsdp1_hook)

**Ops.** FSDP2 passes ``AVG`` (fp32/bf16 reduce), ``SUM`` (fp16 reduce, or forced sum; FSDP then
divides before/after itself) or ``PREMUL_SUM`` carrying ``op.factor`` (a gradient divide factor other
than the world size). ``PREMUL_SUM`` is reduced as a ``SUM`` in fp32 and multiplied by the factor
once, in fp32, before the result is written in the output dtype: the same bits a fused scale would
give, for one extra pass over the shard. FSDP1 hooks average (FSDP1 divides only on its default path).

**Dtypes.** Inputs may be fp32, bf16 or fp16 (``MixedPrecisionPolicy.reduce_dtype``); sums run in
fp32 and the output is written in its own dtype. With the lossless ``fp32`` codec a bf16/fp16 input
is sent as bf16/fp16 (exact for such values, half the bytes).

**Error-feedback residuals, keyed by parameter name.** A residual is what this rank's encoding of its
reduce-scatter input did not send (fp32, input-sized, different on every rank). FSDP2 calls the comm
once per parameter group per backward with ``input = concat over ranks r of (concat over the group's
parameters p of chunk r of p's dim-0-padded gradient)``; the group holds only the parameters that
received a gradient this step, so the input size alone is not a stable key, and two identical layers
have equal sizes. :func:`apply` therefore sets on each module its own
:class:`ModuleReduceScatter` (:meth:`ReduceScatter.for_module`), which knows the module's parameters
in FSDP's order and, from their DTensor placements (public API), the values each holds per rank:
``c = ceil(rows / world) * (values per row)``. When every parameter got a gradient (the input
size says so) that is the call's layout; otherwise, or for a ``ReduceScatter`` set by hand, the
group is FSDP's own list (a private frame, kept in :mod:`flatcomm._fsdp_private` with a test that
fails when torch changes it), and if even that fails, the key falls back to the input size.
``layout_sources`` counts which way each call went. Each parameter's name (from the model given to
:func:`apply`, else FSDP's root-relative ``_param_fqn``) owns its slice of ``c`` values per rank. Residuals are
kept as one flat buffer per distinct group (so encoding is one pass over one tensor); when a new
group appears (a parameter without a gradient, a different wrapping) its buffer is assembled once
from the old ones parameter by parameter (zeros for parameters never seen) and old buffers are freed
when no parameter refers to them. (The store, :class:`flatcomm._residuals.Store`, is the one the DDP hook
uses.) Names are stable across steps, processes and re-wrapping (a new
``fully_shard`` of the same model), so residuals survive re-sharding at the same world size; a
different world size changes the padding and the owner of every value: loading then raises.

``state_dict()`` maps ``"rank{r}.{param name}"`` to that rank's residual for the parameter (a plain
fp32 tensor of the padded unsharded numel). Every rank saves different values, so the rank is part
of the key: DCP would otherwise de-duplicate equal keys as replicated tensors and keep only one
rank's values. When the backend knows the model (:func:`apply`), ``state_dict()`` lists every
parameter (zeros before the first step), so ``dcp.load`` can fill it in place before training.
``keep_fp32=`` and the ``auto`` backoff (``backoff=``, decisions saved as
``"rank{r}.__decisions__"``): :mod:`flatcomm.fsdp_adapt`.
FSDP1 residuals are keyed by FSDP unit (module name when ``model`` is given, else the order in which
units first reduce) and live in the same kind of dict.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _fsdp_private as _private
from . import _options
from . import checkpoint as check
from . import collectives as C
from . import ddp_adapt as _adapt
from . import fsdp_adapt as _fadapt
from ._residuals import Store
from .autotune import PRECISION
from .codecs import Codec, resolve

__all__ = ["ReduceScatter", "ModuleReduceScatter", "FSDP1State", "fsdp1_hook", "apply", "Stats"]

_Pieces = List[Tuple[str, int]]  # (name, values per rank) in the input's row layout
_RANK_KEY = re.compile(r"rank(\d+)\.")
_STEP_KEY = "__step__"  # per-rank warm-up step count in state_dict() (with start_step only)
_FSDP1_WRAPPER = "_fsdp_wrapped_module."
_DECISIONS_KEY = "__decisions__"  # per-rank codec="auto" decisions in state_dict() (fsdp_adapt.encode)


@dataclasses.dataclass
class Stats(C.CommStats):
    """:class:`~flatcomm.collectives.CommStats` plus, with ``codec="auto"``, what was chosen per
    collective size: ``decisions[(kind, numel)]`` is a :class:`flatcomm.autotune.Decision`
    (codec, chunks, reason, predicted seconds per codec)."""

    decisions: Dict[Tuple[str, int], Any] = dataclasses.field(default_factory=dict)

    def add(self, other: C.CommStats) -> None:
        for f in dataclasses.fields(C.CommStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.decisions.update(getattr(other, "decisions", {}))


# ---- residual storage, keyed by parameter name --------------------------------------------------


@dataclasses.dataclass
class _Group:
    """One parameter group's residuals: ``buf[r]`` is this rank's residual of rank r's chunk."""
    buf: torch.Tensor  # [world, values per rank of the group]
    layout: List[Tuple[Any, int, int]]  # (name, offset, values per rank)


class _Residuals:
    """Flat fp32 residual buffers, one per distinct parameter group (a :class:`flatcomm._residuals.Store`
    keyed by parameter name), addressable per parameter, plus the model's sizes when known."""

    def __init__(self) -> None:
        self._store: Store[_Group] = Store()
        self.templates: Dict[str, int] = {}  # name -> padded unsharded numel (known in advance)

    def view(self, name: str) -> Optional[torch.Tensor]:
        """This rank's residual of ``name`` as a [world, c] view (None if never seen)."""
        loc = self._store.locate(name)
        if loc is None:
            return None
        group, off, c = loc
        return group.buf[:, off:off + c]

    def holds(self, pieces: _Pieces) -> bool:
        """Whether any of these parameters has a residual (placed or loaded)."""
        names = [n for n, _ in pieces]
        return self._store.holds(names, names)

    def get(self, pieces: _Pieces, world: int, device: torch.device) -> torch.Tensor:
        key = tuple(n for n, _ in pieces)
        total = sum(c for _, c in pieces)
        hit = self._store.get(key)
        if hit is not None and hit.buf.shape == (world, total) and hit.buf.device == device:
            return hit.buf.view(-1)
        buf = torch.zeros(world, total, dtype=torch.float32, device=device)
        layout, off = [], 0
        for name, c in pieces:
            layout.append((name, off, c))
            off += c

        def move(old: _Group, ooff: int, oc: int, off: int, c: int) -> None:
            if oc == c and old.buf.shape[0] == world:  # else another world size: nothing carries over
                buf[:, off:off + c].copy_(old.buf[:, ooff:ooff + oc])

        def load(src: torch.Tensor, name: str, off: int, c: int) -> None:
            if src.numel() != world * c:
                raise ValueError(
                    f"flatcomm: loaded residual for {name!r} has {src.numel()} values but this "
                    f"run needs {world} x {c} (residuals load at the world size they were saved at)")
            buf[:, off:off + c].copy_(src.view(world, c))

        self._store.place(key, _Group(buf, layout), move, load, name_of=str)
        return buf.view(-1)

    def names(self) -> List[str]:
        return sorted({str(n) for n in self._store.ids()} | set(self._store.pending) | set(self.templates))

    def state_dict(self, prefix: str) -> Dict[str, torch.Tensor]:
        out = {}
        for name in self.names():
            v = self.view(name)
            if v is not None:
                t = v.reshape(-1).clone()
            elif name in self._store.pending:
                t = self._store.pending[name].clone()
            else:
                t = torch.zeros(self.templates[name], dtype=torch.float32)
            out[prefix + name] = t
        return out

    def load_state_dict(self, sd: Dict[str, torch.Tensor], prefix: str) -> None:
        loaded = {}
        for k, v in sd.items():
            if not k.startswith(prefix):
                continue
            name = k[len(prefix):]
            n = self.templates.get(name)
            shape = (n,) if n is not None else tuple(getattr(v, "shape", ()))
            if n is not None and isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() != n:
                raise ValueError(f"flatcomm: loaded residual for {name!r} has {v.numel()} values, "
                                 f"this model needs {n} (same world size required)")
            loaded[name] = check.residual(name, v, shape).reshape(-1).clone()
        if self.templates:  # the model is known: every parameter must come back
            check.keys([n for n in loaded if n in self.templates], self.templates, f"{prefix[:-1]} residuals")
        self._store.clear(loaded)


def _op_scale(op: Any, world: int) -> Tuple[str, Optional[float]]:
    """(flatcomm op, extra factor to apply after a sum) for the op FSDP passes."""
    if isinstance(op, str):
        return op.lower(), None
    factor = getattr(op, "factor", None)
    if op == dist.ReduceOp.PREMUL_SUM:
        if factor is None:
            raise ValueError("flatcomm: PREMUL_SUM without a factor")
        f = float(factor if not isinstance(factor, torch.Tensor) else factor.item())
        return "sum", f
    if op == dist.ReduceOp.AVG:
        return "avg", None
    if op == dist.ReduceOp.SUM:
        return "sum", None
    raise ValueError(f"flatcomm: unsupported reduce op {op!r} (AVG, SUM or PREMUL_SUM)")


def _group_sig(group) -> Tuple[int, ...]:
    """The same value on every rank for the same group (unlike ``id(group)``)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _wire_codec(codec: Codec, dtype: torch.dtype) -> Codec:
    """The lossless codec sends bf16/fp16 inputs in their own dtype (exact, half the bytes)."""
    if codec.lossless and dtype == torch.bfloat16:
        return resolve("bf16")
    if codec.lossless and dtype == torch.float16:
        return resolve("fp16")
    return codec


class _Done:
    """A completed :class:`flatcomm.collectives.Handle` (a call that had to run synchronously)."""

    def __init__(self, value: torch.Tensor):
        self._value = value

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        return self._value

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._value)
        return fut


class _ScaledHandle:
    """A :class:`flatcomm.collectives.Handle` whose result is multiplied by a factor on completion."""

    def __init__(self, handle: C.Handle, finish, value: torch.Tensor):
        self._h, self._finish, self._value, self._done = handle, finish, value, False

    def _run_finish(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        self._h.wait(timeout)
        self._run_finish()
        return self._value

    def is_completed(self) -> bool:
        return self._h.is_completed()

    def get_future(self) -> torch.futures.Future:
        def cb(fut):
            fut.value()
            self._run_finish()
            return self._value

        return self._h.get_future().then(cb)


def _reduce(output: torch.Tensor, input: torch.Tensor, *, codec: Codec, op: Any, mode: str,
            group, async_op: bool, residual: Optional[torch.Tensor], chunks: Optional[int],
            stats: C.CommStats, first_call: Callable[..., bool]):
    world = dist.get_world_size(group)
    fop, factor = _op_scale(op, world)
    wc = _wire_codec(codec, input.dtype)
    # PREMUL_SUM's factor is applied locally: the collective itself is a sum either way.
    validate = first_call("rs", _group_sig(group), input.numel(), input.dtype, output.dtype, wc.name, fop)
    kw = dict(codec=wc, mode=mode, group=group, residual=residual, chunks=chunks, stats=stats,
              validate=validate)
    if factor is None:
        return C.reduce_scatter(output, input, op=fop, async_op=async_op, **kw)
    # PREMUL_SUM: fp32 sum, one fp32 multiply, then the output dtype (see the module docstring).
    tmp = output if output.dtype == torch.float32 else torch.empty(
        output.shape, dtype=torch.float32, device=output.device)

    def finish():
        if tmp is output:
            output.mul_(factor)
        else:
            output.copy_(tmp.mul_(factor))

    h = C.reduce_scatter(tmp, input, op="sum", async_op=async_op, **kw)
    if h is None:
        finish()
        return None
    return _ScaledHandle(h, finish, output)


class _Backend:
    def __init__(self, codec: Any, *, error_feedback: bool, mode: str, chunks: Optional[int],
                 block_size: Optional[int], ratio: Optional[float], tuner=None, start_step: int = 0,
                 keep_fp32: Any = None, backoff: Any = None):
        o = _options.resolve(codec, error_feedback=error_feedback, mode=mode, block_size=block_size,
                             ratio=ratio, tuner=tuner, start_step=start_step, keep_fp32=keep_fp32,
                             backoff=backoff)
        # Warm-up: the first start_step reductions of each parameter group / unit are lossless fp32
        # (FSDP has no step counter we can see: a group reduces once per backward). Counted from the
        # step a checkpoint saved ("rank{r}.__step__").
        self.start_step = o.start_step
        self._calls: Dict[Any, int] = {}
        self._step_base = 0
        # codec="auto": the tuner picks per collective size (the same on every rank); self.codec is
        # then only the lossless placeholder and stats.decisions says what was chosen and why.
        self._auto = o.auto
        if o.auto:
            self.tuner = o.tuner
        self._block_size = o.block_size
        self.codec: Codec = o.codec
        self.mode = o.mode
        self.error_feedback = o.error_feedback
        self._keep_fn = o.keep_fn  # keep_fp32 as a predicate f(name, param), or None
        self._kept: Dict[str, bool] = {}  # name -> keep_fp32(name, param), asked once
        self._params: Dict[str, torch.Tensor] = {}  # name -> parameter, for keep_fp32
        # codec="auto": (kind, numel) -> Decision, the tuner's or a backoff's (mirrored in stats)
        self._decided: Dict[Tuple[str, int], Any] = {}
        self._decisions_loaded = False  # restored from a checkpoint: saved again (see _decisions_entry)
        self.backoff = o.backoff
        self._monitor = _adapt.Monitor(o.backoff or _adapt.Backoff(every=0))
        self.adaptations: List[dict] = self._monitor.adaptations  # the backoff's moves, with numbers
        self._reductions: Dict[Tuple[str, int], int] = {}  # auto key -> reductions so far (backoff)
        self.chunks = chunks
        self.stats = Stats()
        self._res = _Residuals()
        self._validated: set = set()

    def _first_call(self, *signature) -> bool:
        """True the first time a call signature is seen: only then does the collective run its
        cross-rank consistency check (a round trip, and a host sync on CUDA). FSDP issues the same
        sequence of collectives on every rank, so a signature checked once stays consistent. The
        signature must be equal across ranks for equal calls (no object ids or addresses): every
        rank must make the same choice, or the check's all-gather pairs with a payload exchange."""
        if signature in self._validated:
            return False
        self._validated.add(signature)
        return True

    def _codec_for(self, numel: int, group, device: torch.device, kind: str) -> Codec:
        """The codec of one collective: fixed, or the tuner's choice for this size (as moved by
        the backoff, which checks the measured error here every ``backoff.every`` reductions)."""
        if not self._auto:
            return self.codec
        key = (kind, numel)
        d = self._decided.get(key)
        if d is None:
            d = self._decided[key] = self.tuner.choose(numel, group=group, device=device, kind=kind)
        elif self.backoff is not None:
            n = self._reductions.get(key, 0)
            if self._monitor.due(n) and d.codec in PRECISION[1:]:
                self._monitor.check(self._decided, [key], self.tuner.error_budget, n,
                                    lambda t: C.all_reduce(t, codec="fp32", op="sum", mode="ordered", group=group),
                                    device, lambda k: {"kind": k[0], "numel": k[1]}, "reductions of this size")
                d = self._decided[key]
        self._reductions[key] = self._reductions.get(key, 0) + 1
        if not isinstance(self.stats, Stats):  # someone swapped in a plain CommStats
            self.stats = Stats(**dataclasses.asdict(self.stats))
        self.stats.decisions[key] = d
        return resolve(d.codec, self._block_size)

    def _measured(self, codec: Codec, numel: int, kind: str, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """With a backoff: ``done(handle)`` adds this reduction's error sums to the key's window
        (``||residual after||^2``, ``||x + residual before||^2``, ``||x||^2``); else None."""
        if self.backoff is None or residual is None or codec.lossless:
            return None
        flat = x.reshape(-1).float()
        g = flat.dot(flat).double()
        v = g + 2.0 * flat.dot(residual).double() + residual.dot(residual).double()
        key = (kind, numel)

        def done(handle) -> None:
            def add(_=None) -> None:
                self._monitor.accumulate(key, residual.dot(residual).double(), v, g)

            if handle is None:
                add()
            else:  # asynchronous: once the collective has written the new residual
                handle.get_future().add_done_callback(add)

        return done

    def _send(self, output: torch.Tensor, input: torch.Tensor, pieces: _Pieces, codec: Codec, op: Any,
              group, async_op: bool, world: int, key_numel: int):
        """One reduce-scatter of ``pieces`` with their residuals (``key_numel``: the auto key's size)."""
        residual = None
        if self.error_feedback and (not codec.lossless or self._res.holds(pieces)):
            residual = self._res.get(pieces, world, input.device)
        measured = self._measured(codec, key_numel, "reduce_scatter", input, residual)
        h = _reduce(output, input, codec=codec, op=op, mode=self.mode, group=group, async_op=async_op,
                    residual=residual, chunks=self.chunks, stats=self.stats, first_call=self._first_call)
        if measured is not None:
            measured(h)
        return h

    def _is_kept(self, name: str) -> bool:
        k = self._kept.get(name)
        if k is None:
            p = self._params.get(name)
            # (a parameter flatcomm cannot name, e.g. a size-keyed group, is sent with the codec)
            k = self._kept[name] = p is not None and self._keep_fn is not None and bool(self._keep_fn(name, p))
        return k

    def _warming(self, key: Any) -> bool:
        """Count one reduction of ``key``; True while it is still in the warm-up."""
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        return self._step_base + n < self.start_step

    def _step_entry(self) -> Dict[str, torch.Tensor]:
        if not self.start_step:
            return {}
        steps = self._step_base + max(self._calls.values(), default=0)
        return {f"{self._prefix()}{_STEP_KEY}": torch.tensor(steps, dtype=torch.int64)}

    def _take_step(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The dict without this rank's step entry; restores the warm-up count from it."""
        k = f"{self._prefix()}{_STEP_KEY}"
        if k not in state_dict:
            return state_dict
        v = state_dict[k]
        if not isinstance(v, torch.Tensor) or v.numel() != 1 or v.is_floating_point() or int(v) < 0:
            raise ValueError(f"flatcomm: checkpoint entry {k!r} must be one integer >= 0, got {v!r}")
        self._step_base, self._calls = int(v), {}
        return {kk: vv for kk, vv in state_dict.items() if not kk.endswith("." + _STEP_KEY)}

    @property
    def decisions(self) -> Dict[Tuple[str, int], Any]:
        """codec="auto": ``(kind, numel) -> Decision`` made so far (also in ``stats.decisions``)."""
        return self._decided

    def _decisions_entry(self) -> Dict[str, torch.Tensor]:
        # Only once the backoff has moved a size (what the tuner chose it chooses again; a move is
        # learned from training), so a state_dict() otherwise holds residuals only, as before.
        if not (self._auto and self._decided and (self.adaptations or self._decisions_loaded)):
            return {}
        return {f"{self._prefix()}{_DECISIONS_KEY}": _fadapt.encode(self._decided)}

    def _take_decisions(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The dict without this rank's decisions entry; restores ``auto``'s decisions from it."""
        k = f"{self._prefix()}{_DECISIONS_KEY}"
        if k not in state_dict:
            return state_dict
        saved = _fadapt.decode(state_dict[k], k)
        if self._auto:
            self._decided, self._decisions_loaded = saved, True
            if isinstance(self.stats, Stats):
                self.stats.decisions.update(saved)
        return {kk: vv for kk, vv in state_dict.items() if not kk.endswith("." + _DECISIONS_KEY)}

    def _prefix(self) -> str:
        return f"rank{dist.get_rank()}." if dist.is_initialized() else "rank0."

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's residuals, ``{"rank{r}.{name}": fp32 tensor}`` (plain tensors: DCP, torch.save).

        Not a collective. Empty without error feedback."""
        if not self.error_feedback:
            return {**self._step_entry(), **self._decisions_entry()}
        return {**self._res.state_dict(self._prefix()), **self._step_entry(), **self._decisions_entry()}

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Restore residuals saved by :meth:`state_dict` at the same world size (keys of other
        ranks are ignored, so one merged dict can be given to every rank). Checked: float32,
        finite, sizes, every known parameter present, no rank beyond this world size; a State
        without error feedback refuses nonzero residuals (they would be dropped)."""
        self._check_ranks(state_dict)
        state_dict = self._take_decisions(self._take_step(state_dict))
        if self.error_feedback:
            self._res.load_state_dict(state_dict, self._prefix())
        else:
            self._refuse_residuals(state_dict)

    def _check_ranks(self, state_dict) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"flatcomm: a flatcomm FSDP state dict is a dict, got {type(state_dict).__name__}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        ranks = {int(m.group(1)) for m in map(_RANK_KEY.match, state_dict) if m}
        if ranks and max(ranks) >= world:
            raise ValueError(f"flatcomm: the checkpoint holds residuals of rank {max(ranks)} and this run has "
                             f"{world} ranks: FSDP residuals load only at the world size they were saved at "
                             f"(another world size changes every shard). Leave flatcomm's state out of the "
                             f"load to restart error feedback from zero")

    def _refuse_residuals(self, state_dict) -> None:
        p = self._prefix()
        held = [k for k, v in state_dict.items() if k.startswith(p) and isinstance(v, torch.Tensor) and v.any()]
        if held:
            raise ValueError(f"flatcomm: the checkpoint holds residuals (e.g. {held[0]!r}) but this backend has no "
                             f"error feedback (codec={self.codec.name!r}): they would be dropped. Use the "
                             f"saved codec, or leave flatcomm's state out of the load")

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """This rank's residual of one parameter / unit (flat, padded numel), or None."""
        v = self._res.view(name)
        return None if v is None else v.reshape(-1)


# ---- FSDP2 ---------------------------------------------------------------------------------------


class ReduceScatter(_Backend):
    """FSDP2 custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) running flatcomm.

    codec: ``fp32`` (lossless; fixed source-rank order: the same bits every run), ``bf16``, ``fp16``,
        ``int8``, ``int4``, ``sign``, ``topk`` or a :class:`flatcomm.Codec`.
        ``auto``: a :class:`flatcomm.autotune.Tuner` (``tuner=``, default error budget int8) picks
        per reduce-scatter size, the same on every rank; ``stats.decisions`` holds what and why.
    error_feedback: keep per-parameter residuals for lossy codecs (see the module docstring). With
        ``auto``, a parameter group reduced in fp32 still sends its parameters' residuals (added
        once by the fp32 encode, which zeroes them).
    mode: ``ordered`` or ``exact`` (fp32 only: order-independent integer sums).
    chunks, block_size, ratio: passed to the collective / codec.
    start_step: the first ``start_step`` reductions of each parameter group are lossless fp32 (a
        warm-up, as in :class:`flatcomm.ddp.State`); ``state_dict()`` carries the count.
    keep_fp32: parameters always sent in lossless fp32 (no residual), as in
        :class:`flatcomm.ddp.State`: a predicate ``f(name, param)``, fnmatch name patterns, or
        ``"small"``. A group that mixes both is sent as two reduce-scatters (:mod:`flatcomm.fsdp_adapt`).
        Needs parameter names: :func:`apply` (or :meth:`for_module`) gives them.
    backoff: ``codec="auto"`` only: a :class:`flatcomm.ddp_adapt.Backoff` (default ``Backoff()``;
        ``False``: off) that moves a collective size to a more precise codec when the error measured
        in training exceeds the budget, checked every ``every`` reductions of that size;
        ``adaptations`` (``kind``, ``numel``, ``step``: reductions of that size so far, from, to,
        numbers, why) and ``decisions`` say when and why; after a move ``state_dict()`` keeps the
        decisions (``"rank{r}.__decisions__"``).
    """

    def __init__(self, codec: Any = "fp32", *, error_feedback: bool = True, mode: str = "ordered",
                 chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, tuner=None, start_step: int = 0, keep_fp32: Any = None,
                 backoff: Any = None):
        super().__init__(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                         block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                         keep_fp32=keep_fp32, backoff=backoff)
        self._names: Dict[int, str] = {}  # id(sharded parameter) -> name (from for_module's model)
        # How each call found its parameters (see _pieces): "module", "fsdp_frame" or "size".
        self.layout_sources: Dict[str, int] = {"module": 0, "fsdp_frame": 0, "size": 0}

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 op: Any = dist.ReduceOp.AVG, async_op: bool = False):
        return self._reduce_scatter(output_tensor, input_tensor, group, op, async_op, None)

    def for_module(self, module: torch.nn.Module, model: Optional[torch.nn.Module] = None) -> "ModuleReduceScatter":
        """This backend bound to one ``FSDPModule``, for ``module.set_custom_reduce_scatter``:
        it knows the module's parameters (names from ``model``, default ``module``), so residuals
        are keyed without FSDP's internals. :func:`apply` does this for every module."""
        named = list((model if model is not None else module).named_parameters())
        names = {id(p): n for n, p in named}
        self._names.update(names)
        self._params.update(named)
        layout = _module_layout(module, names)
        for name, numel, world in layout:
            self._res.templates[name] = world * numel
        worlds = {w for _, _, w in layout}
        whole = len(layout) == len(_managed_params(module)) and len(worlds) == 1
        return ModuleReduceScatter(self, [(n, c) for n, c, _ in layout] if whole else None)

    def _reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: Any,
                        async_op: bool, layout: Optional[_Pieces]):
        numel = input_tensor.numel()
        codec = self._codec_for(numel, group, input_tensor.device, "reduce_scatter")
        world = dist.get_world_size(group)
        pieces = self._pieces(layout, numel, world)
        if self._warming(tuple(n for n, _ in pieces)):
            codec = resolve("fp32")  # a residual loaded from a checkpoint is sent (flushed) once
        rest, kept = _fadapt.split(pieces, self._is_kept) if self._keep_fn is not None else (pieces, [])
        if not kept or not rest:
            return self._send(output_tensor, input_tensor, pieces, codec if rest else resolve("fp32"),
                              op, group, async_op, world, numel)
        # keep_fp32: the codec's parameters and the kept ones in two reduce-scatters (fsdp_adapt)
        for side, side_codec in ((rest, codec), (kept, resolve("fp32"))):
            part = torch.empty(sum(c for _, c in side), dtype=output_tensor.dtype, device=output_tensor.device)
            self._send(part, _fadapt.take(input_tensor, world, pieces, side), side, side_codec, op, group,
                       False, world, numel)
            _fadapt.put(output_tensor, part, pieces, side)
        return _Done(output_tensor) if async_op else None

    def _pieces(self, layout: Optional[_Pieces], numel: int, world: int) -> _Pieces:
        """The parameters in this call's input: the bound module's (every parameter got a
        gradient: the common case, public API), else FSDP's own list (a private frame, see
        :mod:`flatcomm._fsdp_private`), else one piece keyed by the size."""
        if layout is not None and sum(c for _, c in layout) * world == numel:
            self.layout_sources["module"] += 1
            return layout
        fps = _private.reduce_call_params()
        if fps is not None:
            pieces = []
            for fp in fps:
                param, fqn, c = _private.param_piece(fp)
                name = self._names.get(id(param)) or fqn
                if name is None or c is None:
                    break
                if param is not None:
                    self._params.setdefault(name, param)
                pieces.append((name, c))
            else:
                if sum(c for _, c in pieces) * world == numel:
                    self.layout_sources["fsdp_frame"] += 1
                    return pieces
        self.layout_sources["size"] += 1
        return [(f"flat{numel}", numel // world)]


class ModuleReduceScatter:
    """A :class:`ReduceScatter` as set on one ``FSDPModule`` (:meth:`ReduceScatter.for_module`):
    the backend plus the module's parameter layout (None: unknown, FSDP's list is used)."""

    def __init__(self, backend: ReduceScatter, layout: Optional[_Pieces]):
        self.backend = backend
        self.layout = layout

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.backend.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 op: Any = dist.ReduceOp.AVG, async_op: bool = False):
        return self.backend._reduce_scatter(output_tensor, input_tensor, group, op, async_op, self.layout)


def _shard_layout(p: torch.Tensor) -> Optional[Tuple[int, int, bool]]:
    """(values per rank, ranks it is sharded over, replicated too) of a parameter ``fully_shard``
    made, from its DTensor placements: FSDP pads the sharded dim to a multiple of the ranks, so
    rank r holds ``ceil(size / ranks)`` slices of it. None when not sharded over exactly one mesh
    dimension (e.g. also tensor-parallel): FSDP's own list is used then."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return None
    shards = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shards) != 1:
        return None
    i, pl = shards[0]
    world = p.device_mesh.size(i)
    shape = list(p.shape)
    rows = -(-shape[pl.dim] // world)
    return rows * math.prod(shape[:pl.dim] + shape[pl.dim + 1:]), world, any(
        isinstance(x, Replicate) for x in p.placements)


def _managed_params(module: Any) -> List[torch.nn.Parameter]:  # an nn.Module that is an FSDPModule
    """The parameters ``fully_shard(module)`` manages, in FSDP's order (its reduce-scatter input
    layout): submodules in post-order (children first), nested FSDPModules left out, each once."""
    from torch.distributed.fsdp import FSDPModule

    seen_modules: set = set()
    seen: set = set()
    out: List[torch.nn.Parameter] = []
    order: List[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        seen_modules.add(m)
        for c in m.children():
            if c not in seen_modules and not isinstance(c, FSDPModule):
                visit(c)
        order.append(m)

    visit(module)
    for m in order:
        for _, p in m.named_parameters(recurse=False):
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def _module_layout(module: Any, names: Dict[int, str]) -> List[Tuple[str, int, int]]:
    """(name, values per rank, ranks) of each managed parameter whose layout is public."""
    out = []
    for p in _managed_params(module):
        lay = _shard_layout(p)
        if lay is not None and id(p) in names:
            out.append((names[id(p)], lay[0], lay[1]))
    return out


def apply(model: torch.nn.Module, codec: Any = "fp32", *, error_feedback: bool = True,
          mode: str = "ordered", chunks: Optional[int] = None, block_size: Optional[int] = None,
          ratio: Optional[float] = None, tuner=None, start_step: int = 0, keep_fp32: Any = None,
          backoff: Any = None) -> ReduceScatter:
    """Set one flatcomm :class:`ReduceScatter` on every ``FSDPModule`` in ``model`` and return it.

    One instance serves all modules (residuals are keyed by parameter name, not by module), so
    ``.stats`` and ``.state_dict()`` cover the whole model. ``model`` should be the root that
    FSDP's parameter names are relative to. ``codec`` defaults to lossless fp32 (FSDP's own
    reduce, same bits every run); ``"int8"`` is what :func:`flatcomm.ddp.register` defaults to.
    Each module gets ``rs.for_module(module, model)`` (see :class:`ModuleReduceScatter`).
    """
    from torch.distributed.fsdp import FSDPModule

    rs = ReduceScatter(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                       block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                       keep_fp32=keep_fp32, backoff=backoff)
    found = False
    for m in model.modules():
        if isinstance(m, FSDPModule):
            found = True
            # FSDP's ReduceScatter ABC lives in a private module; FSDP only calls allocate() and __call__()
            m.set_custom_reduce_scatter(rs.for_module(m, model))  # type: ignore[arg-type]
    if not found:
        raise ValueError("flatcomm.fsdp.apply: no FSDPModule in the model (call fully_shard first)")
    return rs


# ---- FSDP1 ---------------------------------------------------------------------------------------


class FSDP1State(_Backend):
    """State for ``FullyShardedDataParallel.register_comm_hook(state, fsdp1_hook)``.

    The hook averages over the FSDP process group (sharded strategies: reduce-scatter; NO_SHARD:
    all-reduce with client + server residuals). ``model`` (the FSDP root) names the units in the
    state dict; without it units are named by the order they first reduce (deterministic for a
    given model). ``group`` overrides the group (default: the unit's FSDP process group).
    ``codec="auto"``, ``tuner=`` and ``backoff=``: as for :class:`ReduceScatter` (all-reduce sizes
    for NO_SHARD). ``keep_fp32=`` (needs ``model``): as for :class:`ReduceScatter`, per parameter
    inside each unit (the predicate's ``param`` is a meta tensor of the parameter's original shape:
    FSDP1 flattens parameters); see :mod:`flatcomm.fsdp_adapt`.
    """

    def __init__(self, codec: Any = "fp32", *, error_feedback: bool = True, mode: str = "ordered",
                 chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, model: Optional[torch.nn.Module] = None, group=None,
                 tuner=None, start_step: int = 0, backoff: Any = None, keep_fp32: Any = None):
        if keep_fp32 is not None and model is None:
            raise ValueError("flatcomm: FSDP1State(keep_fp32=...) needs model= (the FSDP root) to name "
                             "the parameters inside each unit")
        super().__init__(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                         block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                         backoff=backoff, keep_fp32=keep_fp32)
        self.group = group
        self._unit_names: Dict[int, str] = {}
        self._ef: Dict[str, C.ErrorFeedback] = {}  # NO_SHARD residuals
        self._flat_of: Dict[str, Any] = {}  # unit name -> its flat parameter (keep_fp32)
        self._masks: Dict[Tuple[str, int], Optional[torch.Tensor]] = {}  # keep_fp32 per unit, or None
        self._rows: Dict[Tuple[str, int], Any] = {}  # keep_fp32: fsdp_adapt.rows per sharded unit
        if model is not None:
            named = list(model.named_parameters())
            self._param_names = {id(p): n for n, p in named}
            self._params.update(named)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            for name, m in model.named_modules():
                flat = _private.fsdp1_flat_param(m) if isinstance(m, FSDP) else None
                if flat is not None:
                    self._unit_names[id(flat)] = name or "<root>"

    def _unit(self, numel: int) -> Tuple[str, Any]:
        """(unit name, FSDP's process group) of the hook call in progress (FSDP1 passes only the
        gradient: read from its frame, see :mod:`flatcomm._fsdp_private`), else a size key."""
        unit = _private.fsdp1_unit()
        if unit is None:
            return f"flat{numel}", None
        key = id(unit[0])
        if key not in self._unit_names:
            self._unit_names[key] = f"unit{len(self._unit_names)}"
        self._flat_of[self._unit_names[key]] = unit[0]
        return self._unit_names[key], unit[1]

    def _kept_mask(self, name: str, numel: int) -> Optional[torch.Tensor]:
        """keep_fp32: which values of the unit's (padded) flat gradient belong to kept parameters
        (None: none do, or the layout is unknown); computed once per unit."""
        if self._keep_fn is None:
            return None
        if (name, numel) not in self._masks:
            ranges = _private.fsdp1_param_ranges(self._flat_of[name]) if name in self._flat_of else None
            # names as the model lists them (FSDP1 wraps modules in "_fsdp_wrapped_module")
            prefix = "" if name == "<root>" else (name + ".").replace(_FSDP1_WRAPPER, "")
            mask = torch.zeros(numel, dtype=torch.bool)
            for param, fqn, off, n, shape in ranges or []:
                pname = self._param_names.get(id(param)) if param is not None else None
                pname = pname or prefix + fqn.replace(_FSDP1_WRAPPER, "")
                # FSDP1 flattens parameters (even use_orig_params ones are 1-D shard views): the
                # predicate gets a meta tensor of the original shape
                if self._keep_fn(pname, torch.empty(shape, device="meta")):
                    mask[off:off + n] = True
            self._masks[(name, numel)] = mask if bool(mask.any()) else None
        return self._masks[(name, numel)]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        sd = super().state_dict()
        if self.error_feedback:
            p = self._prefix()
            for name, ef in self._ef.items():
                sd[f"{p}{name}.client"] = ef.client.clone()
                sd[f"{p}{name}.server"] = ef.server.clone()
        return sd

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self._check_ranks(state_dict)
        state_dict = self._take_decisions(self._take_step(state_dict))
        if not self.error_feedback:
            self._refuse_residuals(state_dict)
            return
        p = self._prefix()
        ef = {}
        rest = {}
        for k, v in state_dict.items():
            if k.startswith(p) and k.endswith(".client") and k[:-7] + ".server" in state_dict:
                name = k[len(p):-7]
                c = check.residual(name, v, (getattr(v, "numel", lambda: 0)(),), "client residual")
                sv = state_dict[k[:-7] + ".server"]
                ef[name] = C.ErrorFeedback(c.clone(), check.residual(name, sv, c.shape, "server residual").clone())
            elif not (k.startswith(p) and k.endswith(".server")):
                rest[k] = v
        self._ef = ef
        self._res.load_state_dict(rest, p)


def fsdp1_hook(state: FSDP1State, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """FSDP1 comm hook: ``hook(state, padded_unsharded_grad, new_sharded_grad)`` for sharded
    strategies (reduce-scatter into ``output``), ``hook(state, grad)`` for NO_SHARD (in place)."""
    name, fsdp_group = state._unit(grad.numel())
    group = state.group if state.group is not None else fsdp_group
    world = dist.get_world_size(group)
    warming = state._warming(name)
    kind = "all_reduce" if output is None else "reduce_scatter"
    codec = state._codec_for(grad.numel(), group, grad.device, kind)
    codec = resolve("fp32") if warming else codec
    mask = state._kept_mask(name, grad.numel())
    if output is None:
        _fsdp1_all_reduce(state, grad, name, codec, group, world, mask)
    elif mask is None:
        state._send(output, grad, [(name, grad.numel() // world)], codec, "avg", group, False, world, grad.numel())
    else:
        _fsdp1_reduce_scatter_kept(state, output, grad, name, codec, group, world, mask)
    return None


def _fsdp1_all_reduce(state: FSDP1State, grad: torch.Tensor, name: str, codec: Codec, group, world: int,
                      mask: Optional[torch.Tensor]) -> None:
    """NO_SHARD: the whole gradient averaged in place, with client + server residuals per unit;
    with keep_fp32, the codec's values and the kept ones as two all-reduces."""
    ef = None
    if state.error_feedback and (not codec.lossless or name in state._ef or mask is not None):
        ef = state._ef.get(name)
        if ef is not None and ef.client.numel() != grad.numel():
            raise ValueError(f"flatcomm: the residual of FSDP unit {name!r} has {ef.client.numel()} values "
                             f"but its gradient {grad.numel()} (a checkpoint of another model or world size)")
        if ef is None:
            ef = state._ef[name] = C.ErrorFeedback.zeros(grad.numel(), grad.device)
        elif ef.client.device != grad.device:  # loaded on the CPU
            ef = state._ef[name] = C.ErrorFeedback(ef.client.to(grad.device), ef.server.to(grad.device))
        if codec.lossless or mask is not None:
            # fp32 (auto's choice) sends client + server once; a split changes the shard layout the
            # server residual is valid for: either way it is folded into the client one first
            ef.client.add_(ef.server, alpha=float(world))
            ef.server.zero_()
    flat = grad if grad.is_contiguous() else grad.contiguous()
    if mask is None:
        _fsdp1_send_all(state, flat, ef, codec, group)
    else:
        mask = mask.to(flat.device)
        for sel, c in ((~mask, codec), (mask, resolve("fp32"))):
            part = flat.view(-1)[sel]
            res = C.ErrorFeedback(ef.client[sel], ef.server[sel]) if ef is not None else None
            _fsdp1_send_all(state, part, res, c, group)
            flat.view(-1)[sel] = part
            if ef is not None and res is not None:
                ef.client[sel] = res.client
                ef.server[sel] = res.server
    if flat is not grad:
        grad.copy_(flat)


def _fsdp1_send_all(state: FSDP1State, flat: torch.Tensor, ef: Optional[C.ErrorFeedback], codec: Codec,
                    group) -> None:
    measured = state._measured(codec, flat.numel(), "all_reduce", flat, ef.client if ef is not None else None)
    C.all_reduce(flat, codec=_wire_codec(codec, flat.dtype), op="avg", mode=state.mode,
                 group=group, residual=ef, chunks=state.chunks, stats=state.stats,
                 validate=state._first_call("ar", _group_sig(group), flat.numel(), flat.dtype, codec.name))
    if measured is not None:
        measured(None)


def _fsdp1_reduce_scatter_kept(state: FSDP1State, output: torch.Tensor, grad: torch.Tensor, name: str,
                               codec: Codec, group, world: int, mask: torch.Tensor) -> None:
    """A sharded unit holding keep_fp32 parameters: each rank's chunk splits into its codec values
    and its kept ones (counts differ per rank: rows padded with zeros, :func:`flatcomm.fsdp_adapt.rows`),
    sent as two reduce-scatters; the unit's residual keeps its full layout (kept values: zero)."""
    if (name, world) not in state._rows:
        state._rows[(name, world)] = _fadapt.rows(mask, world)
    ik, ir, kept_counts = state._rows[(name, world)]
    numel, shard = grad.numel(), grad.numel() // world
    flat = grad.reshape(-1)
    res = None
    if state.error_feedback:
        res = state._res.get([(name, shard)], world, grad.device)
    me = dist.get_rank(group)
    mine = mask.view(world, shard)[me].to(output.device)
    for idx, c, kept in ((ir, codec, False), (ik, resolve("fp32"), True)):
        x = _fadapt.gather(flat, idx)
        r = _fadapt.gather(res, idx) if res is not None else None
        out = torch.empty(idx.shape[1], dtype=output.dtype, device=output.device)
        measured = state._measured(c, numel, "reduce_scatter", x, r)
        _reduce(out, x, codec=c, op="avg", mode=state.mode, group=group, async_op=False, residual=r,
                chunks=state.chunks, stats=state.stats, first_call=state._first_call)
        if measured is not None:
            measured(None)
        if res is not None and r is not None:
            _fadapt.scatter(res, idx, r)
        output[mine if kept else ~mine] = out[:kept_counts[me] if kept else shard - kept_counts[me]]
