"""Unchanged torch training scripts on init_process_group("flatcomm"): DDP, FSDP2 (+HSDP), DTensor,
functional collectives under torch.compile, and flatcomm.reproducible through the backend alone.

One 4-rank spawn runs every script; the same DDP and FSDP2 scripts also run on a gloo group, where
the bucketing / wrapping changes the weights' bits.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from _support.kernels import assert_bits_equal
from flatcomm.tools import spawn

W = 4


def _mlp(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def _batch(step: int, rank: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 64, generator=g) * 3, torch.randint(0, 10, (n,), generator=g)


def _ddp_script(rank: int, bucket_cap_mb: float, group=None) -> dict:
    """A plain DDP loop that also averages its loss with dist.all_reduce (SUM / world, as on gloo)."""
    model = torch.nn.parallel.DistributedDataParallel(_mlp(640), bucket_cap_mb=bucket_cap_mb, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(3):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=group)
        losses.append(avg / dist.get_world_size(group))
    return {"weights": [p.detach().clone() for p in model.parameters()], "loss": torch.stack(losses)}


def _fsdp_script(rank: int, per_layer: bool, mp: bool, mesh=None) -> list:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _mlp(96)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    if per_layer:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _dtensor(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (W,))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 33, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 33), generator=g).float())
    want = x.clone()
    dist.all_reduce(want)
    d = DTensor.from_local(x.clone(), mesh, [Partial()])
    shard = d.redistribute(mesh, [Shard(0)]).to_local().clone()
    return {"want": want, "full": d.full_tensor().clone(), "shard": shard,
            "replicate": d.redistribute(mesh, [Replicate()]).to_local().clone()}


def _compiled(rank: int) -> dict:
    import torch._dynamo

    def step(x):
        y = funcol.all_reduce(x * 2.0, "sum", dist.group.WORLD)
        dist.all_reduce(x)  # the in-place c10d call: dynamo rewrites it to a functional collective
        return funcol.wait_tensor(y) + x

    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    eager = step(x.clone())
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x.clone())
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x.clone())
    return {"eager": eager, "compiled": compiled, "graph_breaks": explained.graph_break_count}


def _reproducible(rank: int, groups) -> dict:
    from flatcomm import reproducible as rp

    rp.configure()
    out = {}
    for world, group in groups:
        if rank >= world:
            continue
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        acc = rp.ExactGradAccumulator(model, micro_batches=4, group=group)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            xb, yb = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
            for i in acc.micro_batches():
                torch.nn.functional.mse_loss(model(xb[4 * i:4 * i + 4]), yb[4 * i:4 * i + 4]).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        out[world] = [p.detach().clone() for p in model.parameters()]
    return out


def _training(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    gl = dist.new_group(backend="gloo")
    res: dict = {}
    for label, group in (("flatcomm", None), ("gloo", gl)):
        res[f"ddp_{label}"] = {cap: _ddp_script(rank, cap, group) for cap in (1, 25)}
    gloo_mesh = DeviceMesh.from_group(gl, "cpu")
    for mp in (False, True):
        res[f"fsdp_mp{mp}"] = {per: _fsdp_script(rank, per, mp) for per in (True, False)}
        res[f"fsdp_gloo_mp{mp}"] = {per: _fsdp_script(rank, per, mp, gloo_mesh) for per in (True, False)}
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    res["hsdp"] = {(per, mp): _fsdp_script(rank, per, mp, hsdp) for per in (True, False) for mp in (False, True)}
    res["dtensor"] = _dtensor(rank)
    res["compiled"] = _compiled(rank)
    # Made last: a subgroup's first float reduction names flatcomm's private copy of it after the
    # member's count of groups (torch's use_local_synchronization naming), see docs/backend.md.
    one, two = dist.new_group([0]), dist.new_group([0, 1])
    res["reproducible"] = _reproducible(rank, ((1, one), (2, two), (4, None)))
    return res


@pytest.fixture(scope="module")
def runs():
    return spawn.run(W, _training, backend="flatcomm", timeout_s=120, run_s=900)


def _all_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_ddp_same_weights_at_bucket_cap_1_and_25(runs):
    for r in runs:
        b1, b25 = r["ddp_flatcomm"][1], r["ddp_flatcomm"][25]
        for i, (x, y) in enumerate(zip(b1["weights"], b25["weights"])):
            assert_bits_equal(x, y, f"DDP param {i}")
        assert_bits_equal(b1["loss"], b25["loss"], "loss averaged with dist.all_reduce")
        assert_bits_equal(b1["weights"][0], runs[0]["ddp_flatcomm"][1]["weights"][0], "ranks agree")


def test_ddp_on_gloo_changes_with_bucket_cap(runs):
    g = runs[0]["ddp_gloo"]
    assert not _all_equal(g[1]["weights"], g[25]["weights"]), \
        "gloo's weights did not depend on bucket_cap_mb here: the test above proves nothing"


@pytest.mark.parametrize("mp", [False, True])
def test_fsdp2_per_layer_equals_whole_model(runs, mp):
    for r in runs:
        per, whole = r[f"fsdp_mp{mp}"][True], r[f"fsdp_mp{mp}"][False]
        for i, (x, y) in enumerate(zip(per, whole)):
            assert_bits_equal(x, y, f"FSDP2 mp={mp} param {i}")


def test_fsdp2_on_gloo_changes_with_wrapping(runs):
    diffs = [not _all_equal(runs[0][f"fsdp_gloo_mp{mp}"][True], runs[0][f"fsdp_gloo_mp{mp}"][False])
             for mp in (False, True)]
    assert any(diffs), "gloo's FSDP2 weights did not depend on the wrapping: the test above proves nothing"


@pytest.mark.parametrize("mp", [False, True])
def test_hsdp_per_layer_equals_whole_model(runs, mp):
    for r in runs:
        for i, (x, y) in enumerate(zip(r["hsdp"][(True, mp)], r["hsdp"][(False, mp)])):
            assert_bits_equal(x, y, f"HSDP mp={mp} param {i}")


def test_dtensor_full_tensor_and_redistribute(runs):
    for rank, r in enumerate(runs):
        d = r["dtensor"]
        assert_bits_equal(d["full"], d["want"], "full_tensor")
        assert_bits_equal(d["replicate"], d["want"], "Partial -> Replicate")
        assert_bits_equal(d["shard"], d["want"][2 * rank:2 * rank + 2], "Partial -> Shard(0)")


def test_compiled_step_runs_on_it_without_graph_breaks(runs):
    for r in runs:
        c = r["compiled"]
        assert c["graph_breaks"] == 0
        assert_bits_equal(c["compiled"], c["eager"], "torch.compile(aot_eager) vs eager")


def test_reproducible_same_weights_on_1_2_4_ranks(runs):
    got = runs[0]["reproducible"]
    for world in (2, 4):
        for i, (x, y) in enumerate(zip(got[1], got[world])):
            assert_bits_equal(y, x, f"{world} ranks vs 1, param {i}")
