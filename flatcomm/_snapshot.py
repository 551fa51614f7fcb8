"""One statistics type for every front end: a typed, read-only :class:`Snapshot`.

``State.stats`` (DDP), ``rs.stats`` (FSDP), ``opt.stats`` (:mod:`flatcomm.optim`) and
``DiLoCo.stats`` and the flatcomm backend's ``flatcomm.backend.stats(group)`` all return a
:class:`Snapshot` taken when read: the same five communication
counters as :class:`flatcomm.collectives.CommStats` (``calls``, ``wire_bytes``, ``encode_s``,
``exchange_s``, ``decode_s``), which front end (``source``), and that front end's own fields in
``detail`` (DDP's steps and decisions, FSDP's decisions and weight bytes, DiLoCo's syncs and
fragments). :mod:`flatcomm.stats` turns any of them into records for its exporters.

What users read before stays readable: a snapshot is a read-only Mapping of the keys the front end's
dict had (``state.stats["steps"]``, ``outer.stats["syncs"]``), its detail fields read as attributes
too (``rs.stats.decisions``), and :meth:`Snapshot.as_dict` gives a plain dict.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, Iterator, Mapping

__all__ = ["COUNTERS", "Snapshot"]

COUNTERS = ("calls", "wire_bytes", "encode_s", "exchange_s", "decode_s")  # CommStats' fields


@dataclasses.dataclass(frozen=True)
class Snapshot(Mapping[str, Any]):
    """A front end's statistics when read (see the module docstring).

    Args:
        source: ``"ddp"``, ``"fsdp"``, ``"optim"``, ``"diloco"`` or ``"backend"``.
        calls: collectives this rank ran.
        wire_bytes: bytes this rank put on the wire.
        encode_s: seconds encoding.
        exchange_s: seconds waiting for the network.
        decode_s: seconds decoding (and summing).
        detail: the front end's own fields (read-only; also the Mapping's keys).

    Example::

        snap = state.stats                      # a flatcomm.ddp State
        snap.wire_bytes, snap.source            # typed fields, the same on every front end
        snap["steps"][-1]["compression"]        # the DDP-specific detail, as before
    """

    source: str
    calls: int = 0
    wire_bytes: int = 0
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", types.MappingProxyType(dict(self.detail)))

    @classmethod
    def of(cls, source: str, counters: Any, detail: Mapping[str, Any]) -> "Snapshot":
        """A snapshot of ``counters`` (anything with CommStats' fields) and ``detail``."""
        return cls(source, **{f: getattr(counters, f) for f in COUNTERS}, detail=detail)

    # ---- the Mapping of the detail keys (what the front ends' dicts held) ---------------------------

    def __getitem__(self, key: str) -> Any:
        return self.detail[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.detail)

    def __len__(self) -> int:
        return len(self.detail)

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not fields: the detail's, as attributes (rs.stats.decisions)
        detail = self.__dict__.get("detail", {})
        if name in detail:
            return detail[name]
        raise AttributeError(f"{type(self).__name__} of {self.__dict__.get('source')!r} has no field {name!r}")

    def __reduce__(self):
        # (the read-only proxy does not pickle; a snapshot crosses processes, e.g. from spawned ranks)
        return type(self), (self.source, *(getattr(self, f) for f in COUNTERS), dict(self.detail))

    def as_dict(self) -> Dict[str, Any]:
        """The detail as a plain dict (the shape the front end's ``stats`` dict had)."""
        return dict(self.detail)

    def counters(self) -> Dict[str, Any]:
        """The five communication counters by name."""
        return {f: getattr(self, f) for f in COUNTERS}

    __hash__ = None  # type: ignore[assignment]  # (Mapping equality; a snapshot is not a key)
