"""flatcomm.fsdp keep_fp32= (parameters sent in lossless fp32, no residual) and the codec="auto"
backoff on measured error (FSDP2 and FSDP1), with residuals and decisions in checkpoints."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn

from _support.fsdp import _grads, _loss, _Tiny, _wrap


def _small(name):
    return name.endswith("bias") or "norm" in name or "emb" in name


def _step(model, rank, s):
    model.zero_grad()
    _loss(model, rank, s).backward()
    return _grads(model)


def _w_keep(rank, world):
    from flatcomm.fsdp import apply

    out = {}
    torch.manual_seed(0)
    ref = _wrap(_Tiny())
    apply(ref, "fp32")
    torch.manual_seed(0)
    model = _wrap(_Tiny())
    keep = lambda n, p: _small(n)  # noqa: E731
    rs = apply(model, "int8", keep_fp32=keep)
    g_ref, g = _step(ref, rank, 0), _step(model, rank, 0)
    out["kept_exact"] = all(torch.equal(g[n], g_ref[n]) for n in g if _small(n))
    out["rest_lossy"] = any(not torch.equal(g[n], g_ref[n]) for n in g if not _small(n))
    out["rest_close"] = max(float((g[n] - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-6))
                            for n in g if not _small(n))
    _step(model, rank, 1)
    sd = rs.state_dict()
    p = f"rank{rank}."
    out["kept_zero"] = all(not v.any() for k, v in sd.items() if _small(k[len(p):]))
    out["rest_held"] = all(v.any() for k, v in sd.items() if not _small(k[len(p):]))
    out["keys"] = sorted(sd)

    # a checkpoint saved without exceptions, loaded with them: the kept parameters' residuals are
    # sent once by the fp32 encode (then zero), the others carry on; nothing is dropped
    torch.manual_seed(0)
    plain = _wrap(_Tiny())
    rs_plain = apply(plain, "int8")
    _step(plain, rank, 0)
    saved = rs_plain.state_dict()
    torch.manual_seed(0)
    m2 = _wrap(_Tiny())
    rs2 = apply(m2, "int8", keep_fp32=keep)
    rs2.load_state_dict(saved)
    back = rs2.state_dict()
    out["loaded_equal"] = sorted(back) == sorted(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    _step(m2, rank, 1)
    after = rs2.state_dict()
    out["after_kept_zero"] = all(not v.any() for k, v in after.items() if _small(k[len(p):]))
    out["after_rest_held"] = all(v.any() for k, v in after.items() if not _small(k[len(p):]))

    # async_op=True on a group that is split (side: weight with the codec, bias kept)
    comm = rs2.for_module(m2.side, m2)
    total = sum(c for _, c in comm.layout)
    x = torch.randn(world * total, generator=torch.Generator().manual_seed(rank))
    o = torch.empty(total)
    h = comm(o, x, None, dist.ReduceOp.AVG, async_op=True)
    out["async_ok"] = h is not None and h.wait() is o and bool(torch.isfinite(o).all())
    return out


def test_fsdp2_keep_fp32_sends_kept_parameters_exactly_and_carries_residuals_across_the_switch():
    for r in spawn.run(2, _w_keep, timeout_s=240):
        assert r["kept_exact"], "kept parameters must reduce like the lossless fp32 backend, bit for bit"
        assert r["rest_lossy"] and r["rest_close"] < 0.05, r["rest_close"]
        assert r["kept_zero"] and r["rest_held"]
        assert r["loaded_equal"], "the loaded residuals must come back unchanged before a step"
        assert r["after_kept_zero"] and r["after_rest_held"]
        assert r["async_ok"]


def _w_backoff(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from flatcomm.autotune import Tuner
    from flatcomm._training.adapt import Backoff
    from flatcomm.fsdp import FSDP1State, apply, fsdp1_hook

    out = {}
    torch.manual_seed(0)
    model = _wrap(_Tiny())
    # sign pinned (bypasses the budget), budget int8: the measured error must send it back up
    rs = apply(model, "auto", tuner=Tuner("int8", pinned={"-": "sign"}), backoff=Backoff(every=2))
    for s in range(6):
        _step(model, rank, s)
    out["adapt"] = [(a["kind"], a["numel"], a["from"], a["to"], a["step"]) for a in rs.adaptations]
    out["why"] = [a["why"] for a in rs.adaptations]
    out["codecs"] = sorted({d.codec for d in rs.decisions.values()})
    sd = rs.state_dict()
    out["saved"] = sd[f"rank{rank}.__decisions__"].tolist()
    torch.manual_seed(0)
    m2 = _wrap(_Tiny())
    rs2 = apply(m2, "auto", tuner=Tuner("int8", pinned={"-": "sign"}), backoff=Backoff(every=2))
    rs2.load_state_dict(sd)
    out["restored"] = {k: d.codec for k, d in rs2.decisions.items()} == {k: d.codec for k, d in rs.decisions.items()}
    out["roundtrip"] = all(torch.equal(rs2.state_dict()[k], v) for k, v in sd.items())
    _step(m2, rank, 6)
    out["no_sign_after_load"] = "sign" not in {d.codec for d in rs2.decisions.values()}

    torch.manual_seed(0)
    fsdp = FSDP(_Tiny(), device_id=torch.device("cpu"), use_orig_params=True)
    st = FSDP1State("auto", model=fsdp, tuner=Tuner("int8", pinned={"-": "sign"}), backoff=Backoff(every=2))
    fsdp.register_comm_hook(st, fsdp1_hook)
    for s in range(5):
        fsdp.zero_grad()
        _loss(fsdp, rank, s).backward()
    out["fsdp1_adapt"] = [(a["from"], a["to"], a["step"]) for a in st.adaptations]
    return out


def test_fsdp_auto_backs_off_on_measured_error_the_same_on_every_rank_and_checkpoints_it():
    r0, r1 = spawn.run(2, _w_backoff, timeout_s=300)
    assert r0["adapt"] == r1["adapt"], "ranks must decide the same moves"
    assert r0["adapt"] and r0["adapt"][0][2:] == ("sign", "int4", 2), r0["adapt"]
    assert all("budget int8" in w or "residual" in w for w in r0["why"])
    assert "sign" not in r0["codecs"], r0["codecs"]
    assert r0["saved"] and all(len(row) == 4 for row in r0["saved"])
    assert r0["restored"] and r0["roundtrip"] and r0["no_sign_after_load"]
    assert r0["fsdp1_adapt"] == r1["fsdp1_adapt"] and r0["fsdp1_adapt"], r0["fsdp1_adapt"]
    assert r0["fsdp1_adapt"][0][:2] == ("sign", "int4")


@pytest.mark.parametrize("kw, err", [({"keep_fp32": 3}, TypeError), ({"keep_fp32": "big"}, TypeError),
                                     ({"backoff": 3}, TypeError)])
def test_fsdp_keep_and_backoff_reject_bad_values(kw, err):
    from flatcomm.fsdp import ReduceScatter

    with pytest.raises(err, match="keep_fp32|backoff"):
        ReduceScatter("auto" if "backoff" in kw else "int8", **kw)


def test_decisions_entry_rejects_bad_tensors():
    from flatcomm.fsdp.adapt import decode

    for bad in (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(1, 4), torch.tensor([[0, 10, 99, 1]]),
                torch.tensor([[0, -1, 0, 1]]), [[0, 1, 0, 1]]):
        with pytest.raises(ValueError, match="__decisions__"):
            decode(bad, "rank0.__decisions__")


def _fsdp1(strategy, codec, **kw):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatcomm.fsdp import FSDP1State, fsdp1_hook

    torch.manual_seed(0)
    model = FSDP(_Tiny(), sharding_strategy=getattr(ShardingStrategy, strategy),
                 auto_wrap_policy=ModuleWrapPolicy({torch.nn.TransformerEncoderLayer}),
                 device_id=torch.device("cpu"), use_orig_params=True)
    state = FSDP1State(codec, model=model, **kw)
    model.register_comm_hook(state, fsdp1_hook)
    return model, state


def _grads1(model, rank, s):
    model.zero_grad()
    _loss(model, rank, s).backward()
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _w_keep1(rank, world, strategy):
    out = {}
    ref, _ = _fsdp1(strategy, "fp32")
    model, st = _fsdp1(strategy, "int8", keep_fp32="small")
    g_ref, g = _grads1(ref, rank, 0), _grads1(model, rank, 0)
    flat_small = {n for n, p in _Tiny().named_parameters() if p.dim() < 2}  # what "small" keeps here
    small = {n for n in g if n.replace("_fsdp_wrapped_module.", "") in flat_small}
    out["kept_exact"] = all(_same(g[n], g_ref[n]) for n in g if n in small)
    out["rest_lossy"] = any(not _same(g[n], g_ref[n]) for n in g if n not in small)
    out["finite"] = all(v is None or bool(torch.isfinite(v).all()) for v in g.values())
    _grads1(model, rank, 1)
    masks = {k[0]: m for k, m in st._masks.items()}
    out["units_split"] = sum(m is not None for m in masks.values())
    sd = st.state_dict()
    kept_zero, rest_held = True, True
    for unit, m in masks.items():
        if m is None:
            continue
        if strategy == "NO_SHARD":
            c, s = sd[f"rank{rank}.{unit}.client"], sd[f"rank{rank}.{unit}.server"]
            kept_zero &= not c[m].any() and not s[m].any()
            rest_held &= bool(c[~m].any())
        else:
            t = sd[f"rank{rank}.{unit}"]
            kept_zero &= not t[m].any()
            rest_held &= bool(t[~m].any())
    out["kept_zero"], out["rest_held"] = kept_zero, rest_held

    # saved without exceptions, loaded with them: the kept values' residuals are sent once
    plain, st_plain = _fsdp1(strategy, "int8")
    _grads1(plain, rank, 0)
    saved = st_plain.state_dict()
    m2, st2 = _fsdp1(strategy, "int8", keep_fp32="small")
    st2.load_state_dict(saved)
    out["loaded_equal"] = all(torch.equal(st2.state_dict()[k], v) for k, v in saved.items())
    _grads1(m2, rank, 1)
    after = st2.state_dict()
    ok = True
    for (unit, _), m in st2._masks.items():
        if m is None:
            continue
        keys = [f"rank{rank}.{unit}.client", f"rank{rank}.{unit}.server"] if strategy == "NO_SHARD" \
            else [f"rank{rank}.{unit}"]
        ok &= all(not after[k][m].any() for k in keys)
    out["after_kept_zero"] = ok
    return out


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_fsdp1_keep_fp32_sends_kept_values_exactly_and_keeps_the_residual_layout(strategy):
    for r in spawn.run(2, _w_keep1, strategy, timeout_s=300):
        assert r["units_split"] >= 2, r  # every unit here holds biases or norms
        assert r["kept_exact"] and r["rest_lossy"] and r["finite"], r
        assert r["kept_zero"] and r["rest_held"], r
        assert r["loaded_equal"] and r["after_kept_zero"], r


def test_fsdp1_keep_fp32_needs_the_model():
    from flatcomm.fsdp import FSDP1State

    with pytest.raises(ValueError, match="model="):
        FSDP1State("int8", keep_fp32="small")
