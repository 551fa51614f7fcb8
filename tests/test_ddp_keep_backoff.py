"""flatcomm.ddp keep_fp32= (per-parameter exceptions sent lossless, no residual) and codec="auto"
backoff (moves a bucket to a more precise codec when the error measured in training is over budget)."""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.autotune import PRECISION, Tuner
from flatcomm._training.adapt import Backoff, keep_predicate, small
from flatcomm.tools import spawn


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(23, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc = torch.nn.Linear(13, 29)
        self.out = torch.nn.Linear(29, 7, bias=False)

    def forward(self, idx):
        return self.out(torch.relu(self.fc(self.norm(self.embed(idx)))))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 23, (9,), generator=g), torch.randn(9, 7, generator=g)


def _local_mean64(net, idx, y, world):
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    torch.nn.functional.mse_loss(ref(idx), y).backward()
    out = {}
    for n, p in ref.named_parameters():
        g = p.grad.detach().double().contiguous()
        dist.all_reduce(g)
        out[n] = g / world
    return out


def _steps(ddp, state, step0, steps, world, check=False):
    kept_exact, lossy_exact = [], []
    for step in range(step0, step0 + steps):
        idx, y = _batch(step, dist.get_rank())
        want = _local_mean64(ddp.module, idx, y, world) if check else None
        ddp.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(idx), y).backward()
        state.wait()
        if check:
            for n, p in ddp.module.named_parameters():
                # two ranks: the fp32 mean is the correctly rounded float64 mean
                (kept_exact if small(n, p) else lossy_exact).append(torch.equal(p.grad, want[n].float()))
        with torch.no_grad():
            for p in ddp.module.parameters():
                p.add_(p.grad, alpha=-0.05)
    return kept_exact, lossy_exact


def _w_keep(rank, world, steps, more):
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=0.002)  # buckets that mix kept and codec parameters
    state = fddp.register(ddp, "sign", start_step=0, keep_fp32="small")
    kept, lossy = _steps(ddp, state, 0, steps, world, check=True)
    sd = state.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    _steps(ddp, state, steps, more, world)
    codecs = sorted({b["codec"] for s in state.stats["steps"] for b in s["buckets"]})
    final = {n: p.detach().clone() for n, p in net.named_parameters()}
    # the restart in the same processes (a fresh DDP and State, as a new process builds them)
    resumed = _resume(world, steps, more, buf.getvalue(), params)
    return {"kept": kept, "lossy": lossy, "sd": buf.getvalue(), "final": final, "codecs": codecs,
            "resumed": resumed}


def _resume(world, steps, more, sd_bytes, params):
    net = _Net()
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(params[n])
    ddp = DDP(net, bucket_cap_mb=0.002)
    state = fddp.register(ddp, "sign", start_step=0, keep_fp32="small")
    state.load_state_dict(torch.load(io.BytesIO(sd_bytes), weights_only=True))
    _steps(ddp, state, steps, more, world)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_keep_fp32_parameters_are_exact_the_rest_use_the_codec_and_restart_bit_for_bit():
    steps, more = 3, 3
    out = spawn.run(2, _w_keep, steps, more, timeout_s=120)
    for r in out:
        assert r["kept"] and all(r["kept"]), "keep_fp32 parameters must get the exact mean"
        assert not all(r["lossy"]), "the other parameters go through sign"
        assert r["codecs"] == ["fp32", "sign"]
        sd = torch.load(io.BytesIO(r["sd"]), weights_only=True)
        for n in ("embed.weight", "norm.weight", "norm.bias", "fc.bias"):
            assert not sd["client"][n].any() and not sd["server"][n].any(), f"{n} holds a residual"
        assert sd["client"]["fc.weight"].any()
    for r in range(2):
        for n, t in out[r]["final"].items():
            assert torch.equal(out[r]["resumed"][n], t), f"rank {r}: {n} differs after the restart"


def test_keep_fp32_spec_forms_and_bad_input():
    lin = torch.nn.Linear(3, 4)
    assert small("fc.bias", lin.bias) and not small("fc.weight", lin.weight) and small("tok_embed.w", lin.weight)
    pats = keep_predicate(["*.bias", "emb*"])
    assert pats("a.bias", lin.weight) and pats("emb.weight", lin.weight) and not pats("a.weight", lin.bias)
    assert keep_predicate(None) is None and keep_predicate("small") is small
    for bad in (5, "everything", [1, 2]):
        with pytest.raises(TypeError, match="keep_fp32"):
            fddp.State("int8", keep_fp32=bad)


def test_backoff_judges_from_the_agreed_sums_only():
    b = Backoff()
    assert b.limit("int8") == pytest.approx(3 * 0.0065)
    # sign's error (0.6) is far over an int8 budget: one step up the precision order
    mv = b.judge("sign", "int8", c_sq=0.36, v_sq=1.0, g_sq=1.0, precision=PRECISION)
    assert mv["from"] == "sign" and mv["to"] == "int4" and mv["rel_error"] == pytest.approx(0.6)
    assert b.judge("int8", "int8", 0.005 ** 2, 1.0, 1.0, PRECISION) is None
    # small per-step error but the residual outgrew the gradient: error feedback falls behind
    mv = b.judge("int4", "int4", c_sq=9.0, v_sq=1e4, g_sq=1.0, precision=PRECISION)
    assert mv["to"] == "int8" and "residual" in mv["why"]
    assert b.judge("fp32", "int8", 1.0, 1.0, 1.0, PRECISION) is None  # nothing more precise
    assert b.judge("int8", "int8", math.nan, 1.0, 1.0, PRECISION)["to"] == "bf16"
    for bad in ({"every": -1}, {"margin": 0}, {"residual_limit": math.inf}, {"every": True}):
        with pytest.raises(ValueError, match="Backoff"):
            Backoff(**bad)
    with pytest.raises(TypeError, match="backoff"):
        fddp.State("auto", backoff=3)


def _w_backoff(rank, world, steps):
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=0.002)
    # sign pinned (bypasses the budget), budget int8: the measured error must send it back up
    state = fddp.register(ddp, "auto", mode="ordered", tuner=Tuner("int8", pinned={"-": "sign"}),
                          backoff=Backoff(every=2))
    _steps(ddp, state, 0, steps, world)
    st = state.stats
    per_step = [sorted({b["codec"] for b in s["buckets"]}) for s in st["steps"]]
    sd = state.state_dict()
    return {"adapt": st["adaptations"], "decisions": st["decisions"], "per_step": per_step,
            "saved": [d[1] for d in sd["decisions"]]}


def test_auto_backs_off_when_the_measured_error_is_over_budget_the_same_on_every_rank():
    out = spawn.run(2, _w_backoff, 8, timeout_s=120)
    a0 = out[0]["adapt"]
    assert a0 == out[1]["adapt"], "ranks must decide the same moves"
    assert a0 and a0[0]["from"] == "sign" and a0[0]["to"] == "int4" and a0[0]["step"] == 2
    assert all("budget int8" in a["why"] or "residual" in a["why"] for a in a0)
    assert out[0]["per_step"][0] == ["sign"] and "sign" not in out[0]["per_step"][-1]
    assert set(out[0]["per_step"][-1]) <= {"int8", "bf16", "fp32"}  # sign and int4 are over an int8 budget
    assert all(a["bucket"] is not None and a["numel"] > 0 for a in a0)
    assert any("backed off" in d["reason"] and "measured_rel_error" in d for d in out[0]["decisions"])
    assert sorted(out[0]["saved"]) == sorted(d["codec"] for d in out[0]["decisions"])  # checkpointed
