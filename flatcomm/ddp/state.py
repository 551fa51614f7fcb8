"""The DDP comm hook's state (:class:`State`), the hook itself and :func:`register`
(see :mod:`flatcomm.ddp`)."""
from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._training import options as _options
from .. import collectives as C
from ..comm.labels import label
from . import accordion as _accordion
from .._training import adapt as _adapt
from . import checkpoint as _ckpt
from . import traffic
from . import stats as _stats
from .stats import StatsDict
from .._training.checks import register_ddp_hook
from .._snapshot import COUNTERS
from ..ops.codecs import Codec
from .buckets import Buckets
from .residuals import Residuals

__all__ = ["CODEC_DEFAULTS", "State", "StatsDict", "hook", "register"]

# What register(ddp, "sign") uses unless block_size= / start_step= say otherwise. Sign sends every
# value of a block at the block's mean magnitude, which inflates Adam's second moment and, early in
# training, the residual; smaller blocks and lossless first steps keep both close (measured by
# tools/bench/adam_probe.py and convergence.py: docs/benchmarks.md, "Why sign lost under Adam").
CODEC_DEFAULTS = {"sign": {"block_size": 64, "start_step": 20}}


class State:
    """State of the flatcomm DDP comm hook (see the module docstring).

    codec: ``fp32`` (lossless, ordered sum), ``bf16``/``fp16``, ``int8``, ``int4``, ``sign``, ``topk``
    or a :class:`flatcomm.Codec`; ``block_size`` / ``ratio`` override its parameters.
    error_feedback: keep client/server residuals for lossy codecs.
    mode: ``ordered`` or ``exact`` (fp32 only, rank-count independent bits); None (default): not
        asked, i.e. ``ordered``, and ``codec="auto"`` may use the backend's all-reduce (see register).
    group: process group for flatcomm's traffic (default: a dedicated copy of DDP's group).
    chunks: pipeline chunks per all-reduce (default: automatic).
    model: the DDP model (or its module), for parameter names in checkpoints; :func:`register` sets it
        (``ddp.register_comm_hook(State(...), hook)`` does not: then :meth:`attach` it, or
        :meth:`state_dict` raises once the State holds residuals it could not name).
    grad_scaler: a GradScaler whose scale changes rescale the residuals.
    track_norms: compute the residual/gradient norms for :attr:`stats` (two dot products over the
        bucket before sending and one norm of each residual after).
    history: how many steps :attr:`stats` keeps.
    topology: a :class:`flatcomm.Topology`, ``"flat"``, or None (default: from torchrun's
        ``LOCAL_WORLD_SIZE``, flat when unset; built at the first hook call). Hierarchical: see
        :mod:`flatcomm.ddp.tiers` for where the residuals live.
    codec="auto": a :class:`flatcomm.autotune.Tuner` (``tuner=``, default error budget int8) picks the
        codec of each bucket at its first hook call; ``decisions`` / ``stats["decisions"]`` say what
        and why. With a hierarchical topology the inter-node codec (or the backend's all-reduce) is
        chosen by the two-level cost model (:mod:`flatcomm.autotune.tiers`; the node tier stays
        fp32). A parameter that moves (bucket rebuild) from a lossy bucket into one where fp32 was
        chosen brings its residual along: it is added once to that bucket's lossless all-reduce.
    start_step: steps (hook rounds, counted like ``state_dict()["step"]``) sent in lossless fp32 before
        the codec starts (like PowerSGD's ``start_powerSGD_iter``): early gradients are large and
        change fast, and an adaptive optimizer's variance estimate forms from them. Residuals start
        at zero when the codec does; a checkpoint's step count carries the warm-up across restarts.
        Default 0, except for ``codec="sign"`` given by name: see ``CODEC_DEFAULTS`` (block_size too).
    keep_fp32: parameters always sent in lossless fp32 (no residual): a predicate ``f(name, param)``,
        a list of fnmatch name patterns, or ``"small"`` (biases, norms, embeddings; see
        :mod:`flatcomm._training.adapt`). A DDP bucket that mixes both is sent as two all-reduces, one
        per kind, each over a copy of its parameters' ranges (the kept part first-class fp32).
    backoff: ``codec="auto"`` only: a :class:`flatcomm.ddp.Backoff` (default ``Backoff()``,
        every 50 steps; ``False`` turns it off) that moves a bucket to a more precise codec when the
        error measured in training exceeds the budget; ``adaptations`` / ``stats`` say when and why.
    accordion: adaptive switching (:mod:`flatcomm.ddp.accordion`): a precise codec (``"int8"``, or an
        :class:`~flatcomm.ddp.accordion.Accordion`; ``True``: its defaults) in intervals where the
        gradient norm changes fast, this State's codec otherwise. Not with ``codec="auto"``.
    """

    # The declared shape (grouped like torch's PowerSGDState): every attribute a State holds.
    # Options: what the caller asked for, resolved once by flatcomm._training.options.
    _OPTIONS = ("codec", "auto", "backend_allowed", "block_size", "mode", "error_feedback", "start_step",
                "backoff", "accordion", "tuner", "keep_fn", "chunks", "topology_arg", "model", "grad_scaler",
                "track_norms", "history")
    # Where the traffic goes: flatcomm's private group and the topology (both set at the first call).
    _GROUPS = ("group", "topology")
    # Per-bucket state (flatcomm.ddp.buckets): residuals, auto's decisions, the layout a load replays.
    _BUCKETS = ("buckets",)
    # The step: hook rounds so far, whether the next bucket starts one, the GradScaler scale seen.
    _STEP = ("step", "_new_step", "scale_seen")
    # Statistics: the per-step records, auto's measured errors and moves.
    _STATS = ("recorder", "monitor", "adaptations")
    # Internal: parameter names, the all-reduces in flight and their condition.
    _INTERNAL = ("_names", "_inflight", "_cond")
    __slots__ = _OPTIONS + _GROUPS + _BUCKETS + _STEP + _STATS + _INTERNAL

    def __init__(self, codec: Any = "int8", *, error_feedback: bool = True, mode: Optional[str] = None,
                 group=None, chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, model: Optional[torch.nn.Module] = None,
                 grad_scaler=None, track_norms: bool = True, history: int = 100, tuner=None,
                 topology=None, start_step: Optional[int] = None, keep_fp32: Any = None,
                 backoff: Any = None, accordion: Any = None):
        o = _options.resolve(codec, error_feedback=error_feedback, mode=mode, block_size=block_size,
                             ratio=ratio, tuner=tuner, start_step=start_step, keep_fp32=keep_fp32,
                             backoff=backoff, defaults=CODEC_DEFAULTS)
        # -- options. codec="auto": flatcomm.autotune picks a codec per bucket key at its first hook
        # call (the same on every rank); decisions[key] holds the Decision. mode None: the caller
        # did not ask for determinism (see register()): auto may use the backend's all-reduce.
        self.codec: Codec = o.codec
        self.auto, self.backend_allowed, self.block_size = o.auto, o.open, o.block_size
        self.mode, self.error_feedback, self.start_step = o.mode, o.error_feedback, o.start_step
        self.backoff = o.backoff
        self.accordion = _accordion.policy(accordion)
        if self.accordion is not None and o.auto:
            raise ValueError("flatcomm: accordion= picks between two fixed codecs; it does not combine with codec='auto'")
        self.tuner = o.tuner if o.auto else None
        self.keep_fn = o.keep_fn
        self.chunks = chunks
        self.topology_arg = topology
        self.model = model
        self.grad_scaler = grad_scaler
        self.track_norms = track_norms
        self.history = history
        # -- groups: resolved at the first hook call (creating groups is collective)
        self.group = group
        self.topology = None
        # -- per-bucket state: error feedback, decisions, replay, layouts (read through the properties)
        self.buckets = Buckets(track_norms)
        # -- the step
        self.step = 0
        self._new_step = True
        self.scale_seen: Optional[float] = None
        # -- statistics
        self.recorder = _stats.Recorder(history, track_norms)
        self.monitor = _adapt.Monitor(self.backoff or _adapt.Backoff(every=0))
        self.adaptations: List[dict] = self.monitor.adaptations  # the moves, with their numbers
        # -- internal
        self._names: Optional[Dict[int, str]] = None
        self._inflight = 0
        self._cond = threading.Condition()

    # ---- the per-bucket state, read-only (what checkpoints and tests look at) -----------------------

    @property
    def residuals(self) -> Residuals:
        """The error-feedback residuals, one flat buffer per bucket (:mod:`flatcomm.ddp.residuals`)."""
        return self.buckets.residuals

    @property
    def decisions(self) -> Dict[Tuple[int, ...], Any]:
        """``codec="auto"``: per bucket key (its parameters' ids), the tuner's Decision."""
        return self.buckets.decisions

    @property
    def replay(self) -> Optional[List[Tuple[int, ...]]]:
        """After a same-world-size load, until the next step ends: the saved bucket keys it replays."""
        return self.buckets.replay

    @property
    def replay_tiered(self) -> bool:
        """Whether the replayed buffers were saved by a hierarchical State."""
        return self.buckets.replay_tiered

    @property
    def backend_sent(self) -> Dict[Tuple[int, ...], int]:
        """``codec="auto"``: the buckets handed to the backend's all-reduce -> the step it last sent."""
        return self.buckets.backend_sent

    def attach(self, model: torch.nn.Module) -> None:
        """Give the State its DDP model (``ddp.register_comm_hook(State(...), hook)`` creates it
        without one), so that :meth:`state_dict` names every parameter's residual. Any time: the
        residuals are kept by parameter."""
        self.model = model
        self._names = None

    def wait(self) -> None:
        """Block until every all-reduce launched by the hook (and its statistics) has finished."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)

    # ---- statistics ------------------------------------------------------------------------------

    @property
    def stats(self) -> "StatsDict":
        """Per step and per bucket, on this rank (the last ``history`` steps), read once every
        launched all-reduce has finished: a read-only :class:`flatcomm.stats.Snapshot` whose
        counters sum the steps kept and whose keys (``codec``, ``steps``, ``decisions``, ...) are
        the plain dict's of earlier versions. A read-only property, like
        ``ReduceScatter.stats``; the old call ``state.stats()`` still works, with a DeprecationWarning.

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
        out = self.recorder.steps()
        detail = {"codec": "auto" if self.auto else self.codec.name, "block_size": self.codec.block_size,
                  "mode": self.mode, "error_feedback": self.error_feedback,
                  # codec="auto": per bucket, what the tuner chose and why
                  "decisions": [{"codec": d.codec, "chunks": d.chunks, "reason": d.reason,
                                 "predicted_s": dict(d.predicted_s),
                                 **self.monitor.measured_fields(k)} for k, d in self.decisions.items()],
                  # codec="auto" with backoff: each move to a more precise codec, with its numbers
                  "adaptations": [dict(a) for a in self.adaptations],
                  "world_size": dist.get_world_size(self.group) if self.group is not None else None,
                  "topology": self.topology.describe() if self.topology is not None else None,
                  "steps": out}
        sums = {f: sum(s[f] for s in out) for f in COUNTERS if f != "calls"}
        return StatsDict("ddp", calls=sum(len(s["buckets"]) for s in out), **sums, detail=detail)

    # ---- checkpoints (flatcomm.ddp.checkpoint) --------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's state: its own client and server residuals per parameter name, as they are.

        No communication: call it on any rank(s), e.g. every rank saving its own file (like torch's
        DCP does), and :meth:`load_state_dict` it on the same rank at the same world size to continue
        bit for bit. To change the world size, load the list of every rank's dicts (or
        :func:`reshard` it), or save :meth:`resharded_state_dict` (a collective) instead. Plain
        tensors, strings and numbers (``torch.load(weights_only=True)``).
        """
        return _ckpt.state_dict(self)

    def resharded_state_dict(self) -> dict:
        """The world-size-independent form: per parameter, the total ``T`` that the next step adds
        to the averaged gradient (see the module docs). A collective on flatcomm's group: call it
        on every rank at the same point; every rank gets the same dict, loadable at any world size
        (not bit for bit: the residuals are re-spread over the new ranks)."""
        return _ckpt.resharded_state_dict(self)

    def load_state_dict(self, sd, *, allow_codec_change: bool = False) -> None:
        """Restore a state saved by :meth:`state_dict` (this rank's own, same world size: the run
        continues bit for bit), by :meth:`resharded_state_dict`, or a list of every rank's
        :meth:`state_dict` (any world size). Every entry is checked (keys, shapes, dtype,
        finiteness, codec, world size, rank); errors name the parameter. Residuals saved with
        another codec, block size or mode load only with ``allow_codec_change=True`` (the next steps
        send them with this State's codec). No communication.
        """
        _ckpt.load_state_dict(self, sd, allow_codec_change=allow_codec_change)

    def total_residual(self) -> Dict[str, torch.Tensor]:
        """``T`` per parameter name (a collective, like :meth:`resharded_state_dict`)."""
        return self.resharded_state_dict()["residual"]

    # ---- internals: groups, names, residual helpers, the hook's entry ----------------------------

    def ddp_group(self):
        pg = getattr(self.model, "process_group", None)
        return pg if pg is not None else dist.group.WORLD

    def ensure_group(self):
        # flatcomm's private copy of DDP's group (or of group=), with that group's timeout; cached.
        self.group = C.private_group(self.group if self.group is not None else self.ddp_group())
        return self.group

    def _scale(self) -> float:
        return 1.0 / dist.get_world_size(self.group)

    def name_map(self) -> Dict[int, str]:
        if self._names is None:
            if self.model is None:
                raise RuntimeError("flatcomm: State has no model; use flatcomm.ddp.register(ddp_model, ...) "
                                   "or State(..., model=ddp_model) to name parameters in checkpoints")
            mod = getattr(self.model, "module", self.model)
            self._names = {id(p): n for n, p in mod.named_parameters()}
        return self._names

    # ---- residual buffers keyed by parameters ------------------------------------------------------

    def name_of(self, pid) -> Optional[str]:
        return self.name_map().get(pid)

    def where_kw(self) -> dict:
        return {"scale": self._scale(), "tiered": self.tiered(), "name_of": self.name_of}

    def rescale_for_scaler(self) -> None:
        s = float(self.grad_scaler.get_scale())
        if not (math.isfinite(s) and s > 0):  # a broken scale would turn the residuals NaN, 0 or negative
            return
        old = self.scale_seen
        self.scale_seen = s
        if old is None or s == old:
            return
        self.residuals.rescale(s / old)

    # ---- the hook --------------------------------------------------------------------------------

    def tiered(self) -> bool:
        return self.topology is not None and not self.topology.flat

    def _launch(self, bucket) -> torch.futures.Future:
        """The hook's work for one bucket (the steps of :mod:`flatcomm.ddp.traffic`); the future
        holds the bucket buffer, averaged in place."""
        group = self.ensure_group()
        if self.topology is None:
            traffic.first_call(self, group)
        if self._new_step:
            self._new_step = False
            traffic.new_step(self, group, bucket.buffer().device)
        step, index, tensor = self.step, bucket.index(), bucket.buffer()
        whole, layout, parts = self.buckets.plan(bucket, self._keep if self.keep_fn is not None else None)
        if bucket.is_last():
            self.step += 1
            self._new_step = True
            self.buckets.end_step()
        if parts is None:
            return traffic.reduce(self, group, traffic.Piece(tensor, whole, layout, step, index, f"bucket{index}"))
        return traffic.reduce_parts(self, group, tensor, layout, parts, step, index)

    def _keep(self, p: torch.nn.Parameter) -> bool:
        """keep_fp32's answer for a parameter (asked once per parameter, by Buckets)."""
        keep = self.keep_fn
        return keep is not None and bool(keep(self.name_map().get(id(p), ""), p))

    def started(self) -> None:
        """One more all-reduce in flight (:meth:`wait` waits for it; :meth:`finished` ends it)."""
        with self._cond:
            self._inflight += 1

    def finished(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()


def hook(state: State, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: flatcomm all-reduce (average) of the bucket; the future holds the buffer."""
    with label("flatcomm.ddp.hook"):
        return state._launch(bucket)


# Real objects, not the strings `from __future__ import annotations` leaves: DDP compares them.
hook.__annotations__ = {"state": State, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, codec: Any = "int8", **options: Any) -> State:
    """Create a :class:`State` that knows ``ddp_model`` and register :func:`hook` on it.

    ``codec``: ``"int8"`` (default), ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int4"``, ``"sign"``,
    ``"topk"``, ``"auto"`` or a :class:`flatcomm.Codec`. The default is int8 with error feedback
    because a DDP hook exists to cut gradient traffic (4x less than fp32, the same final loss in the
    demo), while the collectives and ``flatcomm.fsdp.apply`` default to lossless fp32 like the
    ``torch.distributed`` calls they stand in for. Which codec for which optimizer: ``sign`` is for
    SGD / momentum; Adam users take int8 or int4 here, or :class:`flatcomm.optim.OnebitAdam`
    (``docs/ddp.md`` has the measured table).
    ``options``: any keyword of :class:`State` (``error_feedback``, ``mode``, ``group``, ``chunks``,
    ``block_size``, ``ratio``, ``grad_scaler``, ``track_norms``, ``history``, ``tuner``,
    ``topology``, ``start_step``, ``keep_fp32``, ``backoff``, ``accordion``). ``mode`` None (the
    default) means the caller did not ask for determinism: fixed codecs run ``"ordered"``
    (flatcomm's sums are the same bits every run anyway), and ``codec="auto"`` may also hand a
    bucket to the backend's own all-reduce (torch's default hook) where that is predicted fastest;
    ``"ordered"`` or ``"exact"`` (fp32 only) asks for determinism: auto then chooses among
    flatcomm's own collectives only.

    Args:
        ddp_model: the :class:`~torch.nn.parallel.DistributedDataParallel` model to hook.
        codec: the gradients' codec (default ``"int8"``, see above).
        options: keywords of :class:`State`, as listed above.

    Returns:
        The :class:`State` (for ``state_dict()``, ``stats``, ``decisions``).

    Example::

        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
        >>> state = flatcomm.ddp.register(ddp, "int8", start_step=10)
        >>> loss_fn(ddp(x), y).backward()          # the hook sends int8 with error feedback
        >>> state.stats["steps"][-1]["compression"]
        >>> torch.save(state.state_dict(), f"flatcomm{rank}.pt")
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"flatcomm.ddp.register needs a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first (DistributedDataParallel(model)), or for "
                        f"FSDP use flatcomm.fsdp.apply")
    if "model" in options:
        raise TypeError("flatcomm.ddp.register takes the model as its first argument, not model=")
    state = State(codec, model=ddp_model, **options)
    register_ddp_hook(ddp_model, state, hook, "flatcomm.ddp.register")
    return state


# register() takes State's options, listed once (State.__init__); its signature, as help() and
# editors show it, is State's with the DDP model first.
register.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("ddp_model", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [p for n, p in inspect.signature(State).parameters.items() if n != "model"],
    return_annotation=State)
