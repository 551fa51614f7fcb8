"""The :class:`Tuner`: a codec per collective (pins, cached decisions, measured costs, races), and
the process-wide default tuner per group (:func:`tuner_for`).

Reproducible decisions: a :class:`CostModel` saved with :func:`save_profile` (``python -m
flatcomm.tune --save profile.json``) and loaded with ``Tuner(profile=...)`` gives the same decisions
on every run (:func:`decide` is pure). Without one, the model is measured (MAX-agreed, so the same
on every rank); either way each new decision is checked across the group (a tiny all-reduce of its
hash: ranks that loaded different profiles get a ``ValueError``, not a hang) and logged once, on
rank 0, to the ``flatcomm.autotune`` logger.

    tuner = Tuner(error_budget="int4", pinned={"0-65536": "fp32"})
    d = tuner.choose(numel, group=group)      # a collective the first time (measures)
    all_reduce(t, codec=d.codec, chunks=d.chunks, group=group)
    all_reduce(t, codec="auto", tuner=tuner, group=group)    # the same, inside the collective

This package sits above the machinery (:mod:`flatcomm.comm`: it times those collectives) and below
:mod:`flatcomm.collectives`, which asks :func:`tuner_for` for ``codec="auto"``;
:mod:`flatcomm.tools.tune` (``python -m flatcomm.tune``) is the command-line tool built on it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import zlib
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import race as R, tiers as T
from .costs import CostModel, Decision
from .decide import BACKEND, KINDS, allowed, check_kind, chunks_for, decide, predict
from .measure import measure, on_worker
from .profiles import ProfileLike, load_profile, save_profile
from ..comm import context
from ..comm.two_level import default_segments
from ..ops.codecs import PRECISION, Codec

__all__ = ["BACKEND", "PRECISION", "KINDS", "CostModel", "Decision", "Tuner", "allowed", "decide",
           "load_profile", "measure", "predict", "save_profile", "tuner_for"]

log = logging.getLogger("flatcomm.autotune")

_RANGE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


class Tuner:
    """Chooses a codec per collective: pinned entries first, else :func:`decide` on measured costs.

    error_budget: least precise codec allowed (see :data:`PRECISION`).
    pinned: ``{key: codec}`` where key is an exact bucket key string (the ``key=`` passed to
        :meth:`choose`; flatcomm.ddp passes ``"bucket<index>"``) or a numel range ``"lo-hi"``
        (lo inclusive, hi exclusive, either side may be empty). Pinned codecs bypass the budget.
    codec: a codec name other than ``"auto"`` pins every choice.
    costs: a :class:`CostModel` to use instead of measuring.
    profile: a saved profile (path or document, see :func:`save_profile`) to take ``costs`` from:
        the same decisions on every run.

    race: confirm each decision made from *measured* costs by timing it against the safe choice
        at its size until they separate (:mod:`flatcomm.autotune.race`); without separation the
        safe choice is kept. Decisions from ``costs``/``profile`` are never raced.
    verbose: log each new decision once, on rank 0: at WARNING (shown by default) the first one of
        each outcome (path and codecs), at INFO the rest; False: all at INFO.

    ``decisions`` maps ``(kind, numel)`` to the unpinned :class:`Decision` made for it (decided once,
    agreed across the group, logged once, then reused; without ``costs``/``profile`` the cost model
    is measured once, at the first unpinned choice); ``open_decisions`` holds those made with
    ``deterministic=False`` (the backend's all-reduce a candidate). For the same choice on every
    run, pin it: ``Tuner(profile="profile.json")`` (``python -m flatcomm.tune --save profile.json``).
    """

    def __init__(self, error_budget: str = "int8", *, pinned: Optional[Mapping[str, str]] = None,
                 codec: str = "auto", costs: Optional[CostModel] = None, profile: Optional[ProfileLike] = None,
                 intra_budget: str = "fp32", race: bool = True, verbose: bool = True):
        allowed(error_budget)
        allowed(intra_budget)
        self.intra_budget = intra_budget
        if profile is not None:
            if costs is not None:
                raise ValueError("flatcomm: Tuner takes costs= or profile=, not both")
            costs = load_profile(profile)
        self.error_budget = error_budget
        self.codec = codec
        if codec != "auto":
            Codec(codec)
        self.pinned = dict(pinned or {})
        for v in self.pinned.values():
            Codec(v)
        self.costs = costs
        self.race = race
        self.verbose = verbose
        self._measured = False  # the costs were measured here (not given): decisions are raced
        self._announced: set = set()  # the outcomes logged at WARNING (see _level)
        # unpinned choices, by (kind, numel) (+ the paths with a topology)
        self.decisions: Dict[Tuple[Any, ...], Decision] = {}
        self.open_decisions: Dict[Tuple[Any, ...], Decision] = {}  # the same with deterministic=False

    def _pin(self, numel: int, key: Optional[str]) -> Optional[Tuple[str, str]]:
        if self.codec != "auto":
            return self.codec, "codec="
        if key is not None and key in self.pinned:
            return self.pinned[key], f"pinned[{key!r}]"
        for k, v in self.pinned.items():
            m = _RANGE.match(k)
            if m and (not m.group(1) or numel >= int(m.group(1))) and (not m.group(2) or numel < int(m.group(2))):
                return v, f"pinned[{k!r}]"
        return None

    def choose(self, numel: int, *, error_budget: Optional[str] = None, key: Optional[str] = None,
               group=None, device: Optional[torch.device] = None, kind: str = "all_reduce",
               deterministic: bool = True, topology=None, paths: Optional[Tuple[str, ...]] = None) -> Decision:
        """The codec for ``numel`` values. Every new unpinned decision is a collective on ``group``
        (the first one also measures, unless costs were given): every rank must make its unpinned
        choices in the same order. ``deterministic=False`` lets the backend's own all-reduce compete.
        ``topology`` (a hierarchical :class:`flatcomm.Topology` over ``group``): the path (flat or
        hierarchical, or only those in ``paths``) and a codec per tier are chosen too (the costs
        are then measured with the tiers' link costs; a profile must hold them)."""
        check_kind(kind)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        two_level = topology is not None and not topology.flat and kind == "all_reduce"
        paths = (tuple(paths) if paths is not None else T.PATHS) if two_level else None
        pin = self._pin(numel, key)
        if pin is not None:
            return Decision(pin[0], chunks_for(pin[0], numel, world, kind), f"{pin[0]} by {pin[1]}", {})
        budget = error_budget or self.error_budget
        cache = self.decisions if deterministic else self.open_decisions
        cache_key = (kind, numel) if paths is None else (kind, numel, paths)  # flat keys as before
        if budget == self.error_budget and cache_key in cache:
            return cache[cache_key]
        costs = self._costs(group, device, topology if two_level else None)
        segments = self._cpu_segments(numel, device, topology) if two_level else None
        d = decide(costs, numel, world, budget, kind, deterministic, paths=paths,
                   intra_budget=self.intra_budget, segments=segments)
        if self.race and self._measured and world > 1:
            d = self._raced(d, numel, world, group, device, kind, deterministic)
        _agree(d, group, device)
        if budget == self.error_budget:
            cache[cache_key] = d
        if world <= 1 or dist.get_rank(group) == 0:
            log.log(self._level(d), "flatcomm auto: %s: %s (%s, chunks %d)",
                    key or f"numel {numel}", d.reason, d.path, d.chunks)
        return d

    def _costs(self, group, device, topology) -> CostModel:
        """Measure the cost model at the first unpinned choice (a collective), unless given; a
        two-level ``topology`` needs per-tier link costs in it."""
        if self.costs is None:
            self.costs = measure(group, device=device, topology=topology)
            self._measured = True
        if topology is not None and not T.tiered(self.costs):
            raise ValueError(f"flatcomm auto: {topology!r} needs per-tier link costs, and this tuner's "
                             "costs (profile) have none: measure them with the topology (`python -m "
                             "flatcomm.tune --save` under torchrun sets LOCAL_WORLD_SIZE)")
        return self.costs

    def _cpu_segments(self, numel: int, device, topology) -> Optional[int]:
        """On CPU the two-level path keeps its own segment count (by size; one where a lossy intra
        codec may be picked, whose segments cost staging copies): the node tier's transfers
        compete with the kernels for the same cores, which the model's overlap does not see.
        None (the model's best) elsewhere."""
        if device is not None and torch.device(device).type != "cpu":
            return None
        if self.intra_budget != "fp32":
            return 1
        return default_segments(math.ceil(numel / topology.local_size), topology.nodes)

    def _level(self, d: Decision) -> int:
        """WARNING for the first decision of each outcome (path, codec per tier), INFO for the
        rest: a DDP model's buckets (and DDP's first-iteration layout) mostly decide alike, and a
        run should print what auto chose, not one line per bucket size."""
        outcome = (d.path, d.codec, d.intra_codec)
        if not self.verbose or outcome in self._announced:
            return logging.INFO
        self._announced.add(outcome)
        return logging.WARNING

    def _raced(self, d: Decision, numel: int, world: int, group, device, kind: str, deterministic: bool) -> Decision:
        """``d``, or the safe choice where ``d`` did not beat it beyond the spread (module race)."""
        safe = R.safe_choice(deterministic, kind)
        if d.path != "flat" or d.codec == safe or (safe == BACKEND and getattr(self.costs, "backend_Bps", None) is None):
            return d
        return self._race(d.codec, safe, d, numel, world, group, device, kind)

    def _race(self, candidate: str, safe: str, model: Decision, numel: int, world: int, group, device,
              kind: str) -> Decision:
        r = on_worker(group, lambda: R.race(candidate, safe, numel, group, device, kind))
        if r.winner == model.codec:
            return dataclasses.replace(model, reason=f"{model.reason}; {r.describe()}", raced=(candidate, safe))
        reason = f"{r.describe()} (the model had predicted {model.codec}: {model.reason})"
        chunks = 1 if r.winner == BACKEND else chunks_for(r.winner, numel, world, kind)
        return Decision(r.winner, chunks, reason, model.predicted_s, raced=(candidate, safe))

    def revisit(self, d: Decision, numel: int, *, group=None, device: Optional[torch.device] = None,
                kind: str = "all_reduce", key: Optional[str] = None) -> Decision:
        """Race a raced decision's two candidates again (a collective on ``group``: every rank at
        the same point) and return the winner's decision, ``d`` itself when it wins again."""
        if not d.raced:
            return d
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        new = self._race(d.raced[0], d.raced[1], d, numel, world, group, device, kind)
        if new.codec != d.codec and (world <= 1 or dist.get_rank(group) == 0):
            log.log(logging.WARNING if self.verbose else logging.INFO, "flatcomm auto: %s revisited: %s",
                    key or f"numel {numel}", new.reason)
        return new


def _agree(d: Decision, group, device: Optional[torch.device]) -> None:
    """Check that every rank of ``group`` made decision ``d`` (one tiny all-reduce on the group's
    worker thread); ranks that disagree, e.g. with different profiles, get a ValueError."""
    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return
    h = zlib.crc32(f"{d.codec}/{d.chunks}/{d.path}/{d.intra_codec}".encode())
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def body():
        t = torch.tensor([h, -h], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    hi, neg_lo = on_worker(group, body)
    if hi != h or -neg_lo != h:
        raise ValueError(f"flatcomm auto: ranks disagree on the decision ({d.codec}, chunks {d.chunks} here): "
                         f"were they given different profiles or costs? {d.reason}")


def tuner_for(group=None) -> Tuner:
    """The default :class:`Tuner` of ``group`` (error budget int8), created on first use and kept
    in the group's context (:mod:`flatcomm.comm.context`): dropped when the group is destroyed."""
    return context.of(group).slot("tuner", Tuner)
