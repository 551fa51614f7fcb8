"""codec="auto" that never loses: the backend's own all-reduce as a candidate where the caller did
not ask for determinism, saved profiles (the same decisions every run), decisions agreed across
ranks and logged once."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from flatcomm.tools import spawn
from flatcomm.autotune import BACKEND, CostModel, Tuner, decide, load_profile, predict, save_profile

GB = 1e9


def _costs(backend_Bps, link=1 * GB, compute=2 * GB):
    return CostModel(link_Bps=link, latency_s=5e-5, compute_Bps={"fp32": 4 * GB, "bf16": compute, "int8": compute,
                                                                  "int4": compute, "sign": compute},
                     backend_Bps=backend_Bps, backend_latency_s=1e-4)


def test_backend_only_when_determinism_not_asked():
    c = _costs(backend_Bps=50 * GB)  # the backend is far faster than anything flatcomm predicts
    n, w = 25_000_000, 2
    assert decide(c, n, w, "sign", deterministic=False).codec == BACKEND
    d = decide(c, n, w, "sign")  # deterministic by default: flatcomm's own collectives only
    assert d.codec != BACKEND and BACKEND not in d.predicted_s
    assert predict(c, BACKEND, n, w) == pytest.approx(1e-4 + 4 * n / (50 * GB))
    no_backend = CostModel(c.link_Bps, c.latency_s, c.compute_Bps)  # not measured: never a candidate
    assert decide(no_backend, n, w, "sign", deterministic=False).codec != BACKEND
    assert decide(c, n, 1, "sign", deterministic=False).codec != BACKEND  # one rank: nothing to send
    with pytest.raises(ValueError, match="backend"):
        predict(c, BACKEND, n, w, "reduce_scatter")


def test_compression_must_beat_the_backend_by_more_than_the_near_tie():
    n, w = 25_000_000, 2
    base = _costs(backend_Bps=1 * GB)
    best = min(predict(base, k, n, w) for k in ("bf16", "int8", "int4", "sign"))
    for factor, expect_backend in ((0.97, True), (1.03, True), (1.2, False)):
        # backend time = factor x the best codec's: within 5% it still wins (it ranks first)
        t = best * factor
        c = _costs(backend_Bps=4 * n / (t - 1e-4))
        d = decide(c, n, w, "sign", deterministic=False)
        assert (d.codec == BACKEND) == expect_backend, (factor, d.reason)


def test_profile_roundtrip_gives_the_same_decisions(tmp_path):
    c = CostModel(link_Bps=1.2e8, latency_s=3e-4, compute_Bps={"fp32": math.inf, "int8": 3e9, "int4": 3.5e9},
                  rs_compute_Bps={"fp32": math.inf, "int8": 6e9, "int4": 7e9}, backend_Bps=2e8,
                  backend_latency_s=1e-3)
    p = tmp_path / "profile.json"
    doc = save_profile(p, c, world=2, link="1gbit")
    assert doc["world"] == 2 and load_profile(p) == c and load_profile(doc) == c  # inf survives JSON
    sizes = [256, 1 << 16, 1 << 20, 25_000_000]
    for det in (True, False):
        a = [Tuner("int4", costs=c).choose(n, deterministic=det) for n in sizes]
        b = [Tuner("int4", profile=p).choose(n, deterministic=det) for n in sizes]
        assert a == b
    bad = tmp_path / "bad.json"
    bad.write_text('{"costs": {}}')
    with pytest.raises(ValueError, match="not a flatcomm profile"):
        Tuner(profile=bad)
    bad.write_text('{"flatcomm_profile": 1, "costs": {"link_Bps": 1, "latency_s": 0, "compute_Bps": {"int9": 1}}}')
    with pytest.raises(ValueError, match="int9"):
        load_profile(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not both"):
        Tuner(costs=c, profile=p)


def test_each_decision_logged_once(caplog):
    t = Tuner("int8", costs=_costs(backend_Bps=1 * GB))
    with caplog.at_level(logging.INFO, logger="flatcomm.autotune"):
        for _ in range(3):
            t.choose(1 << 20, key="bucket0")
        t.choose(1 << 20, key="bucket0", deterministic=False)
    msgs = [r.getMessage() for r in caplog.records if r.name == "flatcomm.autotune"]
    assert len(msgs) == 2 and all("bucket0" in m for m in msgs)


# ---- across ranks ------------------------------------------------------------------------------------


def _disagree_rank(rank, world):
    fast = _costs(backend_Bps=50 * GB, link=100 * GB)  # rank 0: fp32 wins
    slow = _costs(backend_Bps=50 * GB, link=0.01 * GB)  # rank 1: compression wins
    t = Tuner("int8", costs=fast if rank == 0 else slow)
    try:
        t.choose(1 << 22)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_profiles_get_an_error_not_a_hang():
    errs = spawn.run(2, _disagree_rank, timeout_s=60)
    assert all(e is not None and "disagree" in e for e in errs)


def _ddp_rank(rank, world, which):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(), torch.nn.Linear(300, 5))
    ddp = DDP(net)
    state = None
    if which != "torch":
        mode = {"auto": None, "auto-ordered": "ordered"}[which]
        state = fddp.register(ddp, "auto", mode=mode, tuner=Tuner("int8", costs=_costs(backend_Bps=50 * GB)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if state is None:
        return params, None
    st = state.stats
    return params, {"decisions": [d["codec"] for d in st["decisions"]],
                    "buckets": [b["codec"] for s in st["steps"] for b in s["buckets"]],
                    "wire": [s["wire_bytes"] for s in st["steps"]]}


def _ddp_all(rank, world):
    return {w: _ddp_rank(rank, world, w) for w in ("torch", "auto", "auto-ordered")}


def test_ddp_auto_hands_buckets_to_the_backend_unless_determinism_is_asked():
    res = spawn.run(2, _ddp_all, timeout_s=300)
    for r in res:
        p_torch, _ = r["torch"]
        p_auto, st = r["auto"]
        assert set(st["decisions"]) == {BACKEND} and set(st["buckets"]) == {BACKEND}  # (rebuild: 2 keys)
        assert torch.equal(p_auto, p_torch)  # exactly torch's default hook
        assert all(w > 0 for w in st["wire"])
        _, st_det = r["auto-ordered"]
        assert BACKEND not in st_det["decisions"] and BACKEND not in st_det["buckets"]
    assert torch.equal(res[0]["auto"][0], res[1]["auto"][0])


def test_one_warning_per_outcome(caplog):
    """DDP's buckets (and its first-iteration layout) mostly decide alike: a run prints each
    outcome once at WARNING, every decision still at INFO."""
    t = Tuner("int8", costs=_costs(backend_Bps=1 * GB))
    with caplog.at_level(logging.INFO, logger="flatcomm.autotune"):
        for n in (1 << 20, (1 << 20) + 256, (1 << 20) + 512):
            t.choose(n, deterministic=False)
    recs = [r for r in caplog.records if r.name == "flatcomm.autotune"]
    assert len(recs) == 3
    assert [r.levelno for r in recs] == [logging.WARNING, logging.INFO, logging.INFO]
    quiet = Tuner("int8", costs=_costs(backend_Bps=1 * GB), verbose=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flatcomm.autotune"):
        quiet.choose(1 << 20, deterministic=False)
    assert [r.levelno for r in caplog.records if r.name == "flatcomm.autotune"] == [logging.INFO]
