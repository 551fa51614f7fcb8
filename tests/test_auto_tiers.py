"""Topology-aware codec="auto": flat or hierarchical and a codec per tier, priced by the same
flatcomm.autotune.costmodel that `bench scale` validates, reproducible from a profile with tier costs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flatcomm.autotune import tiers as T
from flatcomm.autotune import costmodel as M
from flatcomm.autotune import BACKEND, CostModel, Tuner, decide, load_profile, save_profile
from flatcomm.tools import spawn

GB = 1e9
FAST_COMPUTE = {"fp32": 8 * GB, "bf16": 4 * GB, "int8": 3 * GB, "int4": 3 * GB, "sign": 3 * GB}


def _tiered(inter_Bps, intra_Bps=50 * GB, nodes=2, g=4, backend_Bps=None):
    return CostModel(link_Bps=inter_Bps / g, latency_s=5e-5, compute_Bps=dict(FAST_COMPUTE),
                     backend_Bps=backend_Bps, backend_latency_s=1e-4 if backend_Bps else None,
                     nodes=nodes, ranks_per_node=g, inter_latency_s=5e-5, inter_Bps=inter_Bps,
                     intra_latency_s=5e-6, intra_Bps=intra_Bps)


def test_slow_network_picks_hierarchical_compressed_with_a_lossless_node_tier():
    c = _tiered(inter_Bps=0.125 * GB)  # 1 Gbit/s per node, 4 ranks per node
    d = decide(c, 8 << 20, 8, "int4", paths=T.PATHS)
    assert d.path == "hierarchical" and d.codec == "int4" and d.intra_codec == "fp32", d.reason
    assert d.predicted_s["hier:int4/fp32"] < d.predicted_s["int4"]  # flat int4 moves G x the bytes
    # every candidate's time is the shared model's (the tuner and `bench scale` agree)
    cl = T.cluster(c)
    k = M.best_segments(cl, 8 << 20, "int8", "fp32")  # the model's pipeline segments
    assert d.predicted_s["hier:int8/fp32"] == pytest.approx(M.hierarchical(cl, 8 << 20, "int8", "fp32", k))
    assert d.predicted_s["int8"] == pytest.approx(M.flat(cl, 8 << 20, "int8"))
    assert not any(k.startswith("hier:") and not k.endswith("/fp32") for k in d.predicted_s)  # lossless intra


def test_lossy_node_codec_only_within_both_budgets_and_never_below_the_inter_codec():
    c = _tiered(inter_Bps=0.125 * GB, intra_Bps=0.2 * GB)  # a slow node link: lossy intra can pay
    d = decide(c, 8 << 20, 8, "int4", paths=("hierarchical",), intra_budget="int8")
    intra = {k.split("/")[1] for k in d.predicted_s if k.startswith("hier:")}
    assert intra == {"fp32", "bf16", "int8"}
    assert "hier:int8/int4" not in d.predicted_s and "hier:fp32/int8" not in d.predicted_s
    assert d.path == "hierarchical" and d.intra_codec != "fp32", d.reason
    d2 = decide(c, 8 << 20, 8, "bf16", paths=("hierarchical",), intra_budget="int8")  # budget binds intra
    assert {k.split("/")[1] for k in d2.predicted_s} <= {"fp32", "bf16"}


def test_fast_network_keeps_fp32_or_steps_aside_to_the_backend():
    c = _tiered(inter_Bps=100 * GB, backend_Bps=100 * GB)
    d = decide(c, 1 << 20, 8, "sign", paths=T.PATHS)
    assert d.codec == "fp32", d.reason  # compression does not pay on a fast link
    assert decide(c, 1 << 20, 8, "sign", deterministic=False, paths=T.PATHS).path == BACKEND


def test_bad_shapes_are_clear_errors():
    c = _tiered(inter_Bps=0.125 * GB)
    with pytest.raises(ValueError, match="2 nodes x 4 ranks but the group has 4"):
        decide(c, 1 << 20, 4, "int8", paths=T.PATHS)
    with pytest.raises(ValueError, match="paths must be"):
        decide(c, 1 << 20, 8, "int8", paths=("ring",))
    with pytest.raises(ValueError, match="error_budget"):
        Tuner(intra_budget="int3")


def test_profile_keeps_tier_costs_and_replays_the_same_decisions(tmp_path):
    c = _tiered(inter_Bps=0.125 * GB)
    save_profile(tmp_path / "p.json", c, world=8)
    back = load_profile(tmp_path / "p.json")
    assert back == c and T.tiered(back)
    for n in (1 << 12, 1 << 20, 3 << 22, 24 << 20):
        assert decide(back, n, 8, "int8", paths=T.PATHS) == decide(c, n, 8, "int8", paths=T.PATHS)
    flat_only = dataclasses.replace(c, nodes=1, ranks_per_node=1, inter_Bps=None, intra_Bps=None)
    assert not T.tiered(flat_only)
    assert decide(flat_only, 1 << 20, 8, "int8", paths=T.PATHS).path == "flat"  # old profiles: flat only


def test_fixed_segments_price_and_cut_the_pipeline_as_given():
    c = _tiered(inter_Bps=1 * GB, intra_Bps=5 * GB)  # comparable tiers: the model pipelines
    n = 8 << 20
    best = decide(c, n, 8, "int8", paths=("hierarchical",))
    one = decide(c, n, 8, "int8", paths=("hierarchical",), segments=1)
    assert best.chunks > 1 and one.chunks == 1, (best.reason, one.reason)
    cl = T.cluster(c)
    assert one.predicted_s["hier:int8/fp32"] == pytest.approx(M.hierarchical(cl, n, "int8", "fp32", 1))
    assert best.predicted_s["hier:int8/fp32"] < one.predicted_s["hier:int8/fp32"]


# ---- on 4 ranks: 2 "nodes" x 2 -------------------------------------------------------------------


def _rank_main(rank, world):
    import flatcomm as fc
    from flatcomm import Topology

    topo = Topology(local_size=2)
    out = {}
    slow = _tiered(inter_Bps=0.01 * GB, nodes=2, g=2)  # hierarchical int8 predicted fastest
    fast = _tiered(inter_Bps=100 * GB, intra_Bps=100 * GB, nodes=2, g=2)  # fp32, no compression
    for label, costs in (("slow", slow), ("fast", fast)):
        tuner = Tuner("int8", costs=costs)
        x = torch.randn(3001, generator=torch.Generator().manual_seed(rank))
        a, b = x.clone(), x.clone()
        h = fc.all_reduce(a, codec="auto", tuner=tuner, topology=topo, async_op=True)
        h.wait()
        d = h.decision
        if d.path == "hierarchical":
            fc.all_reduce(b, codec=d.codec, intra_codec=d.intra_codec, topology=topo)
        else:
            fc.all_reduce(b, codec=d.codec)
        out[label] = (d.path, d.codec, d.intra_codec, torch.equal(a, b), a)
    out["ddp"] = _ddp(rank, topo, slow, _tiered(inter_Bps=0.01 * GB, nodes=2, g=2, backend_Bps=100 * GB))
    # on CPU tensors a Tuner cuts the segments flatcomm.hierarchical cuts by itself (shared cores:
    # the model's overlap does not hold), one where a lossy intra codec may be picked
    piped = _tiered(inter_Bps=1 * GB, intra_Bps=5 * GB, nodes=2, g=2)
    out["cpu_segments"] = (Tuner("int8", costs=piped).choose(8 << 20, topology=topo, paths=("hierarchical",)).chunks,
                           decide(piped, 8 << 20, 4, "int8", paths=("hierarchical",)).chunks,
                           Tuner("int8", costs=piped, intra_budget="bf16").choose(
                               8 << 20, topology=topo, paths=("hierarchical",)).chunks)
    # measured with the topology: the costs hold both tiers, agreed on every rank
    t = Tuner("int8")
    t.costs = fc.autotune.measure(None, topology=topo, numel=1 << 14, small=1 << 10, large=1 << 16, reps=1)
    d = t.choose(1 << 14, topology=topo)
    out["measured"] = (t.costs.nodes, t.costs.ranks_per_node, t.costs.inter_Bps, t.costs.intra_Bps, d.path, d.codec)
    with pytest.raises(ValueError, match="per-tier link costs"):
        Tuner("int8", costs=dataclasses.replace(slow, nodes=1, ranks_per_node=1)).choose(100, topology=topo)
    return out


def _ddp(rank, topo, slow, backend_fast):
    """register(ddp, "auto") with a hierarchical topology: the two-level model picks the inter codec
    (the same gradients as naming it), or the backend when determinism was not asked."""
    import flatcomm.ddp as fddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    grads, decisions = {}, {}
    for label, codec, costs in (("auto", "auto", slow), ("int8", "int8", None), ("open", "auto", backend_fast)):
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5)), bucket_cap_mb=0.002)
        opts = {"tuner": Tuner("int8", costs=costs)} if costs is not None else {}
        state = fddp.register(ddp, codec, topology=topo, **opts)
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank))
        ddp(x).square().mean().backward()
        grads[label] = [p.grad.clone() for p in ddp.parameters()]
        decisions[label] = sorted({(d.path, d.codec) for d in state.decisions.values()})
    same = all(torch.equal(a, b) for a, b in zip(grads["auto"], grads["int8"]))
    return {"decisions": decisions, "same_as_int8": same}


@pytest.fixture(scope="module")
def ranks():
    return spawn.run(4, _rank_main, timeout_s=180.0)


def test_collective_auto_runs_the_chosen_path_and_codecs(ranks):
    assert ranks[0]["slow"][:3] == ("hierarchical", "int8", "fp32")
    # a fast network: no compression; the path is the model's (latency decides at this size)
    fast = decide(_tiered(inter_Bps=100 * GB, intra_Bps=100 * GB, nodes=2, g=2), 3001, 4, "int8",
                  paths=T.PATHS)
    assert fast.codec == "fp32" and ranks[0]["fast"][:2] == (fast.path, "fp32")
    for r in ranks:
        for label in ("slow", "fast"):
            assert r[label][3], label  # the same bits as calling the chosen path and codecs by name
            assert torch.equal(r[label][4], ranks[0][label][4])  # and on every rank


def test_tuner_on_cpu_cuts_the_default_segments(ranks):
    from flatcomm.hierarchical import default_segments

    for r in ranks:
        assert r["cpu_segments"] == (default_segments(4 << 20, 2), 8, 1), r["cpu_segments"]
        assert default_segments(4 << 20, 2) == 4


def test_measured_costs_hold_both_tiers_on_every_rank(ranks):
    m = ranks[0]["measured"]
    assert m[0] == 2 and m[1] == 2 and m[2] > 0 and m[3] > 0
    assert all(r["measured"] == m for r in ranks)


def test_ddp_auto_with_a_topology_uses_the_two_level_model(ranks):
    for r in ranks:
        assert r["ddp"]["decisions"]["auto"] == [("hierarchical", "int8")]
        assert r["ddp"]["same_as_int8"]
        assert r["ddp"]["decisions"]["open"] == [("backend", "backend")]


def test_tune_cli_with_nodes_saves_tier_costs(tmp_path, capsys):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = subprocess.run([sys.executable, "-m", "flatcomm.tune", "--ranks", "3", "--ranks-per-node", "2"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "does not split into nodes" in bad.stderr
    prof, out = tmp_path / "p.json", tmp_path / "t.json"
    from flatcomm.tools.tune import main  # in process: the ranks fork from the warm forkserver

    rc = main(["--ranks", "4", "--ranks-per-node", "2", "--sizes", "64K", "--save", str(prof), "--json", str(out)])
    p = capsys.readouterr()
    assert rc == 0, p.out[-3000:] + p.err[-3000:]
    costs = load_profile(prof)
    assert T.tiered(costs) and (costs.nodes, costs.ranks_per_node) == (2, 2)
    d = json.loads(out.read_text())["decisions"][0]
    again = decide(costs, 1 << 16, 4, "int8", paths=T.PATHS)  # the profile replays the run's choice
    assert (again.path, again.codec, again.intra_codec) == (d["path"], d["codec"], d["intra_codec"])
    assert "hier:int8/fp32 ms" in p.out
