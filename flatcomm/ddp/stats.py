"""The DDP hook's statistics: one record per bucket and step, summed per step on demand.

The hook records from the collective's completion callback (a worker thread), so records are
appended under a lock, and residual norms stay 0-dim tensors until :meth:`Recorder.steps` reads
them (on CUDA: no host sync per bucket). What each field means: :attr:`flatcomm.ddp.State.stats`.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Dict, List, NamedTuple

from .. import collectives as C
from .._snapshot import Snapshot
from ..ops.codecs import Codec

__all__ = ["Recorder", "Sent", "StatsDict", "fp32_ring_bytes"]


class Sent(NamedTuple):
    """Which all-reduce a record is about: the step, DDP's bucket index, the values sent, the
    group's size and the codec they went with."""

    step: int
    bucket: int
    numel: int
    world: int
    codec: Codec


def fp32_ring_bytes(numel: int, world: int) -> int:
    """What a plain fp32 (ring) all-reduce puts on the wire per rank: 2 (W-1)/W * 4n."""
    return int(2 * (world - 1) * 4 * numel // world)


def _norms_to_floats(rec: dict) -> None:
    """Turn a record's lazy norms (0-dim tensors: read only when stats are asked for) into floats."""
    lazy = rec.pop("_norms", None)
    if lazy is None:
        return
    c_sq, s_sq, v_sq, rel = lazy
    v = float(v_sq) if v_sq is not None else None
    if c_sq is not None and v is not None:  # (the input norm is measured whenever a residual is)
        c = float(c_sq)
        rec["client_residual_norm"] = math.sqrt(c)
        rec["server_residual_norm"] = math.sqrt(float(s_sq))
        rec["input_norm"] = math.sqrt(max(v, 0.0))
        rec["rel_error"] = math.sqrt(c / v) if v > 0 else 0.0
    else:
        rec["client_residual_norm"] = rec["server_residual_norm"] = 0.0
        rec["input_norm"] = math.sqrt(max(v, 0.0)) if v is not None else 0.0
        rec["rel_error"] = rel


class Recorder:
    """Records of the last ``history`` steps; ``track_norms``: with residual and input norms."""

    def __init__(self, history: int, track_norms: bool) -> None:
        self.history = history
        self.track_norms = track_norms
        self._records: List[dict] = []
        self._lock = threading.Lock()

    def _add(self, rec: dict) -> None:
        with self._lock:
            self._records.append(rec)
            if self._records[-1]["step"] - self._records[0]["step"] >= self.history:
                first = self._records[-1]["step"] - self.history + 1
                self._records = [r for r in self._records if r["step"] >= first]

    def bucket(self, sent: Sent, cs: C.CommStats, comm_s: float, res, v_sq: Any) -> None:
        """One flatcomm all-reduce of a bucket; ``res``: its residual buffer (None: none kept),
        whose ``client_sq`` is updated here (the next step's input norm and the backoff read it)."""
        step, index, numel, world, codec = sent
        rec: Dict[str, Any] = {
            "step": step, "bucket": index, "numel": numel, "codec": codec.name,
            "wire_bytes": cs.wire_bytes, "fp32_bytes": fp32_ring_bytes(numel, world),
            "encode_s": cs.encode_s, "exchange_s": cs.exchange_s, "decode_s": cs.decode_s,
            "comm_s": comm_s,
        }
        if self.track_norms:
            if res is not None:
                # dot products, not square().sum(): no bucket-size temporary per bucket and step
                # (freed large temporaries raise glibc's mmap threshold, and the heap then keeps
                # ~100 MiB resident: docs/ddp.md, "Host memory")
                c, s = res.ef.client, res.ef.server
                c_sq = c.dot(c).double()
                res.client_sq = c_sq
                rec["_norms"] = (c_sq, s.dot(s).double(), v_sq, None)
            else:
                rec["_norms"] = (None, None, v_sq, 0.0 if codec.lossless else float("nan"))
        self._add(rec)

    def backend(self, step: int, index: int, numel: int, world: int, codec_name: str, comm_s: float) -> None:
        """One bucket sent by the backend's own all-reduce (``codec="auto"``)."""
        ring = fp32_ring_bytes(numel, world)
        self._add({"step": step, "bucket": index, "numel": numel, "codec": codec_name, "wire_bytes": ring,
                   "fp32_bytes": ring, "encode_s": 0.0, "exchange_s": comm_s, "decode_s": 0.0,
                   "comm_s": comm_s, "client_residual_norm": 0.0, "server_residual_norm": 0.0})

    def steps(self) -> List[dict]:
        """Per step: the buckets' records (by bucket index) and their sums (see State.stats)."""
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
            for f in ("wire_bytes", "fp32_bytes", "encode_s", "exchange_s", "decode_s", "comm_s"):
                s[f] += r[f]
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
        return out


class StatsDict(Snapshot):
    """What :attr:`State.stats` returns: a :class:`flatcomm.stats.Snapshot` (``source="ddp"``; its
    counters summed over the steps kept) whose keys are those of flatcomm 0.2's plain dict.
    Calling it, the spelling of flatcomm 0.1 (``state.stats()``, when ``stats`` was a method),
    returns it too, with a DeprecationWarning."""

    def __call__(self) -> "StatsDict":
        warnings.warn("flatcomm: State.stats is a property: write state.stats, not state.stats()",
                      DeprecationWarning, stacklevel=2)
        return self
