"""flatcomm._training.residual_store.Store: residuals owned by parameters, one flat buffer per group (shared by
the DDP hook and the FSDP backends). Regrouping moves every parameter's values, loaded values fill
a group once, emptied groups are freed, nothing is lost or duplicated."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple

import pytest
import torch

from flatcomm._training.residual_store import Store


@dataclasses.dataclass
class _Slot:
    buf: torch.Tensor
    layout: List[Tuple[Any, int, int]]


def _group(store, pieces, name_of=str):
    key = tuple(n for n, _ in pieces)
    hit = store.get(key)
    if hit is not None:
        return hit
    layout, off = [], 0
    for n, c in pieces:
        layout.append((n, off, c))
        off += c
    slot = _Slot(torch.zeros(off, dtype=torch.float64), layout)

    def move(old, ooff, oc, off, c):
        slot.buf[off:off + c] = old.buf[ooff:ooff + oc]

    def load(t, name, off, c):
        slot.buf[off:off + c] = t

    return store.place(key, slot, move, load, name_of)


def _values(store, names):
    out = {}
    for n in names:
        loc = store.locate(n)
        out[n] = None if loc is None else loc[0].buf[loc[1]:loc[1] + loc[2]].clone()
    return out


def test_regrouping_moves_each_parameter_and_frees_empty_groups():
    g = torch.Generator().manual_seed(7)
    sizes = {"a": 3, "b": 5, "c": 1, "d": 4}
    st: Store = Store()
    s1 = _group(st, [("a", 3), ("b", 5)])
    s2 = _group(st, [("c", 1), ("d", 4)])
    s1.buf.copy_(torch.randn(8, generator=g, dtype=torch.float64))
    s2.buf.copy_(torch.randn(5, generator=g, dtype=torch.float64))
    before = _values(st, sizes)
    # a new grouping that takes from both old groups, in another order (a bucket rebuild / a split)
    _group(st, [("d", 4), ("a", 3)])
    _group(st, [("b", 5)])
    assert len(st.slots) == 3  # ("c", "d") still holds c
    _group(st, [("c", 1)])
    assert sorted(st.slots) == [("b",), ("c",), ("d", "a")]  # emptied groups are gone
    after = _values(st, sizes)
    for n in sizes:
        assert torch.equal(after[n], before[n]), n
    assert st.holds(["a"]) and not st.holds(["zz"], ["zz"])


def test_loaded_residuals_fill_a_group_once_then_forget_drops_it():
    st: Store = Store()
    st.clear({"x": torch.full((2,), 3.0, dtype=torch.float64)})
    assert st.holds(["x"], ["x"]) and not st.placed("x")
    s = _group(st, [("x", 2), ("y", 1)])
    assert s.buf.tolist() == [3.0, 3.0, 0.0] and not st.pending
    st.forget(("x", "y"))  # sent losslessly: nothing left anywhere
    assert st.locate("x") is None and not st.holds(["x", "y"], ["x", "y"]) and not st.slots


def test_adopt_refuses_a_parameter_in_two_saved_groups():
    st: Store = Store()
    st.adopt(("p",), _Slot(torch.zeros(2), [("p", 0, 2)]))
    with pytest.raises(ValueError, match="two saved buckets"):
        st.adopt(("p", "q"), _Slot(torch.zeros(3), [("p", 0, 2), ("q", 2, 1)]))
