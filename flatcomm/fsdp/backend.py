"""The machinery flatcomm's FSDP backends share (FSDP2: :mod:`flatcomm.fsdp`, FSDP1:
:mod:`flatcomm.fsdp.fsdp1`): :class:`Stats`, the residual storage keyed by parameter name
(:mod:`flatcomm.fsdp.residuals`), the reduce call with its op scaling, and
``Backend``: codec choice (``auto``), warm-up, ``keep_fp32``, backoff and ``state_dict``. The
semantics are described in :mod:`flatcomm.fsdp`.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._training import options as _options
from .. import collectives as C
from .._training import adapt as _adapt
from . import adapt as _fadapt
from ..autotune import PRECISION
from ..comm.args import premultiplied, reduce_op
from .._snapshot import Snapshot
from ..comm.labels import label
from ..ops.codecs import Codec, resolve
from .residuals import Pieces, Residuals

__all__ = ["Backend", "Done", "Pieces", "Stats", "group_sig", "reduce", "wire_codec"]

_RANK_KEY = re.compile(r"rank(\d+)\.")
_STEP_KEY = "__step__"  # per-rank warm-up step count in state_dict() (with start_step only)
_DECISIONS_KEY = "__decisions__"  # per-rank codec="auto" decisions in state_dict() (fsdp_adapt.encode)


@dataclasses.dataclass
class Stats(C.CommStats):
    """:class:`~flatcomm.collectives.CommStats` plus, with ``codec="auto"``, what was chosen per
    collective size: ``decisions[(kind, numel)]`` is a :class:`flatcomm.autotune.Decision`
    (codec, chunks, reason, predicted seconds per codec)."""

    decisions: Dict[Tuple[str, int], Any] = dataclasses.field(default_factory=dict)
    # Weight all-gathers, counted with apply(weights=...) only (flatcomm.fsdp.weights; FSDP's own
    # gather is not seen): the bytes this rank sent in forward and in backward, also in wire_bytes
    # and calls.
    weights_forward_bytes: int = 0
    weights_backward_bytes: int = 0

    @property
    def bytes_by_kind(self) -> Dict[str, int]:
        """``wire_bytes`` split by collective: weight all-gathers in forward / in backward, and
        the gradient reduce-scatters."""
        w = self.weights_forward_bytes + self.weights_backward_bytes
        return {"weights_forward": self.weights_forward_bytes, "weights_backward": self.weights_backward_bytes,
                "gradients": self.wire_bytes - w}

    def add(self, other: C.CommStats) -> None:
        for f in dataclasses.fields(C.CommStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for k in ("weights_forward_bytes", "weights_backward_bytes"):
            setattr(self, k, getattr(self, k) + getattr(other, k, 0))
        self.decisions.update(getattr(other, "decisions", {}))


def group_sig(group) -> Tuple[int, ...]:
    """The same value on every rank for the same group (unlike ``id(group)``)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def wire_codec(codec: Codec, dtype: torch.dtype) -> Codec:
    """The lossless codec sends bf16/fp16 inputs in their own dtype (exact, half the bytes)."""
    if codec.lossless and dtype == torch.bfloat16:
        return resolve("bf16")
    if codec.lossless and dtype == torch.float16:
        return resolve("fp16")
    return codec


class Done:
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


def reduce(output: torch.Tensor, input: torch.Tensor, *, codec: Codec, op: Any, mode: str,
            group, async_op: bool, residual: Optional[torch.Tensor], chunks: Optional[int],
            stats: C.CommStats, first_call: Callable[..., bool]):
    how = reduce_op(op)
    if how is None:
        raise ValueError(f"flatcomm: unsupported reduce op {op!r} (AVG, SUM or PREMUL_SUM)")
    fop, factor = how
    if factor is not None:  # PREMUL_SUM: NCCL's rule, the input times the factor in its dtype, then the sum
        input = premultiplied(input, factor)
    wc = wire_codec(codec, input.dtype)
    validate = first_call("rs", group_sig(group), input.numel(), input.dtype, output.dtype, wc.name, fop)
    return C.reduce_scatter(output, input, op=fop, async_op=async_op, codec=wc, mode=mode, group=group,
                            residual=residual, chunks=chunks, stats=stats, validate=validate)


class Backend:
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
        self.counters = Stats()  # what the collectives add to (read: .stats)
        self._res = Residuals()
        self._validated: set = set()

    @property
    def stats(self) -> Snapshot:
        """This rank's reductions (and weight all-gathers) so far: a read-only
        :class:`flatcomm.stats.Snapshot` (``source="fsdp"``) with the counters of
        :class:`~flatcomm.collectives.CommStats` and, as attributes and keys, ``decisions``
        (``codec="auto"``: ``(kind, numel)`` -> Decision), ``weights_forward_bytes``,
        ``weights_backward_bytes`` and ``bytes_by_kind``."""
        c = self.counters
        fwd, bwd = getattr(c, "weights_forward_bytes", 0), getattr(c, "weights_backward_bytes", 0)
        return Snapshot.of("fsdp", c, {"decisions": dict(getattr(c, "decisions", {})), "weights_forward_bytes": fwd,
                                       "weights_backward_bytes": bwd,
                                       "bytes_by_kind": {"weights_forward": fwd, "weights_backward": bwd,
                                                         "gradients": c.wire_bytes - fwd - bwd}})

    @stats.setter
    def stats(self, counters: C.CommStats) -> None:
        warnings.warn("flatcomm.fsdp: .stats is a read-only snapshot now; to start counting over, assign "
                      ".counters (a flatcomm.fsdp.Stats) instead", DeprecationWarning, stacklevel=2)
        self.counters = counters if isinstance(counters, Stats) else Stats(**dataclasses.asdict(counters))

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
        if not isinstance(self.counters, Stats):  # someone swapped in a plain CommStats
            self.counters = Stats(**dataclasses.asdict(self.counters))
        self.counters.decisions[key] = d
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

    def _send(self, output: torch.Tensor, input: torch.Tensor, pieces: Pieces, codec: Codec, op: Any,
              group, *, async_op: bool, world: int, key_numel: int):
        """One reduce-scatter of ``pieces`` with their residuals (``key_numel``: the auto key's size)."""
        residual = None
        if self.error_feedback and (not codec.lossless or self._res.holds(pieces)):
            residual = self._res.get(pieces, world, input.device)
        measured = self._measured(codec, key_numel, "reduce_scatter", input, residual)
        with label("flatcomm.fsdp.reduce_scatter"):
            h = reduce(output, input, codec=codec, op=op, mode=self.mode, group=group, async_op=async_op,
                       residual=residual, chunks=self.chunks, stats=self.counters, first_call=self._first_call)
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

    def _take_step(self, state_dict: Dict[str, torch.Tensor]) -> Tuple[Callable[[], None], Dict[str, torch.Tensor]]:
        """(restore the warm-up count from this rank's step entry, the dict without step entries)."""
        k = f"{self._prefix()}{_STEP_KEY}"
        if k not in state_dict:
            return (lambda: None), state_dict
        v = state_dict[k]
        if not isinstance(v, torch.Tensor) or v.numel() != 1 or v.is_floating_point() or int(v) < 0:
            raise ValueError(f"flatcomm: checkpoint entry {k!r} must be one integer >= 0, got {v!r}")
        steps = int(v)

        def apply() -> None:
            self._step_base, self._calls = steps, {}
        return apply, {kk: vv for kk, vv in state_dict.items() if not kk.endswith("." + _STEP_KEY)}

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

    def _take_decisions(self, state_dict: Dict[str, torch.Tensor]) -> Tuple[Callable[[], None], Dict[str, torch.Tensor]]:
        """(restore ``auto``'s decisions from this rank's entry, the dict without decisions entries)."""
        k = f"{self._prefix()}{_DECISIONS_KEY}"
        if k not in state_dict:
            return (lambda: None), state_dict
        saved = _fadapt.decode(state_dict[k], k)

        def apply() -> None:
            if self._auto:
                self._decided, self._decisions_loaded = saved, True
                if isinstance(self.counters, Stats):
                    self.counters.decisions.update(saved)
        return apply, {kk: vv for kk, vv in state_dict.items() if not kk.endswith("." + _DECISIONS_KEY)}

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
        # The step and decisions entries are read first and applied only once the residuals
        # loaded (their load checks everything before it changes them): a failed load changes nothing.
        apply_step, rest = self._take_step(state_dict)
        apply_decisions, rest = self._take_decisions(rest)
        if self.error_feedback:
            self._res.load_state_dict(rest, self._prefix())
        else:
            self._refuse_residuals(rest)
        apply_step()
        apply_decisions()

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
