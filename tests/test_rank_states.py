"""flatcomm.rank_states: every rank's state gathered for a rank-0 saver, and loaded back per rank.

2 gloo ranks (one spawn for DDP and FSDP2 together), then 1 rank for the DDP reshard.
"""
from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn
from _support.rank_states import ddp_trained, fresh_ddp, fsdp_model, fsdp_trained, same


def _nonzero(sd) -> bool:
    return any(bool(t.any()) for t in sd["client"].values())


def _expect_unchanged(state, bad, match):
    from flatcomm import rank_states

    before = state.state_dict()
    with pytest.raises((ValueError, TypeError, KeyError), match=match):
        rank_states.load_gathered_state_dict(state, bad)
    assert same(state.state_dict(), before), f"a failed load ({match}) changed the state"


def _w_ddp_fsdp(rank, world, tmp):
    import flatcomm.ddp
    import flatcomm.fsdp
    from flatcomm import rank_states

    out = {}
    _, state = ddp_trained(rank)
    own = state.state_dict()
    assert _nonzero(own)
    gathered = rank_states.gathered_state_dict(state)
    out["gathered"] = gathered
    assert gathered["world_size"] == world and same(gathered["ranks"][rank], own)
    # dst: only that rank gets it, with the same content
    at0 = rank_states.gathered_state_dict(state, dst=0)
    assert (at0 is None) == (rank != 0) and (at0 is None or same(at0, gathered))
    # what a rank-0 saver writes and every rank reads back (weights_only)
    path = os.path.join(tmp, "gathered.pt")
    if rank == 0:
        torch.save(gathered, path)
    dist.barrier()
    loaded = torch.load(path, weights_only=True)
    fresh = fresh_ddp()
    rank_states.load_gathered_state_dict(fresh, loaded)
    assert same(fresh.state_dict()["client"], own["client"]) and same(fresh.state_dict()["server"], own["server"])

    # failed loads change nothing (the fresh state holds the loaded residuals now)
    nan = {**loaded, "ranks": [dict(s) for s in loaded["ranks"]]}
    name = next(iter(own["client"]))
    nan["ranks"][rank]["client"] = {**nan["ranks"][rank]["client"], name: torch.full_like(own["client"][name], float("nan"))}
    _expect_unchanged(fresh, nan, "inf/NaN")
    # other residuals and a bad field read late: nothing of the residuals may stick
    bad_step = {**loaded, "ranks": [{**s, "step": "three", "client": {n: t * 2 for n, t in s["client"].items()}}
                                    for s in loaded["ranks"]]}
    _expect_unchanged(fresh, bad_step, "step")
    swapped = {**loaded, "ranks": list(reversed(loaded["ranks"]))}
    _expect_unchanged(fresh, swapped, "rank")
    _expect_unchanged(fresh, {**loaded, "ranks": loaded["ranks"][:1]}, "must hold 2")
    _expect_unchanged(fresh, {**loaded, "format": "x"}, "not a gathered flatcomm state")
    _expect_unchanged(fresh, {**loaded, "kind": "fsdp"}, "'fsdp' state")
    _expect_unchanged(fresh, [1, 2], "a dict")
    other_codec = fresh_ddp("int4")
    _expect_unchanged(other_codec, loaded, "codec")

    # one rank's state_dict() fails: every rank raises, naming it
    class Broken(flatcomm.ddp.State):
        def state_dict(self):
            raise RuntimeError("disk on fire")
    broken = Broken("int8") if rank == 1 else state
    with pytest.raises(RuntimeError, match="disk on fire" if rank == 1 else r"rank\(s\) \[1\] failed.*disk on fire"):
        rank_states.gathered_state_dict(broken)
    with pytest.raises(RuntimeError, match="disk on fire"):  # with dst too: rank 0 is told as well
        rank_states.gathered_state_dict(broken, dst=1)
    # ... and the group still works for the next gather
    assert same(rank_states.gathered_state_dict(state)["ranks"][rank], own)

    # FSDP2: rank-keyed residuals, same world size only
    _, rs = fsdp_trained(rank)
    fs_own = rs.state_dict()
    assert any(bool(t.any()) for t in fs_own.values())
    fs_gathered = rank_states.gathered_state_dict(rs)
    assert fs_gathered["kind"] == "fsdp" and same(fs_gathered["ranks"][rank], fs_own)
    rs2 = flatcomm.fsdp.apply(fsdp_model(), "int8")
    rank_states.load_gathered_state_dict(rs2, fs_gathered)
    assert same(rs2.state_dict(), fs_own)
    before = rs2.state_dict()
    with pytest.raises(ValueError, match="per shard"):
        rank_states.load_gathered_state_dict(rs2, {**fs_gathered, "world_size": 3, "ranks": fs_gathered["ranks"]
                                                   + fs_gathered["ranks"][:1]})
    bad = [dict(s) for s in fs_gathered["ranks"]]
    k = next(k for k in bad[rank] if k.endswith(".weight"))
    bad[rank][k] = bad[rank][k][:-1]  # wrong size
    with pytest.raises(ValueError, match="values"):
        rank_states.load_gathered_state_dict(rs2, {**fs_gathered, "ranks": bad})
    assert same(rs2.state_dict(), before)
    with pytest.raises(ValueError, match="'ddp' state"):
        rank_states.load_gathered_state_dict(rs2, gathered)
    return out


def _w_reshard(rank, world, gathered):
    import flatcomm.ddp
    from flatcomm import rank_states

    state = fresh_ddp()
    rank_states.load_gathered_state_dict(state, gathered)
    return state.state_dict(), flatcomm.ddp.reshard(gathered["ranks"])


def test_gather_load_ddp_fsdp_and_reshard(tmp_path):
    r0, r1 = spawn.run(2, _w_ddp_fsdp, str(tmp_path), timeout_s=120)
    assert same(r0["gathered"], r1["gathered"])  # the same object on every rank
    # garbage that a rank-0 file could hold is refused on load; the container survives torch.load
    buf = io.BytesIO()
    torch.save(r0["gathered"], buf)
    assert same(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), r0["gathered"])
    # another world size (2 -> 1): the DDP state is resharded (the residual total is kept)
    (sd, total), = spawn.run(1, _w_reshard, r0["gathered"], timeout_s=60)
    assert sd["world_size"] == 1 and _nonzero(sd)
    for n, t in total["residual"].items():
        assert torch.equal(sd["client"][n], t), n  # one rank: client = T
