"""flatcomm.rank_states.load_gathered_state_dict checks every part before any rank loads its own.

Every rank holds the whole gathered container, so a corrupt part (swapped, duplicated, missing, of
another world size or kind, a wrong rank field, a NaN in another rank's residual) must make every
rank raise, and leave every rank's state as it was: a load that succeeds on one rank and fails on
another leaves the ranks with different states. 2 gloo ranks, DDP (int8), FSDP2 (int8), DiLoCo
(int4 with error feedback, two fragments, one sync in flight at the save) and a DiLoCo replica's
whole state (flatcomm.diloco.ReplicaState: the DiLoCo state, the weights, the inner optimizer's).
"""
from __future__ import annotations

import copy

import pytest
import torch

from flatcomm.tools import spawn
from _support.rank_states import ddp_trained, fresh_ddp, fsdp_model, fsdp_trained, same


def _ddp_cases(g: dict) -> dict:
    r0, r1 = g["ranks"]
    name = next(iter(r1["client"]))
    nan = {**r1, "client": {**r1["client"], name: torch.full_like(r1["client"][name], float("nan"))}}
    return {
        "swapped": {**g, "ranks": [r1, r0]},
        "duplicated": {**g, "ranks": [r0, r0]},  # rank 1's part replaced by a copy of rank 0's
        "duplicated_1": {**g, "ranks": [r1, r1]},
        "missing": {**g, "ranks": [r0]},
        "missing_part": {**g, "ranks": [r0, {}]},
        "wrong_world_size": {**g, "ranks": [r0, {**r1, "world_size": 3}]},
        "wrong_world_size_all": {**g, "world_size": 3, "ranks": [r0, r1, {**r1, "rank": 2}]},
        "wrong_kind": {**g, "ranks": [r0, {"rank1.0.weight": torch.zeros(3)}]},
        "wrong_kind_all": {**g, "kind": "fsdp"},
        "wrong_rank_field": {**g, "ranks": [r0, {**r1, "rank": 0}]},
        "nan_in_other_part": {**g, "ranks": [r0, nan]},
    }


def _fsdp_cases(g: dict, ddp_part: dict) -> dict:
    r0, r1 = g["ranks"]
    k = next(k for k in r1 if k.endswith(".weight"))
    return {
        "swapped": {**g, "ranks": [r1, r0]},
        "duplicated": {**g, "ranks": [r0, r0]},
        "missing": {**g, "ranks": [r0]},
        "missing_part": {**g, "ranks": [r0, {}]},
        "wrong_world_size": {**g, "world_size": 3, "ranks": [r0, r1, r1]},
        "wrong_kind": {**g, "ranks": [r0, ddp_part]},
        "wrong_rank_field": {**g, "ranks": [r0, {k.replace("rank1.", "rank0.", 1): v for k, v in r1.items()}]},
        "nan_in_other_part": {**g, "ranks": [r0, {**r1, k: torch.full_like(r1[k], float("nan"))}]},
    }


def _diloco_cases(g: dict, ddp_part: dict) -> dict:
    r0, r1 = g["ranks"]
    sd = r1["diloco"]
    frag = sd["fragments"][0]
    nan = {**frag, "residuals": [torch.full_like(frag["residuals"][0], float("nan"))] + frag["residuals"][1:]}
    return {
        "swapped": {**g, "ranks": [r1, r0]},
        "duplicated": {**g, "ranks": [r0, r0]},
        "missing": {**g, "ranks": [r0]},
        "missing_part": {**g, "ranks": [r0, {}]},
        "wrong_world_size": {**g, "world_size": 3, "ranks": [r0, r1, {**r1, "rank": 2}]},
        "wrong_kind": {**g, "ranks": [r0, ddp_part]},
        "wrong_rank_field": {**g, "ranks": [r0, {**r1, "rank": 0}]},
        "nan_in_other_part": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "fragments": [nan] + sd["fragments"][1:]}}]},
    }


def _replica_cases(g: dict, ddp_part: dict) -> dict:
    r0, r1 = g["ranks"]
    sd = r1["diloco"]
    w = next(iter(sd["model"]))
    adam = sd["inner_optimizer"]
    state0 = adam["state"][0]
    return {
        "swapped": {**g, "ranks": [r1, r0]},
        "missing_part": {**g, "ranks": [r0, {}]},
        "wrong_kind": {**g, "ranks": [r0, ddp_part]},
        "outer_only": {**g, "ranks": [r0, {**r1, "diloco": sd["outer"]}]},
        "nan_weight": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "model": {
            **sd["model"], w: torch.full_like(sd["model"][w], float("nan"))}}}]},
        "weight_shape": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "model": {**sd["model"], w: torch.zeros(3)}}}]},
        "missing_weight": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "model": {
            k: v for k, v in sd["model"].items() if k != w}}}]},
        "optimizer_state_shape": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "inner_optimizer": {
            **adam, "state": {**adam["state"], 0: {**state0, "exp_avg": torch.zeros(2)}}}}}]},
        "optimizer_groups": {**g, "ranks": [r0, {**r1, "diloco": {**sd, "inner_optimizer": {
            **adam, "param_groups": adam["param_groups"] * 2}}}]},
    }


def _diloco(seed: int = 0):
    from flatcomm.diloco import DiLoCo

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return net, opt, DiLoCo(net, opt, sync_every=4, codec="int4", fragments=2, fragment_sync_delay=1)


def _diloco_step(net, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + t)
    opt.zero_grad()
    net(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
    opt.step()


def _try(state, bad) -> dict:
    from flatcomm import rank_states

    before = copy.deepcopy(state.state_dict())  # (a ReplicaState's holds live tensors)
    try:
        rank_states.load_gathered_state_dict(state, bad)
        error = None
    except (ValueError, TypeError, KeyError) as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "unchanged": same(state.state_dict(), before)}


def _w(rank, world):
    import flatcomm.fsdp

    from flatcomm import rank_states

    out = {}
    _, trained = ddp_trained(rank)
    g = rank_states.gathered_state_dict(trained)
    state = fresh_ddp()
    rank_states.load_gathered_state_dict(state, g)  # the good container loads (and fills the state)
    assert same(state.state_dict(), trained.state_dict())
    out["ddp"] = {name: _try(state, bad) for name, bad in _ddp_cases(g).items()}

    _, rs = fsdp_trained(rank)
    fg = rank_states.gathered_state_dict(rs)
    rs2 = flatcomm.fsdp.apply(fsdp_model(), "int8")
    rank_states.load_gathered_state_dict(rs2, fg)
    assert same(rs2.state_dict(), rs.state_dict())
    out["fsdp"] = {name: _try(rs2, bad) for name, bad in _fsdp_cases(fg, g["ranks"][1]).items()}

    net, opt, outer = _diloco()
    for t in range(7):  # fragment 1 started its sync at step 6: in flight, drained into the save
        _diloco_step(net, opt, rank, t)
    dg = rank_states.gathered_state_dict(outer)
    saved = copy.deepcopy({"net": net.state_dict(), "opt": opt.state_dict()})
    for t in range(7, 12):
        _diloco_step(net, opt, rank, t)
    net2, opt2, outer2 = _diloco(seed=1)  # other weights: what continues must come from the loads
    out["diloco"] = {name: _try(outer2, bad) for name, bad in _diloco_cases(dg, g["ranks"][1]).items()}
    net2.load_state_dict(saved["net"])
    opt2.load_state_dict(saved["opt"])
    rank_states.load_gathered_state_dict(outer2, dg)
    for t in range(7, 12):
        _diloco_step(net2, opt2, rank, t)
    out["diloco_resumed"] = [p.detach() for p in net2.parameters()] , [p.detach() for p in net.parameters()]

    from flatcomm.diloco import ReplicaState

    net, opt, outer = _diloco()
    for t in range(7):
        _diloco_step(net, opt, rank, t)
    rg = rank_states.gathered_state_dict(ReplicaState(outer, net, opt))
    for t in range(7, 12):
        _diloco_step(net, opt, rank, t)
    net3, opt3, outer3 = _diloco(seed=1)
    _diloco_step(net3, opt3, rank, 0)  # the optimizer has state of its own to keep or replace
    replica = ReplicaState(outer3, net3, opt3)
    out["replica"] = {name: _try(replica, bad) for name, bad in _replica_cases(rg, g["ranks"][1]).items()}
    rank_states.load_gathered_state_dict(replica, rg)  # weights, optimizer and DiLoCo state in one load
    for t in range(7, 12):
        _diloco_step(net3, opt3, rank, t)
    out["replica_resumed"] = [p.detach() for p in net3.parameters()], [p.detach() for p in net.parameters()]
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn.run(2, _w, timeout_s=120)


DDP_CASES = ["swapped", "duplicated", "duplicated_1", "missing", "missing_part", "wrong_world_size",
             "wrong_world_size_all", "wrong_kind", "wrong_kind_all", "wrong_rank_field", "nan_in_other_part"]
FSDP_CASES = ["swapped", "duplicated", "missing", "missing_part", "wrong_world_size", "wrong_kind",
              "wrong_rank_field", "nan_in_other_part"]


DILOCO_CASES = FSDP_CASES
REPLICA_CASES = ["swapped", "missing_part", "wrong_kind", "outer_only", "nan_weight", "weight_shape", "missing_weight",
                 "optimizer_state_shape", "optimizer_groups"]


@pytest.mark.parametrize("kind,case", [("ddp", c) for c in DDP_CASES] + [("fsdp", c) for c in FSDP_CASES]
                         + [("diloco", c) for c in DILOCO_CASES] + [("replica", c) for c in REPLICA_CASES])
def test_a_corrupt_part_fails_on_every_rank_and_changes_nothing(ranks, kind, case):
    for rank, r in enumerate(ranks):
        got = r[kind][case]
        assert got["error"] is not None, f"rank {rank} loaded the corrupt ({case}) gathered state"
        assert got["unchanged"], f"rank {rank}: the failed load ({case}) changed the state"
    assert ranks[0][kind][case]["error"] == ranks[1][kind][case]["error"], "the ranks give different reasons"


def test_diloco_state_gathered_on_every_rank_resumes_bit_for_bit(ranks):
    """Each replica's DiLoCo state (residuals, a sync in flight) comes back to that replica from the
    one gathered container and the run continues with the uninterrupted run's bits; with a
    ReplicaState, the weights and the inner optimizer come back in the same load."""
    for rank, r in enumerate(ranks):
        for key in ("diloco_resumed", "replica_resumed"):
            resumed, straight = r[key]
            assert len(resumed) == len(straight) == 4
            for a, b in zip(resumed, straight):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rank {rank}: {key} differs"

