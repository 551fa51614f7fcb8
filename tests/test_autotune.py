"""codec="auto" in the collectives, the FSDP backends and DDP (residuals that move into fp32
buckets), at 2 gloo ranks in one spawn; plus the `python -m flatcomm.tune` CLI."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flatcomm as fc
from flatcomm import ErrorFeedback
from flatcomm.tools import spawn
from flatcomm.autotune import PRECISION, CostModel, Tuner, allowed, decide, load_profile, predict

from _support.buckets import _Bucket

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]


def _costs(link, lat=5e-6, compute=20 * GB):
    return CostModel(link_Bps=link, latency_s=lat,
                     compute_Bps={"fp32": math.inf, **{c: compute for c in PRECISION[1:]}})


SLOW, FAST = _costs(0.05 * GB), _costs(100 * GB)


# ---- pure ---------------------------------------------------------------------------------------------


def test_reduce_scatter_kind_is_one_stage():
    # int8 at this size runs in one chunk for both kinds (fp32 reduce-scatters always do: zero-copy)
    c = CostModel(link_Bps=1 * GB, latency_s=1e-4, compute_Bps={"int8": math.inf})
    n, w = 1 << 20, 4
    ar, rs = predict(c, "int8", n, w), predict(c, "int8", n, w, "reduce_scatter")
    assert rs == pytest.approx(ar / 2)
    with pytest.raises(ValueError):
        predict(c, "fp32", n, w, "broadcast")


def test_reduce_scatter_decisions():
    assert decide(SLOW, 1 << 22, 2, "int4", "reduce_scatter").codec == "int4"
    assert decide(FAST, 1 << 22, 2, "int4", "reduce_scatter").codec == "fp32"
    d = decide(SLOW, 1 << 22, 2, "int8", "reduce_scatter")
    assert "reduce_scatter" in d.reason and set(d.predicted_s) == set(allowed("int8"))


def test_tuner_caches_per_kind_and_numel():
    t = Tuner("int4", costs=SLOW, pinned={"0-100": "fp32"})
    a = t.choose(1 << 20)
    assert t.choose(1 << 20) is a
    assert t.choose(1 << 20, kind="reduce_scatter") is not a
    assert set(t.decisions) == {("all_reduce", 1 << 20), ("reduce_scatter", 1 << 20)}
    assert t.choose(10).codec == "fp32" and ("all_reduce", 10) not in t.decisions  # pins are not cached


# ---- on 2 ranks ---------------------------------------------------------------------------------------


def _sec_collectives(rank, world):
    out = {}
    for label, costs, budget in (("lossy", SLOW, "int4"), ("fp32", FAST, "sign")):
        tuner = Tuner(budget, costs=costs)
        x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        a, b = x.clone(), x.clone()
        ra, rb = [ErrorFeedback(torch.full((5000,), 0.01 * (rank + 1)), torch.zeros(5000)) for _ in range(2)]
        h = fc.all_reduce(a, codec="auto", tuner=tuner, residual=ra, async_op=True)
        h.wait()
        fc.all_reduce(b, codec=h.decision.codec, residual=rb)
        shard, shard_ref = torch.empty(2500), torch.empty(2500)
        r1, r2 = torch.full((5000,), 0.01), torch.full((5000,), 0.01)
        fc.reduce_scatter(shard, x, codec="auto", tuner=tuner, residual=r1)
        fc.reduce_scatter(shard_ref, x, codec=tuner.decisions[("reduce_scatter", 5000)].codec, residual=r2)
        out[label] = {"codec": h.decision.codec, "same_as_fixed": torch.equal(a, b),
                      "residual_same": torch.equal(ra.client, rb.client) and torch.equal(ra.server, rb.server),
                      "rs_codec": tuner.decisions[("reduce_scatter", 5000)].codec,
                      "rs_same": torch.equal(shard, shard_ref) and torch.equal(r1, r2), "result": a}
    # the default per-group tuner, measured: every rank makes the same choice
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))
    h = fc.all_reduce(t, codec="auto", async_op=True)
    h.wait()
    out["measured"] = {"decision": h.decision, "result": t}
    return out


def _sec_ddp_move(rank, world):
    """A parameter moves from an int8 bucket into one where auto chose fp32: its residual is added
    once (averaged gradient + T) and then freed."""
    import flatcomm.ddp as fddp

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(300))
    model.b = torch.nn.Parameter(torch.zeros(200))
    state = fddp.State("auto", model=model, tuner=Tuner(pinned={"bucket0": "int8", "bucket1": "fp32"}))
    g = torch.Generator().manual_seed(rank)
    state._launch(_Bucket(0, [model.a, model.b], [torch.randn(300, generator=g), torch.randn(200, generator=g)])).wait()
    t_before = state.total_residual()
    g2 = torch.randn(300, generator=g)
    mean = g2.clone()
    dist.all_reduce(mean)
    mean /= world
    res = state._launch(_Bucket(1, [model.a], [g2])).wait()
    after = state.total_residual()
    codecs = [[b["codec"] for b in s["buckets"]] for s in state.stats["steps"]]
    return {"T": t_before["a"], "expected": mean + t_before["a"], "got": res.clone(), "plain_mean": mean,
            "after_keys": sorted(after), "a_spent": not after["a"].any(), "b_kept": torch.equal(after["b"], t_before["b"]), "codecs": codecs}


def _sec_fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard

    import flatcomm.fsdp as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Linear(8, 8)
            self.big = torch.nn.Linear(8, 256)

        def forward(self, x):
            return self.big(torch.relu(self.small(x)))

    def run(codec, tuner=None):
        torch.manual_seed(0)
        net = Net()
        fully_shard(net.small)
        fully_shard(net.big)
        fully_shard(net)
        rs = F.apply(net, codec, tuner=tuner)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for s in range(3):
            gen = torch.Generator().manual_seed(100 * s + rank)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 256, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        params = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
        return rs, params

    out = {}
    for label, costs in (("lossy", SLOW), ("fp32", FAST)):
        rs, p_auto = run("auto", Tuner("int8", costs=costs))
        chosen = sorted({d.codec for d in rs.stats.decisions.values()})
        _, p_fixed = run(chosen[0]) if len(chosen) == 1 else (None, None)
        out[label] = {"chosen": chosen, "same_as_fixed": p_fixed is not None and all(
            torch.equal(p_auto[k], p_fixed[k]) for k in p_auto), "kinds": sorted({k for k, _ in rs.stats.decisions}),
            "reasons": [d.reason for d in rs.stats.decisions.values()], "residuals": rs.state_dict()}
    # mixed: small groups fp32, big int8 (by size); residuals only where lossy
    rs, _ = run("auto", Tuner("int8", costs=SLOW, pinned={"0-1000": "fp32"}))
    out["mixed"] = {"by_size": sorted((n, d.codec) for (_, n), d in rs.stats.decisions.items()),
                    "residual_abs": {k.split(".", 1)[1]: float(v.abs().max()) for k, v in rs.state_dict().items()}}
    return out


def _rank_main(rank, world):
    return {"collectives": _sec_collectives(rank, world), "ddp_move": _sec_ddp_move(rank, world),
            "fsdp": _sec_fsdp(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    return spawn.run(2, _rank_main, timeout_s=180)


def test_collectives_auto_lossy_and_fp32(ranks):
    r0, r1 = (r["collectives"] for r in ranks)
    assert r0["lossy"]["codec"] == r1["lossy"]["codec"] == "int4"
    assert r0["fp32"]["codec"] == r1["fp32"]["codec"] == "fp32"
    for r in (r0, r1):
        for label in ("lossy", "fp32"):
            assert r[label]["same_as_fixed"] and r[label]["residual_same"], label
            assert r[label]["rs_same"], label
        assert r["lossy"]["rs_codec"] == "int4" and r["fp32"]["rs_codec"] == "fp32"
    for label in ("lossy", "fp32"):
        assert torch.equal(r0[label]["result"], r1[label]["result"])


def test_collectives_auto_default_tuner_agrees(ranks):
    d0, d1 = (r["collectives"]["measured"]["decision"] for r in ranks)
    assert d0 == d1 and d0.codec in allowed("int8") and "predicted" in d0.reason
    assert torch.equal(ranks[0]["collectives"]["measured"]["result"], ranks[1]["collectives"]["measured"]["result"])


def test_ddp_residual_moves_into_fp32_bucket(ranks):
    for r in ranks:
        assert r["ddp_move"]["codecs"] == [["int8"], ["fp32"]]
        m = r["ddp_move"]
        assert m["T"].abs().max() > 1e-4  # int8 left something to carry
        torch.testing.assert_close(m["got"], m["expected"], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(m["got"], m["plain_mean"], rtol=1e-5, atol=1e-6)  # residual not dropped
        assert m["after_keys"] == ["a", "b"] and m["a_spent"] and m["b_kept"]  # a's residual was sent; b's kept
    assert torch.equal(ranks[0]["ddp_move"]["got"], ranks[1]["ddp_move"]["got"])


def test_fsdp_auto(ranks):
    f0, f1 = (r["fsdp"] for r in ranks)
    assert f0["lossy"]["chosen"] == ["int8"] and f0["fp32"]["chosen"] == ["fp32"]
    for f in (f0, f1):
        assert f["lossy"]["same_as_fixed"] and f["fp32"]["same_as_fixed"]
        assert f["lossy"]["kinds"] == ["reduce_scatter"]
        assert all("predicted" in why for why in f["lossy"]["reasons"])
        assert any(float(v.abs().max()) > 0 for v in f["lossy"]["residuals"].values())
        assert all(float(v.abs().max()) == 0 for v in f["fp32"]["residuals"].values())
    assert f0["mixed"]["by_size"] == f1["mixed"]["by_size"]
    codecs = dict(f0["mixed"]["by_size"])
    assert set(codecs.values()) == {"fp32", "int8"}
    big = [n for n, c in codecs.items() if c == "int8"]
    assert all(n >= 1000 for n in big)
    res = f0["mixed"]["residual_abs"]
    assert res["big.weight"] > 0 and res["small.weight"] == 0 and res["small.bias"] == 0


def test_tune_cli(tmp_path, capsys):
    from flatcomm.tools.tune import main  # in process: the ranks fork from the warm forkserver

    out = tmp_path / "tune.json"
    rc = main(["--ranks", "2", "--sizes", "4K,256K", "--budget", "int4", "--json", str(out),
               "--save", str(tmp_path / "p.json")])
    p = capsys.readouterr()
    assert rc == 0, p.out[-3000:] + p.err[-3000:]
    doc = json.loads(out.read_text())
    assert [d["numel"] for d in doc["decisions"]] == [4096, 262144]
    assert all(d["codec"] in allowed("int4") and d["reason"] for d in doc["decisions"])
    assert set(doc["decisions"][0]["predicted_s"]) == set(allowed("int4"))
    assert doc["costs"]["link_Bps"] > 0 and set(doc["pinned"].values()) <= set(allowed("int4"))
    assert "pinned={" in p.out and "int4 ms" in p.out
    ns = {}
    exec(p.out.split("pinned=", 1)[1].splitlines()[0].join(("x = ", "")), ns)  # pastes as Python
    assert Tuner(pinned=ns["x"]).choose(4096).codec == doc["decisions"][0]["codec"]
    # the saved profile reproduces the run's decisions without measuring, on the same world size
    # (this process has no group: Tuner.choose would decide for one rank, where nothing is sent)
    costs = load_profile(tmp_path / "p.json")
    assert [decide(costs, n, 2, "int4").codec for n in (4096, 262144)] == [d["codec"] for d in doc["decisions"]]


def test_fp32_goes_zero_copy_in_one_chunk_only_where_the_wire_is_not_the_bottleneck():
    n = 1 << 24  # 64 MB: several chunks by default
    fast = CostModel(link_Bps=100 * GB, latency_s=5e-6, compute_Bps={"fp32": 10 * GB})
    slow = CostModel(link_Bps=0.1 * GB, latency_s=5e-6, compute_Bps={"fp32": 10 * GB})
    d_fast, d_slow = decide(fast, n, 2, "fp32"), decide(slow, n, 2, "fp32")
    assert d_fast.codec == d_slow.codec == "fp32"
    assert d_fast.chunks == 1 and "zero-copy" in d_fast.reason
    assert d_slow.chunks > 1 and "zero-copy" not in d_slow.reason
