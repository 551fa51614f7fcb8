"""Accordion (Agarwal et al. 2021, "Adaptive Gradient Communication via Critical Learning Regime
Identification"): a precise codec in critical regimes, the aggressive one otherwise.

Training has short "critical" phases (the start, after a learning-rate change) where compression
errors cost final accuracy, and long quiet ones where they do not. Accordion detects them from the
gradient itself: every ``every`` steps it compares the gradient norm of the interval that just
ended, ``sqrt(sum over its steps of ||g||^2)``, with the one before (per bucket; the paper uses the
norm of the interval's summed gradient, which needs a bucket-sized buffer and a fixed layout, and
DDP rebuilds its buckets after the first step); a relative change of at least ``threshold`` marks
the next interval critical, and it is sent with ``low`` (e.g. int8) instead of the State's codec
(e.g. sign). The first two intervals are critical (nothing to compare yet).

Used by :class:`flatcomm.ddp.State` (``register(ddp, "sign", accordion=...)``), per bucket (its set
of parameters, whatever their order):

* ``choose(key, step, codec)`` before a bucket's all-reduce gives the codec of that step;
* ``watch(key, step, future)`` chains onto the all-reduce's future and adds the *reduced* gradient's
  squared norm (the same bits on every rank) to the interval's sum, so every rank takes the same decisions
  without communicating, and DDP waits for the addition before the optimizer step.

Both codecs share the bucket's error-feedback residual: a blockwise ``low`` codec takes the
State codec's block size, so the shard layout (where the server residual lives) is the same.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Dict, Optional, Tuple

import torch

from ..ops.codecs import BLOCKWISE, Codec, resolve

__all__ = ["Accordion", "policy"]


class _Track:
    __slots__ = ("interval", "acc", "prev", "critical", "count")

    def __init__(self, interval: int):
        self.interval = interval
        self.acc: Any = 0.0  # sum of ||reduced gradient||^2 over this interval (a 0-dim tensor once added)
        self.prev: Optional[float] = None  # the interval norm of the interval before
        self.critical = True
        self.count = 0  # intervals compared so far


class Accordion:
    """Adaptive switching between ``low`` (critical regimes) and the State's codec.

    Args:
        low: the codec of critical intervals (``"int8"`` default, ``"fp32"``, ``"bf16"``, ``"int4"``).
        every: interval length in steps (hook rounds).
        threshold: relative change of the interval gradient norm, ``|n_prev - n| / n_prev``, that
            marks the next interval critical.
    """

    def __init__(self, low: Any = "int8", every: int = 10, threshold: float = 0.5):
        if isinstance(low, str) and low == "auto":
            raise ValueError("flatcomm: Accordion's low codec must be a fixed codec, not 'auto'")
        if not isinstance(low, (str, Codec)):
            raise TypeError(f"flatcomm: Accordion's low codec must be a codec name or Codec, got {low!r}")
        self.low = resolve(low)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"flatcomm: Accordion's every must be an int >= 1, got {every!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or \
                not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"flatcomm: Accordion's threshold must be a finite number > 0, got {threshold!r}")
        self.every = every
        self.threshold = float(threshold)
        self._tracks: Dict[Tuple[int, ...], _Track] = {}
        self._lock = threading.Lock()
        self.switches: list = []  # {"step", "params" (of the bucket), "critical", "change"}: each decision

    def __repr__(self) -> str:
        return f"Accordion(low={self.low.name!r}, every={self.every}, threshold={self.threshold})"

    def _low_for(self, codec: Codec) -> Codec:
        if self.low.name in BLOCKWISE and codec.name in BLOCKWISE and self.low.block_size != codec.block_size:
            return resolve(self.low.name, codec.block_size)  # the same shard layout: see the module doc
        return self.low

    def choose(self, key: Tuple[int, ...], step: int, codec: Codec) -> Codec:
        """The codec of bucket ``key`` (ids of its parameters) at ``step``: ``low`` in a critical
        interval, else ``codec``."""
        interval = step // self.every
        key = tuple(sorted(key))
        with self._lock:
            t = self._tracks.get(key)
            if t is None:
                t = self._tracks[key] = _Track(interval)
            elif interval != t.interval:
                self._close(t, key, interval, step)
            critical = t.critical
        return self._low_for(codec) if critical else codec

    def _close(self, t: _Track, key, interval: int, step: int) -> None:
        norm = math.sqrt(float(t.acc))
        change = None
        if t.prev is not None and t.prev > 0:
            change = abs(t.prev - norm) / t.prev
            t.critical = change >= self.threshold
        t.count += 1
        t.prev = norm
        t.acc = 0.0
        t.interval = interval
        self.switches.append({"step": step, "params": len(key), "critical": t.critical,
                              "change": change})
        if len(self.switches) > 10000:
            del self.switches[:5000]

    def watch(self, key: Tuple[int, ...], step: int, fut: torch.futures.Future) -> torch.futures.Future:
        """``fut`` (the bucket's all-reduce; its value the reduced tensor) followed by adding that
        value's squared norm to the interval's sum; the returned future has the same value."""
        key = tuple(sorted(key))

        def add(f: torch.futures.Future):
            value = f.value()
            g = value.detach().reshape(-1).float()
            sq = g.dot(g).double()  # stays a tensor: no host sync until the interval closes
            with self._lock:
                t = self._tracks.get(key)
                if t is not None and t.interval == step // self.every:
                    t.acc = t.acc + sq
            return value

        return fut.then(add)

    def critical(self, key: Tuple[int, ...]) -> Optional[bool]:
        """Whether bucket ``key``'s current interval is critical (None: not seen yet)."""
        t = self._tracks.get(tuple(sorted(key)))
        return None if t is None else t.critical

    # ---- checkpoints: per bucket, keyed by its parameters' names --------------------------------------

    def state_dict(self, names: Dict[int, str]) -> dict:
        """``names``: id(param) -> name (e.g. from ``model.named_parameters()``)."""
        out = {}
        with self._lock:
            for key, t in self._tracks.items():
                out[",".join(sorted(names.get(i, "?") for i in key))] = {
                    "interval": t.interval, "prev": t.prev, "critical": t.critical, "count": t.count,
                    "acc": float(t.acc)}
        return {"every": self.every, "threshold": self.threshold, "low": self.low.name, "buckets": out}

    def load_state_dict(self, sd: dict, params: Dict[str, torch.nn.Parameter]) -> None:
        """``params``: name -> parameter of this run. Buckets whose names are not all known are
        skipped (they start over: critical for two intervals)."""
        for f in ("every", "threshold", "low", "buckets"):
            if f not in sd:
                raise ValueError(f"flatcomm: Accordion state_dict lacks {f!r}")
        if (sd["every"], sd["low"]) != (self.every, self.low.name):
            raise ValueError(f"flatcomm: Accordion state_dict is every={sd['every']}, low={sd['low']}; this "
                             f"one every={self.every}, low={self.low.name}")
        tracks = {}
        for names, rec in sd["buckets"].items():
            ps = [params.get(n) for n in names.split(",")]
            if any(p is None for p in ps):
                continue
            t = _Track(int(rec["interval"]))
            t.prev, t.critical, t.count = rec["prev"], bool(rec["critical"]), int(rec["count"])
            acc = rec.get("acc")
            if isinstance(acc, bool) or not isinstance(acc, (int, float)) or not math.isfinite(acc) or acc < 0:
                raise ValueError(f"flatcomm: Accordion state of bucket {names!r}: 'acc' must be a finite "
                                 f"number >= 0, got {acc!r}")
            t.acc = float(acc)
            tracks[tuple(sorted(id(p) for p in ps))] = t
        with self._lock:
            self._tracks = tracks


def policy(accordion: Any) -> Optional[Accordion]:
    """``register(..., accordion=)``: None/False (off), True (defaults), a codec name (the low
    codec, e.g. ``"int8"``) or an :class:`Accordion`."""
    if accordion is None or accordion is False:
        return None
    if accordion is True:
        return Accordion()
    if isinstance(accordion, (str, Codec)):
        return Accordion(low=accordion)
    if isinstance(accordion, Accordion):
        return accordion
    raise TypeError(f"flatcomm: accordion must be None, a bool, a codec name or a flatcomm.ddp.accordion.Accordion, "
                    f"got {accordion!r}")
