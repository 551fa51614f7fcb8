"""flatcomm.ddp.State has a declared shape: grouped __slots__, every one set by __init__."""
from __future__ import annotations

import pytest

from flatcomm.ddp import State

GROUPS = ("_OPTIONS", "_GROUPS", "_BUCKETS", "_STEP", "_STATS", "_INTERNAL")


@pytest.mark.parametrize("codec", ["int8", "fp32", "auto", "sign"])
def test_every_declared_field_is_set_and_nothing_else_can_be(codec):
    state = State(codec)
    groups = [getattr(State, g) for g in GROUPS]
    names = [n for g in groups for n in g]
    assert len(names) == len(set(names)), "a field is declared in two groups"
    assert set(State.__slots__) == set(names)
    assert not hasattr(state, "__dict__")
    for name in names:
        getattr(state, name)  # set by __init__ (an unset slot raises AttributeError)
    assert all(n.startswith("_") for n in State._INTERNAL)
    with pytest.raises(AttributeError):
        state.error_feedbak = False  # a typo is an error, not a silent new attribute
    assert (state.tuner is not None) == (codec == "auto")
