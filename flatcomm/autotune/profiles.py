"""Profiles: a measured :class:`~flatcomm.autotune.CostModel` saved as JSON, so that ``codec="auto"``
makes the same decisions on every run (``Tuner(profile=path)``; ``python -m flatcomm.tune --save``)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Union

from ..ops.codecs import PRECISION
from .costs import CostModel

__all__ = ["PROFILE_VERSION", "ProfileLike", "load_profile", "save_profile"]

PROFILE_VERSION = 1
ProfileLike = Union[str, "os.PathLike[str]", Mapping[str, Any], CostModel]


def _costs_to_json(costs: CostModel) -> dict:
    def enc(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else "-inf"
        if isinstance(v, Mapping):
            return {k: enc(x) for k, x in v.items()}
        return v
    return {f.name: enc(getattr(costs, f.name)) for f in dataclasses.fields(CostModel)}


def _costs_from_json(d: Mapping[str, Any]) -> CostModel:
    def dec(v):
        if isinstance(v, str):
            return float(v)
        if isinstance(v, Mapping):
            return {k: dec(x) for k, x in v.items()}
        return v
    names = {f.name for f in dataclasses.fields(CostModel)}
    unknown = set(d) - names
    missing = {"link_Bps", "latency_s", "compute_Bps"} - set(d)
    if unknown or missing:
        raise ValueError(f"flatcomm: profile costs: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    costs = CostModel(**{k: dec(v) for k, v in d.items()})
    for c in costs.compute_Bps:
        if c not in PRECISION:
            raise ValueError(f"flatcomm: profile costs name an unknown codec {c!r}")
    return costs


def save_profile(path: Union[str, "os.PathLike[str]"], costs: CostModel, **meta: Any) -> dict:
    """Write ``costs`` (and ``meta``: world size, link, ...) as a JSON profile; returns the document."""
    doc = {"flatcomm_profile": PROFILE_VERSION, "costs": _costs_to_json(costs), **meta}
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, path)
    return doc


def load_profile(profile: ProfileLike) -> CostModel:
    """A :class:`CostModel` from a profile path, its parsed document, or a CostModel itself."""
    if isinstance(profile, CostModel):
        return profile
    if isinstance(profile, Mapping):
        doc = profile
    else:
        try:
            with open(profile) as fh:
                doc = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"flatcomm: cannot read profile {os.fspath(profile)!r}: {e}") from e
    if doc.get("flatcomm_profile") != PROFILE_VERSION or "costs" not in doc:
        raise ValueError(f"flatcomm: not a flatcomm profile (version {PROFILE_VERSION}); write one with "
                         f"`python -m flatcomm.tune --save PATH`")
    return _costs_from_json(doc["costs"])
