"""flatcomm.ddp with a Topology: 4 gloo ranks as 2 nodes x 2 (one spawn, several checks)."""
from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm
import flatcomm.ddp as fddp
from flatcomm.tools import spawn

from _support.ddp import Net, _check_conserved, _data, _ef_steps, _gather64, _local_grads

WORLD = 4


def _make(codec, bucket_cap_mb=0.01, **opts):
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=bucket_cap_mb)
    return ddp, fddp.register(ddp, codec, **opts)


def _two_tier_mean(all64: torch.Tensor) -> torch.Tensor:
    """The hierarchical fp32 plan per element: node sums (local-rank order), their sum, x 1/4."""
    x = all64.float()
    return ((x[0] + x[1]) + (x[2] + x[3])) * 0.25


def _fp32_bitwise(rank, topo):
    """fp32 hierarchical DDP: every gradient equals the two-tier plan, bit for bit."""
    ddp, state = _make("fp32", topology=topo)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    bad = []
    for step in range(3):
        x, y = _data(step, rank)
        local = _local_grads(ddp.module, x, y)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        for n, p in ddp.module.named_parameters():
            want = _two_tier_mean(_gather64(local[n], WORLD))
            if not torch.equal(p.grad.view(torch.int32), want.view(torch.int32)):
                bad.append((step, n))
        opt.step()
    return {"bad": bad, "topology": state.stats["topology"]}


def _from_env(rank):
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    try:
        ddp, state = _make("int8")
        x, y = _data(0, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        with_env = state.stats["topology"]
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]
    ddp, state = _make("int8")
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    return {"with_env": with_env, "without": state.stats["topology"]}


def _ef_save(rank, topo):
    ddp, state = _make("int8", topology=topo)
    dec, true = _ef_steps(rank, WORLD, ddp, state, 5)
    sd = state.resharded_state_dict()  # the topology-independent form (a collective)
    mine = state.state_dict()  # this rank's own: loads only into the same topology
    buf = io.BytesIO()
    torch.save(sd, buf)
    nb = [len(s["buckets"]) for s in state.stats["steps"]]
    return {"dec": dec, "true": true, "sd": buf.getvalue(), "nbuckets": nb, "mine_tiered": mine["tiered"],
            "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()}}


def _ef_load(rank, topo, saved):
    """Load the hierarchical checkpoint into another bucket layout, flat and hierarchical."""
    out = {}
    for name, t in (("flat", "flat"), ("hierarchical", topo)):
        ddp, state = _make("int8", bucket_cap_mb=0.02, topology=t)
        with torch.no_grad():
            for n, p in ddp.module.named_parameters():
                p.copy_(saved["params"][n])
        state.load_state_dict(torch.load(io.BytesIO(saved["sd"]), weights_only=True))
        dec, true = _ef_steps(rank, WORLD, ddp, state, 3, step0=100)
        out[name] = {"dec": dec, "true": true, "after": state.resharded_state_dict()["residual"]}
    # this rank's own hierarchical state_dict() into a flat State: refused, naming the way out
    ddp, state = _make("int8", topology="flat")
    ddp2, src = _make("int8", topology=topo)
    _ef_steps(rank, WORLD, ddp2, src, 2)
    state.load_state_dict(src.state_dict())
    try:
        _ef_steps(rank, WORLD, ddp, state, 1)
        out["refused"] = ""
    except Exception as e:  # noqa: BLE001 - raised by the hook, inside DDP's backward
        out["refused"] = str(e)
    return out


def _w_main(rank, world):
    topo = flatcomm.Topology(local_size=2)
    saved = _ef_save(rank, topo)
    return {"fp32": _fp32_bitwise(rank, topo), "env": _from_env(rank), "ef": saved,
            "load": _ef_load(rank, topo, saved)}


@pytest.fixture(scope="module")
def runs():
    return spawn.run(WORLD, _w_main, timeout_s=90)


def test_fp32_hierarchical_matches_two_tier_plan_bitwise(runs):
    for r in range(WORLD):
        assert runs[r]["fp32"]["bad"] == [], runs[r]["fp32"]["bad"][:5]
        assert runs[r]["fp32"]["topology"] == {"nodes": 2, "local_size": 2, "hierarchical": True, "reason": ""}


def test_topology_from_torchrun_environment(runs):
    for r in range(WORLD):
        env = runs[r]["env"]
        assert env["with_env"]["hierarchical"] and env["with_env"]["local_size"] == 2
        assert not env["without"]["hierarchical"] and "LOCAL_WORLD_SIZE" in env["without"]["reason"]


def test_error_feedback_conserved_across_rebuild_and_checkpoint(runs):
    res = [runs[r]["ef"] for r in range(WORLD)]
    assert res[0]["nbuckets"][0] != res[0]["nbuckets"][1]  # the rebuild changed the layout (carry path)
    sd = torch.load(io.BytesIO(res[0]["sd"]), weights_only=True)
    assert any(t.abs().max() > 0 for t in sd["residual"].values())
    for r in range(WORLD):
        other = torch.load(io.BytesIO(res[r]["sd"]), weights_only=True)
        for n, t in sd["residual"].items():  # every rank saves the same totals
            assert torch.equal(t, other["residual"][n])
        _check_conserved(res[r]["dec"], res[r]["true"], {}, sd["residual"], f"rank {r}")


def test_per_rank_state_does_not_load_across_topologies(runs):
    for r in range(WORLD):
        assert runs[r]["ef"]["mine_tiered"] is True
        assert "hierarchical topology" in runs[r]["load"]["refused"], runs[r]["load"]["refused"]
        assert "resharded_state_dict" in runs[r]["load"]["refused"]


@pytest.mark.parametrize("into", ["flat", "hierarchical"])
def test_hierarchical_checkpoint_loads_flat_or_hierarchical(runs, into):
    sd = torch.load(io.BytesIO(runs[0]["ef"]["sd"]), weights_only=True)
    for r in range(WORLD):
        got = runs[r]["load"][into]
        _check_conserved(got["dec"], got["true"], sd["residual"], got["after"], f"{into} rank {r}")
