"""``codec="auto"``: the tuner that picks a codec (and, on a two-level topology, a path and a codec
per tier) from a measured cost model. ``measure`` times the group, ``decide`` prices and picks (pure),
``tuner`` holds the pins and the cached, agreed decisions,
``costmodel`` the cluster model they price with, ``tiers`` the two-level candidates."""
from __future__ import annotations

from ..ops.codecs import PRECISION
from .tuner import (
    BACKEND,
    KINDS,
    CostModel,
    Decision,
    Tuner,
    allowed,
    decide,
    load_profile,
    measure,
    predict,
    save_profile,
    tuner_for,
)

__all__ = ["BACKEND", "PRECISION", "KINDS", "CostModel", "Decision", "Tuner", "allowed", "decide",
           "load_profile", "measure", "predict", "save_profile", "tuner_for"]
