"""What the DDP hook keeps per bucket, behind a few methods: the error-feedback residuals,
``codec="auto"``'s decisions (and where each decided bucket sits), the layout a load replays, the
``keep_fp32`` answers and the bucket layouts whose call header was checked.

A bucket's key is the tuple of ``id(p)`` of its parameters in ``bucket.parameters()`` order (see
:mod:`flatcomm.ddp.residuals`). :class:`flatcomm.ddp.State` holds one :class:`Buckets`; the hook's
traffic (:mod:`flatcomm.ddp.traffic`) and the checkpoints (:mod:`flatcomm.ddp.checkpoint`) use it
only through the methods below.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import torch

from ..ops.codecs import Codec, resolve
from .residuals import Residuals, bucket_layout

__all__ = ["Buckets", "Key", "Layout", "Part"]

Key = Tuple[int, ...]  # the id(p) of a bucket's (or a part's) parameters
Layout = List[Tuple[int, int, int]]  # (id(p), offset, numel) of each parameter in a flat tensor
KeepFn = Callable[[torch.nn.Parameter], bool]


class Part(NamedTuple):
    """A group of a bucket's parameters sent as one all-reduce: its residual key (the parameter
    ids), the parameters, and the codec forced on it (keep_fp32: lossless fp32) or None."""

    key: Key
    params: list
    force: Optional[Codec] = None


def _part(params: list, force: Optional[Codec] = None) -> Part:
    return Part(tuple(id(p) for p in params), params, force)


class Buckets:
    """The hook's per-bucket state (see the module docstring).

    Args:
        track_norms: whether the residuals keep their squared norms for the statistics.

    Public, read by the State's properties and the checkpoints: ``residuals`` (the error feedback,
    :class:`flatcomm.ddp.residuals.Residuals`), ``decisions`` (key -> auto's Decision), ``replay``
    (after a same-world-size load: the saved keys the first step reduces as they were laid out),
    ``replay_tiered`` (whether those were saved by a hierarchical State), ``backend_sent`` (auto's
    buckets handed to the backend: key -> the step it last sent) and ``replay_backend`` (the
    replayed keys among them).
    """

    __slots__ = ("residuals", "decisions", "replay", "replay_tiered", "backend_sent", "replay_backend",
                 "_kept", "_where", "_seen")

    def __init__(self, track_norms: bool) -> None:
        self.residuals = Residuals(track_norms)
        self.decisions: Dict[Key, Any] = {}
        self.replay: Optional[List[Key]] = None
        self.replay_tiered = False
        # (a checkpoint saves the last step's backend buckets, whose layout the first step after a
        # load replays: the backend's sum order over more than two ranks depends on where a value
        # sits in the bucket)
        self.backend_sent: Dict[Key, int] = {}
        self.replay_backend: Set[Key] = set()
        self._kept: Dict[int, bool] = {}  # id(p) -> keep_fp32(name, p), asked once per parameter
        self._where: Dict[Key, Tuple[int, int]] = {}  # auto key -> (DDP bucket index, numel)
        self._seen: Set[Key] = set()  # keys whose call header was validated

    # ---- planning a bucket ----------------------------------------------------------------------

    def plan(self, bucket, keep: Optional[KeepFn]) -> Tuple[Part, Layout, Optional[List[Part]]]:
        """The bucket as a whole (its key and parameters), its layout in DDP's buffer, and the parts
        it must be sent as, or None when it goes as one all-reduce of the buffer itself: the first
        step after a load replays the saved buckets; ``keep`` (keep_fp32's predicate on a
        parameter) puts the kept parameters in their own lossless all-reduce."""
        params = list(bucket.parameters())
        whole = _part(params)
        known = self.residuals.bufs.get(whole.key)
        layout = known.layout if known is not None and not self.replay else bucket_layout(bucket)
        parts = self._replay_parts(params) if self.replay else None
        if keep is not None:
            parts = self._split_kept(parts if parts is not None else [whole], keep)
        if parts is not None and len(parts) == 1 and parts[0].key == whole.key:  # one kind: no copy
            whole, parts = parts[0], None
        return whole, layout, parts

    def _kept_once(self, p, keep: KeepFn) -> bool:
        k = self._kept.get(id(p))
        if k is None:
            k = self._kept[id(p)] = bool(keep(p))
        return k

    def _split_kept(self, parts: List[Part], keep: KeepFn) -> List[Part]:
        """Each part split into its codec parameters and its keep_fp32 ones (forced lossless fp32),
        in that order on every rank (DDP's bucket order is the same everywhere)."""
        out = []
        for part in parts:
            kept = [p for p in part.params if self._kept_once(p, keep)]
            if not kept:
                out.append(part)
                continue
            rest = [p for p in part.params if not self._kept_once(p, keep)]
            if rest:
                out.append(_part(rest, part.force))
            out.append(_part(kept, resolve("fp32")))
        return out

    def _replay_parts(self, params: list) -> Optional[List[Part]]:
        """The saved buckets wholly inside this bucket (in saved parameter order), plus one part for
        the remaining parameters; None when the bucket is itself a saved one or holds none."""
        key = tuple(id(p) for p in params)
        saved = set(self.residuals.bufs) | self.replay_backend
        if key in saved:
            return None
        by_id = {id(p): p for p in params}
        parts: List[Part] = []
        used: Set[int] = set()
        for skey in self.replay or ():
            if skey in saved and all(pid in by_id for pid in skey):
                parts.append(Part(skey, [by_id[pid] for pid in skey]))
                used.update(skey)
        if not parts:
            return None
        rest = [p for p in params if id(p) not in used]
        if rest:
            parts.append(_part(rest))
        return parts

    # ---- per key: auto's decision, where it sits, its first call --------------------------------

    def decide(self, key: Key, choose: Callable[[], Any], index: int, numel: int) -> Any:
        """auto's Decision for ``key``: ``choose()`` at the key's first call (pure given the
        MAX-agreed costs, so every rank picks the same), kept afterwards; notes where it sits."""
        d = self.decisions.get(key)
        if d is None:
            d = self.decisions[key] = choose()
        self._where[key] = (index, numel)
        return d

    def where(self, key: Key) -> Tuple[Optional[int], Optional[int]]:
        """(DDP bucket index, numel) of a decided key at its last call, or (None, None)."""
        return self._where.get(key, (None, None))

    def first_sight(self, key: Key) -> bool:
        """True at a key's first all-reduce only: its call header is checked then (see
        :func:`flatcomm.collectives.all_reduce`'s ``validate``)."""
        new = key not in self._seen
        self._seen.add(key)
        return new

    def sent_by_backend(self, key: Key, step: int) -> None:
        self.backend_sent[key] = step

    def end_step(self) -> None:
        """After a step's last bucket: only the first step after a load has DDP's initial layout."""
        self.replay = None
        self.replay_backend = set()

    # ---- checkpoints ----------------------------------------------------------------------------

    def restore(self, params, client, server, buckets, world: int, tiered: bool) -> None:
        """The residuals of a loaded state dict, and the saved buckets the next step replays."""
        saved = self.residuals.restore(params, client, server, buckets, world, tiered)
        self.replay = saved or None
        self.replay_tiered = bool(tiered)

    def restore_backend(self, keys: List[Key], step: int) -> None:
        """The backend's buckets of a loaded state dict: replayed as sent at ``step``."""
        self.replay = (self.replay or []) + keys
        self.replay_backend = set(keys)
        self.backend_sent = {k: step for k in keys}  # a save before the next step keeps them

    def restore_decisions(self, decisions: Dict[Key, Any]) -> None:
        self.decisions = decisions
