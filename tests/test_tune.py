"""flatcomm.tune: the pure decision on synthetic costs, pinning, and a 2-rank measured run."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn
from flatcomm.autotune import PRECISION, CostModel, Decision, Tuner, allowed, decide, predict

GB = 1e9


def _costs(link, lat=5e-6, compute=20 * GB):
    # fp32 moves no compression work: modelled as free compute; the others at `compute` B/s.
    return CostModel(link_Bps=link, latency_s=lat,
                     compute_Bps={"fp32": math.inf, **{c: compute for c in PRECISION[1:]}})


def test_precision_order_and_budget():
    assert PRECISION == ("fp32", "bf16", "int8", "int4", "sign")
    assert allowed("int4") == ("fp32", "bf16", "int8", "int4")
    assert allowed("fp32") == ("fp32",)
    with pytest.raises(ValueError):
        allowed("topk")


def test_fast_link_picks_fp32():
    d = decide(_costs(50 * GB), 1 << 22, 8, "sign")
    assert d.codec == "fp32", d.reason
    assert set(d.predicted_s) == set(PRECISION)


def test_slow_link_big_bucket_picks_most_compressed_allowed():
    c = _costs(0.125 * GB)
    n = 1 << 24
    assert decide(c, n, 8, "sign").codec == "sign"
    assert decide(c, n, 8, "int4").codec == "int4"
    assert decide(c, n, 8, "int8").codec == "int8"
    assert decide(c, n, 8, "bf16").codec == "bf16"
    assert decide(c, n, 8, "fp32").codec == "fp32"


def test_small_bucket_high_latency_picks_fp32():
    d = decide(_costs(1 * GB, lat=1e-3), 1024, 4, "sign")
    assert d.codec == "fp32", d.reason


def test_budget_respected_everywhere():
    for link in (0.01, 0.125, 1, 10, 100):
        for n in (1, 1000, 1 << 16, 1 << 22):
            for budget in PRECISION:
                d = decide(_costs(link * GB), n, 4, budget)
                assert d.codec in allowed(budget)
                assert set(d.predicted_s) == set(allowed(budget))
                assert d.predicted_s[d.codec] <= min(d.predicted_s.values()) * 1.05 + 1e-15
                assert d.chunks >= 1


def test_near_tie_goes_to_more_precise():
    # int8 and int4 equally fast: int8 (more precise) wins even though int4 is nominally faster.
    c = CostModel(link_Bps=1e15, latency_s=0.0, compute_Bps={"fp32": 1 * GB, "int8": 100 * GB, "int4": 100 * GB})
    d = decide(c, 1 << 20, 2, "int4")
    assert d.codec == "int8", d.reason
    assert d.predicted_s["int4"] <= d.predicted_s["int8"] * 1.05


def test_reason_mentions_predicted_times():
    d = decide(_costs(0.125 * GB), 1 << 22, 2, "int4")
    assert isinstance(d, Decision)
    for c in allowed("int4"):
        assert f"{c}={d.predicted_s[c] * 1e3:.3g}ms" in d.reason
    assert "int4" in d.reason and "budget=int4" in d.reason


def test_predict_terms():
    c = CostModel(link_Bps=1 * GB, latency_s=0.0, compute_Bps={"fp32": math.inf})
    # fp32, no compute: 2 * 4n * (W-1)/W bytes over the link
    n, w = 1 << 20, 4
    assert predict(c, "fp32", n, w) == pytest.approx(2 * 4 * n * (w - 1) / w / GB, rel=1e-6)


def test_tuner_pinning_without_measuring():
    t = Tuner("int8", pinned={"bucket3": "int4", "0-1000": "bf16", "100000-": "sign"})
    assert t.choose(10, key="bucket3").codec == "int4"
    assert t.choose(10).codec == "bf16"
    assert t.choose(500000).codec == "sign"
    assert "pinned" in t.choose(10).reason
    assert t.costs is None  # nothing measured
    t2 = Tuner(codec="int8")
    assert t2.choose(123).codec == "int8"
    t3 = Tuner("int4", costs=_costs(0.125 * GB))
    assert t3.choose(5000).codec in allowed("int4")  # not pinned: decided on the given costs
    with pytest.raises(ValueError):
        Tuner(pinned={"x": "nope"})


def _measure_rank(rank, world):
    t = Tuner("int4")
    decisions = [t.choose(n, group=None) for n in (256, 1 << 16, 1 << 22)]
    c = t.costs
    assert c.link_Bps > 0 and c.latency_s >= 0
    return c, decisions


def test_two_ranks_agree():
    import time
    t0 = time.monotonic()
    (c0, d0), (c1, d1) = spawn.run(2, _measure_rank, timeout_s=60)
    assert c0 == c1
    assert d0 == d1
    for d in d0:
        assert d.codec in allowed("int4")
        assert d.predicted_s and "predicted" in d.reason
    assert time.monotonic() - t0 < 20


def _ddp_auto_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DDP(net, bucket_cap_mb=0.01)
    # measured tuner: a collective inside the hook at the first bucket
    state = fddp.register(ddp, "auto", tuner=Tuner("int8"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    st = state.stats
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return st["codec"], st["decisions"], [[b["codec"] for b in s["buckets"]] for s in st["steps"]], params


def test_ddp_auto_two_ranks():
    (c0, d0, b0, p0), (c1, d1, b1, p1) = spawn.run(2, _ddp_auto_rank, timeout_s=60)
    assert c0 == c1 == "auto"
    assert [d["codec"] for d in d0] == [d["codec"] for d in d1]
    ok = allowed("int8") + ("backend",)  # register() without mode=: the backend's all-reduce competes
    assert d0 and all(d["codec"] in ok and d["reason"] for d in d0)
    assert all("predicted" in d["reason"] for d in d0)  # decided by the cost model
    assert b0 == b1 and all(all(c in ok for c in s) for s in b0)
    assert torch.equal(p0, p1)  # same bits on both ranks
