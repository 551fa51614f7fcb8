"""Monitoring: turn flatcomm's counters into flat records and export them.

Usage::

    import flatcomm.stats as fs

    recs = fs.from_ddp_state(state)                      # flatcomm.ddp.State -> [Record] (per bucket)
    with fs.JsonLinesExporter("comm.jsonl") as ex:       # also TensorBoardExporter, PrometheusExporter
        ex.write(recs)
    print(fs.prometheus_text(recs))                     # text exposition format, no dependency

A :class:`Record` is one measurement: one collective (one DDP bucket of one step, one call of
``flatcomm.collectives.*`` with a :class:`~flatcomm.collectives.CommStats`, one step of
``flatcomm.reproducible``, the counters of a front end's ``.stats`` :class:`Snapshot`: exporters
take those too, :func:`from_snapshot`). ``size_bytes`` is the logical fp32 payload (``4 * numel``, the *size*
of nccl-tests); ``algbw = size_bytes / seconds`` and ``busbw = algbw * factor(kind, world)`` with
the nccl-tests factors (all_reduce ``2(n-1)/n``; reduce_scatter, all_gather, all_to_all ``(n-1)/n``;
broadcast, reduce ``1``), both in GB/s (1e9 bytes per second). ``fp32_bytes`` is what an
uncompressed fp32 ring collective puts on the wire per rank (``factor * size_bytes``), so
``compression = fp32_bytes / wire_bytes``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Union

from ._snapshot import Snapshot

__all__ = ["Record", "Snapshot", "algbw", "busbw", "bus_factor", "from_ddp_state", "from_comm_stats",
           "from_snapshot", "from_step_stats",
           "JsonLinesExporter", "TensorBoardExporter", "PrometheusExporter", "prometheus_text", "METRICS"]

_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(kind: str, world: int) -> float:
    """nccl-tests bus bandwidth factor of a collective ``kind`` on ``world`` ranks."""
    try:
        f = _FACTORS[kind]
    except KeyError:
        raise ValueError(f"flatcomm.stats: unknown collective kind {kind!r}; one of {sorted(_FACTORS)}") from None
    if world < 1:
        raise ValueError(f"flatcomm.stats: world must be >= 1, got {world}")
    return f(world)


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: ``size_bytes / seconds / 1e9`` (0.0 when ``seconds <= 0``)."""
    return size_bytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw(kind: str, size_bytes: float, seconds: float, world: int) -> float:
    """Bus bandwidth in GB/s: ``algbw * factor`` (nccl-tests definitions, see :func:`bus_factor`)."""
    return algbw(size_bytes, seconds) * bus_factor(kind, world)


@dataclasses.dataclass
class Record:
    """One measurement. Times in seconds, bandwidths in GB/s; ``None`` = not measured."""

    step: int = 0
    name: str = ""                 # e.g. "bucket3", a collective id
    codec: str = ""
    kind: str = "all_reduce"
    numel: int = 0
    world: int = 1
    wire_bytes: int = 0            # bytes this rank put on the wire
    fp32_bytes: Optional[int] = None  # an uncompressed fp32 ring collective, per rank (default: computed)
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    total_s: Optional[float] = None   # launch to result (default: encode + exchange + decode)
    rel_error: Optional[float] = None
    residual_norm: Optional[float] = None
    digest: Optional[str] = None

    def __post_init__(self) -> None:
        factor = bus_factor(self.kind, self.world)  # validates kind and world
        if self.total_s is None:
            self.total_s = self.encode_s + self.exchange_s + self.decode_s
        if self.fp32_bytes is None:
            self.fp32_bytes = int(factor * self.size_bytes)

    @property
    def size_bytes(self) -> int:
        return 4 * self.numel

    @property
    def algbw(self) -> float:
        assert self.total_s is not None  # set by __post_init__
        return algbw(self.size_bytes, self.total_s)

    @property
    def busbw(self) -> float:
        assert self.total_s is not None  # set by __post_init__
        return busbw(self.kind, self.size_bytes, self.total_s, self.world)

    @property
    def compression(self) -> float:
        assert self.fp32_bytes is not None  # set by __post_init__
        return self.fp32_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def to_dict(self) -> Dict[str, Any]:
        """The fields plus the derived ``size_bytes``, ``algbw``, ``busbw``, ``compression``."""
        d = dataclasses.asdict(self)
        d.update(size_bytes=self.size_bytes, algbw=self.algbw, busbw=self.busbw, compression=self.compression)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Record":
        """Inverse of :meth:`to_dict` (derived and unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


RecordLike = Union[Record, Dict[str, Any], Snapshot]


def _rec(r: Union[Record, Dict[str, Any]]) -> Record:
    return r if isinstance(r, Record) else Record.from_dict(r)


def _records(records: Union[Snapshot, Iterable[RecordLike]]) -> List[Record]:
    """What an exporter writes: records, their dicts, and snapshots (each its records)."""
    items = [records] if isinstance(records, Snapshot) else records
    out: List[Record] = []
    for r in items:
        out += from_snapshot(r) if isinstance(r, Snapshot) else [_rec(r)]
    return out


def from_comm_stats(cs, *, numel: int, step: int = 0, name: str = "", codec: str = "", kind: str = "all_reduce",
                    world: int = 1, total_s: Optional[float] = None, rel_error: Optional[float] = None,
                    residual_norm: Optional[float] = None, digest: Optional[str] = None) -> Record:
    """A :class:`Record` from a :class:`flatcomm.collectives.CommStats` (``numel``: the full tensor)."""
    return Record(step=step, name=name, codec=codec, kind=kind, numel=numel, world=world,
                  wire_bytes=int(cs.wire_bytes), encode_s=float(cs.encode_s), exchange_s=float(cs.exchange_s),
                  decode_s=float(cs.decode_s), total_s=total_s, rel_error=rel_error,
                  residual_norm=residual_norm, digest=digest)


def from_ddp_state(state, *, per_step: bool = False) -> List[Record]:
    """Records from a :class:`flatcomm.ddp.State` (or the dict its ``stats`` returns).

    One record per bucket and step (``name="bucket<i>"``, ``total_s`` = the hook's ``comm_s``,
    ``residual_norm`` = sqrt(client^2 + server^2)); with ``per_step=True`` one per step
    (``name="step"``, sums over the buckets, the step's ``rel_error`` and ``residual_norm``).
    """
    st = state.stats if hasattr(state, "stats") else state
    codec, world = st.get("codec", ""), st.get("world_size") or 1
    out: List[Record] = []
    for s in st.get("steps", []):
        if per_step:
            numel = sum(b["numel"] for b in s["buckets"])
            out.append(Record(step=s["step"], name="step", codec=codec, numel=numel, world=world,
                              wire_bytes=s["wire_bytes"], fp32_bytes=s["fp32_bytes"], encode_s=s["encode_s"],
                              exchange_s=s["exchange_s"], decode_s=s["decode_s"], total_s=s["comm_s"],
                              rel_error=s.get("rel_error"), residual_norm=s.get("residual_norm")))
            continue
        for b in s["buckets"]:
            res = None
            if "client_residual_norm" in b:
                res = math.sqrt(b["client_residual_norm"] ** 2 + b["server_residual_norm"] ** 2)
            out.append(Record(step=b["step"], name=f"bucket{b['bucket']}", codec=codec, numel=b["numel"],
                              world=world, wire_bytes=b["wire_bytes"], fp32_bytes=b["fp32_bytes"],
                              encode_s=b["encode_s"], exchange_s=b["exchange_s"], decode_s=b["decode_s"],
                              total_s=b["comm_s"], rel_error=b.get("rel_error"), residual_norm=res))
    return out


def from_snapshot(snap: Snapshot, *, step: Optional[int] = None) -> List[Record]:
    """Records of a front end's ``.stats``: DDP's per bucket and step (:func:`from_ddp_state`), else
    one of the counters (``name`` = the source, ``step`` = DiLoCo's syncs unless given)."""
    if snap.source == "ddp":
        return from_ddp_state(snap)
    at = step if step is not None else int(snap.get("syncs", 0))
    kind = "reduce_scatter" if snap.source == "fsdp" else "all_reduce"
    return [Record(step=at, name=snap.source, kind=kind, wire_bytes=int(snap.wire_bytes), encode_s=snap.encode_s,
                   exchange_s=snap.exchange_s, decode_s=snap.decode_s)]


def from_step_stats(st, *, numel: int, world: int, name: str = "reproducible") -> Record:
    """A :class:`Record` from :class:`flatcomm.reproducible.StepStats` (``acc.stats``): ``total_s`` =
    ``reduce_s``, ``digest`` carried over, ``rel_error`` 0 (exact) or NaN for a skipped step."""
    return Record(step=st.step, name=name, codec="exact", numel=numel, world=world, wire_bytes=st.wire_bytes,
                  exchange_s=st.reduce_s, total_s=st.reduce_s, rel_error=0.0 if st.applied else float("nan"),
                  digest=st.digest or None)


# (metric name, type, help, value of a Record or None to skip). Counters add up over records; gauges
# keep the last record's value per label set.
METRICS = [
    ("flatcomm_wire_bytes_total", "counter", "Bytes this rank put on the wire.", lambda r: r.wire_bytes),
    ("flatcomm_fp32_bytes_total", "counter", "Bytes an uncompressed fp32 ring collective would send.",
     lambda r: r.fp32_bytes),
    ("flatcomm_collectives_total", "counter", "Collectives recorded.", lambda r: 1),
    ("flatcomm_step", "gauge", "Step of the last record.", lambda r: r.step),
    ("flatcomm_encode_seconds", "gauge", "Encode time of the last collective.", lambda r: r.encode_s),
    ("flatcomm_exchange_seconds", "gauge", "Network wait of the last collective.", lambda r: r.exchange_s),
    ("flatcomm_decode_seconds", "gauge", "Decode time of the last collective.", lambda r: r.decode_s),
    ("flatcomm_total_seconds", "gauge", "Launch-to-result time of the last collective.", lambda r: r.total_s),
    ("flatcomm_algbw_gbps", "gauge", "Algorithm bandwidth (nccl-tests), GB/s.", lambda r: r.algbw),
    ("flatcomm_busbw_gbps", "gauge", "Bus bandwidth (nccl-tests), GB/s.", lambda r: r.busbw),
    ("flatcomm_compression_ratio", "gauge", "fp32_bytes / wire_bytes of the last collective.",
     lambda r: r.compression if r.wire_bytes else None),
    ("flatcomm_rel_error", "gauge", "Relative error of the last encoding.", lambda r: r.rel_error),
    ("flatcomm_residual_norm", "gauge", "Norm of the error-feedback residual.", lambda r: r.residual_norm),
]
LABELS = ("name", "codec", "kind", "world")


def _labels(r: Record) -> tuple:
    return (r.name, r.codec, r.kind, str(r.world))


# ---- exporters -----------------------------------------------------------------------------------


class _Exporter:
    def write(self, records: Iterable[RecordLike]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf" / "-inf": strict JSON has no NaN
    return v


class JsonLinesExporter(_Exporter):
    """One JSON object (:meth:`Record.to_dict`) per line, appended to ``path``; non-finite floats are
    written as the strings ``"nan"``, ``"inf"``, ``"-inf"``. :meth:`read` loads them back."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = os.fspath(path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, records: Iterable[RecordLike]) -> None:
        for r in _records(records):
            d = {k: _json_safe(v) for k, v in r.to_dict().items()}
            self._f.write(json.dumps(d, allow_nan=False, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    @staticmethod
    def read(path: Union[str, os.PathLike]) -> List[Record]:
        out = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    for k in ("rel_error", "residual_norm", "total_s"):
                        if isinstance(d.get(k), str):
                            d[k] = float(d[k])
                    out.append(Record.from_dict(d))
        return out


def _missing(pkg: str, what: str) -> ImportError:
    return ImportError(f"flatcomm.stats.{what} needs the '{pkg}' package, which is not installed "
                       f"(pip install {pkg})")


class TensorBoardExporter(_Exporter):
    """Scalars ``flatcomm/<name>/<metric>`` at ``global_step=step`` through
    ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Optional[str] = None, **writer_kwargs):
        try:
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard", "TensorBoardExporter") from e
        self.writer = SummaryWriter(log_dir=log_dir, **writer_kwargs)

    def write(self, records: Iterable[RecordLike]) -> None:
        for r in _records(records):
            for metric, _kind, _help, get in METRICS:
                if _kind == "counter" or metric == "flatcomm_step":
                    continue
                v = get(r)
                if v is not None:
                    tag = f"flatcomm/{r.name or 'all'}/{metric[len('flatcomm_'):]}"
                    self.writer.add_scalar(tag, float(v), global_step=r.step)
            self.writer.add_scalar(f"flatcomm/{r.name or 'all'}/wire_bytes", float(r.wire_bytes),
                                   global_step=r.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class PrometheusExporter(_Exporter):
    """Counters and gauges of :data:`METRICS` (labels ``name, codec, kind, world``) in a
    ``prometheus_client`` registry (default: ``prometheus_client.REGISTRY``; serve it with
    ``prometheus_client.start_http_server``). Needs the ``prometheus_client`` package."""

    def __init__(self, registry=None):
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise _missing("prometheus_client", "PrometheusExporter") from e
        self.registry = pc.REGISTRY if registry is None else registry
        self._metrics = {}
        for metric, kind, help_, _get in METRICS:
            cls = pc.Counter if kind == "counter" else pc.Gauge
            self._metrics[metric] = cls(metric, help_, list(LABELS), registry=self.registry)

    def write(self, records: Iterable[RecordLike]) -> None:
        for r in _records(records):
            labels = _labels(r)
            for metric, kind, _help, get in METRICS:
                v = get(r)
                if v is None:
                    continue
                m = self._metrics[metric].labels(*labels)
                if kind == "counter":
                    m.inc(float(v))
                else:
                    m.set(float(v))

    def close(self) -> None:
        for m in self._metrics.values():
            try:
                self.registry.unregister(m)
            except (KeyError, AttributeError):
                pass
        self._metrics = {}


# ---- Prometheus text exposition format (no dependency) -----------------------------------------------

METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _escape_label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _fmt(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def prometheus_text(records: Iterable[RecordLike]) -> str:
    """The records in the Prometheus text exposition format (version 0.0.4).

    One sample per metric and label set ``name, codec, kind, world``: counters are summed over the
    records, gauges hold the last record's value. Metrics without a value are left out.
    """
    recs = _records(records)
    lines: List[str] = []
    for metric, kind, help_, get in METRICS:
        samples: Dict[tuple, float] = {}
        for r in recs:
            v = get(r)
            if v is None:
                continue
            key = _labels(r)
            samples[key] = samples.get(key, 0.0) + float(v) if kind == "counter" else float(v)
        if not samples:
            continue
        lines.append(f"# HELP {metric} {_escape_help(help_)}")
        lines.append(f"# TYPE {metric} {kind}")
        for key, v in samples.items():
            lab = ",".join(f'{k}="{_escape_label(x)}"' for k, x in zip(LABELS, key))
            lines.append(f"{metric}{{{lab}}} {_fmt(v)}")
    return "\n".join(lines) + "\n" if lines else ""
