"""flatcomm.backend in exact mode: the same bits whatever the ranks' order and flat vs two-level.

One 4-rank spawn. Rank numbers are permuted by handing rank r the values of owner perm[r] (each
value set stays with one rank, only its number changes); the ordered mode on the same inputs
shows that the permutation does change a rank-ordered sum.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _support.collectives import spread_values
from _support.kernels import assert_bits_equal
from flatcomm.tools import spawn

W = 4
PERMS = ((0, 1, 2, 3), (2, 0, 3, 1), (3, 2, 1, 0))


def _exact(rank: int, world: int) -> dict:
    import flatcomm.backend as fb
    from flatcomm import Topology

    fb.configure(mode="exact")  # every group without settings of its own
    ordered = dist.new_group()
    fb.configure(ordered, mode="ordered")
    two = dist.new_group()
    fb.configure(two, topology=Topology(2, group=two))
    res: dict = {"perm": {}, "ordered": {}, "bf16": {}}
    for perm in PERMS:
        x = spread_values(perm[rank], spread=20)
        for key, group in (("perm", None), ("ordered", ordered)):
            t = x.clone()
            dist.all_reduce(t, group=group)
            res[key][perm] = t
        b = x.to(torch.bfloat16)
        dist.all_reduce(b)
        res["bf16"][perm] = b
    narrow = spread_values(rank, spread=3)
    res["narrow_in"] = narrow
    out = {}
    for key, group in (("flat", None), ("two_level", two)):
        t = narrow.clone()
        dist.all_reduce(t, group=group)
        sh = torch.empty(250)
        dist.reduce_scatter_single(sh, narrow[:1000].clone(), group=group)
        av = narrow.clone()
        dist.all_reduce(av, op=dist.ReduceOp.AVG, group=group)
        out[key] = (t, sh, av)
    res["topo"] = out
    res["two_level_flat"] = fb.settings_for(two).topology.flat
    return res


@pytest.fixture(scope="module")
def exact():
    return spawn.run(W, _exact, backend="flatcomm", timeout_s=60)


def test_exact_same_bits_with_ranks_permuted(exact):
    base = exact[0]["perm"][PERMS[0]]
    for r in exact:
        for perm in PERMS:
            assert_bits_equal(r["perm"][perm], base, f"exact, ranks permuted {perm}")
            assert_bits_equal(r["bf16"][perm], exact[0]["bf16"][PERMS[0]], f"exact bf16 {perm}")


def test_ordered_mode_does_depend_on_rank_order(exact):
    got = exact[0]["ordered"]
    assert any(not torch.equal(got[p], got[PERMS[0]]) for p in PERMS[1:]), \
        "the permutation changed no ordered sum: the exact test above proves nothing"


def test_exact_two_level_equals_flat_and_is_correctly_rounded(exact):
    assert exact[0]["two_level_flat"] is False
    rows = [r["narrow_in"] for r in exact]
    ref = sum(x.double() for x in rows)
    for r in exact:
        flat, two = r["topo"]["flat"], r["topo"]["two_level"]
        for a, b, what in zip(flat, two, ("all_reduce", "reduce_scatter", "AVG")):
            assert_bits_equal(b, a, f"2x2 vs flat {what}")
        assert_bits_equal(flat[0], ref.float(), "exact sum, correctly rounded")
        assert_bits_equal(flat[2], (ref / W).float(), "exact AVG")
    shards = torch.cat([r["topo"]["flat"][1] for r in exact])
    assert_bits_equal(shards, ref[:1000].float(), "exact reduce_scatter")
