"""flatcomm.ddp: the DDP comm hook on 2 and 3 gloo ranks (spawned processes)."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.tools import spawn

from _support.ddp import _check_conserved, _data, _ef_steps, _gather64, _local_grads, Net

EPS32 = torch.finfo(torch.float32).eps


def _make(rank, cfg, codec="fp32", unused=False, **state_opts):
    torch.manual_seed(0)
    net = Net(unused=unused)
    ddp = DDP(net, bucket_cap_mb=cfg.get("bucket_cap_mb", 0.01), static_graph=cfg.get("static_graph", False),
              gradient_as_bucket_view=cfg.get("gradient_as_bucket_view", False),
              find_unused_parameters=unused)
    state = fddp.register(ddp, codec, **state_opts)
    return ddp, state


# ---- fp32 ordered: equals the float64 average, bitwise reproducible ------------------------------

CONFIGS = {
    "buckets": {},
    "static_graph": {"static_graph": True},
    "grad_as_bucket_view": {"gradient_as_bucket_view": True},
    "unused": {"unused": True},
}


def _w_fp32(rank, world, steps, runs):
    return [_fp32_run(rank, world, steps) for _ in range(runs)]


def _fp32_run(rank, world, steps):
    out = {}
    for name, cfg in CONFIGS.items():
        ddp, state = _make(rank, cfg, "fp32", unused=cfg.get("unused", False))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        grads, errs, nbuckets = [], [], []
        for step in range(steps):
            x, y = _data(step, rank)
            local = _local_grads(ddp.module, x, y)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            worst = 0.0
            for n, p in ddp.module.named_parameters():
                all64 = _gather64(local[n], world)
                ref, mag = all64.mean(0), all64.abs().mean(0)
                if n.startswith("unused."):
                    assert p.grad is None or not p.grad.any(), "unused parameter got a gradient"
                    continue
                err = (p.grad.double() - ref).abs()
                # fp32 ordered sum of W values, then one multiply: within (W + 1) ulps of the magnitude.
                bound = (world + 1) * EPS32 * mag + 1e-30
                worst = max(worst, float((err / bound).max()))
            errs.append(worst)
            grads.append({n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None})
            opt.step()
            nbuckets.append(len(state.stats["steps"][-1]["buckets"]))
        out[name] = {"grads": grads, "errs": errs, "params": {n: p.detach().clone()
                                                              for n, p in ddp.module.named_parameters()},
                     "nbuckets": nbuckets}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_matches_float64_average_and_is_bitwise_reproducible(world):
    # Two runs (fresh models, states and groups) in the same processes: DDP's first construction
    # imports torch._dynamo (~8 s here), so each spawn is expensive.
    steps = 3
    per_rank = spawn.run(world, _w_fp32, steps, 2 if world == 2 else 1, timeout_s=60)
    runs = [[per_rank[r][i] for r in range(world)] for i in range(len(per_rank[0]))]
    first = runs[0]
    for name in CONFIGS:
        for r in range(world):
            res = first[r][name]
            assert max(res["errs"]) <= 1.0, (name, r, res["errs"])
            # every rank holds the same bits
            for s in range(steps):
                for n, g in res["grads"][s].items():
                    assert torch.equal(g.view(torch.int32), first[0][name]["grads"][s][n].view(torch.int32))
        nb = first[0][name]["nbuckets"]
        assert max(nb[1:]) > 1, f"{name}: expected several buckets after the rebuild, got {nb}"
    if len(runs) == 2:
        for name in CONFIGS:
            for r in range(world):
                a, b = runs[0][r][name], runs[1][r][name]
                for s in range(steps):
                    for n in a["grads"][s]:
                        assert torch.equal(a["grads"][s][n].view(torch.int32), b["grads"][s][n].view(torch.int32))
                for n in a["params"]:
                    assert torch.equal(a["params"][n].view(torch.int32), b["params"][n].view(torch.int32))


# ---- error feedback: nothing is dropped across the bucket rebuild and checkpoints -----------------


def _w_ef_save(rank, world, codecs, steps):
    return {codec: _ef_save(rank, world, codec, steps) for codec in codecs}


def _ef_save(rank, world, codec, steps):
    ddp, state = _make(rank, {}, codec, start_step=0)  # the codec from step 0, not its warm-up
    dec, true = _ef_steps(rank, world, ddp, state, steps)
    sd = state.resharded_state_dict()
    per_rank = state.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    nb = [len(s["buckets"]) for s in state.stats["steps"]]
    return {"dec": dec, "true": true, "sd": buf.getvalue(), "params": params, "nbuckets": nb,
            "per_rank": per_rank}


def _w_ef_load(rank, world, codec, sd_bytes, params, steps):
    ddp, state = _make(rank, {"bucket_cap_mb": 0.02}, codec, start_step=0)
    with torch.no_grad():
        for n, p in ddp.module.named_parameters():
            p.copy_(params[n])
    sd = torch.load(io.BytesIO(sd_bytes), weights_only=True)
    state.load_state_dict(sd)
    dec, true = _ef_steps(rank, world, ddp, state, steps, step0=100)
    after = state.resharded_state_dict()["residual"]
    return {"dec": dec, "true": true, "after": after}


@pytest.fixture(scope="module")
def ef_runs():
    """Five steps at 2 ranks (bucket rebuild after the first), per codec, and its checkpoint."""
    return spawn.run(2, _w_ef_save, ("int8", "int4", "sign"), 5, timeout_s=60)


@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
def test_error_feedback_conserved_across_bucket_rebuild(ef_runs, codec):
    res = [r[codec] for r in ef_runs]
    assert max(res[0]["nbuckets"][1:]) > 1
    assert res[0]["nbuckets"][0] != res[0]["nbuckets"][1]  # the rebuild changed the layout
    sd = torch.load(io.BytesIO(res[0]["sd"]), weights_only=True)
    sd1 = torch.load(io.BytesIO(res[1]["sd"]), weights_only=True)
    assert sd["world_size"] == 2 and sd["codec"] == codec
    for n, t in sd["residual"].items():  # every rank saves the same totals
        assert torch.equal(t, sd1["residual"][n])
    assert any(t.abs().max() > 0 for t in sd["residual"].values())
    for r in range(2):
        _check_conserved(res[r]["dec"], res[r]["true"], {}, sd["residual"], f"{codec} rank {r}")


def test_checkpoint_saved_at_2_ranks_loaded_at_3(ef_runs):
    res = ef_runs[0]["int8"]
    sd = torch.load(io.BytesIO(res["sd"]), weights_only=True)
    # Load at 3 ranks (another world size and bucket layout): the loaded total is sent, nothing lost.
    res3 = spawn.run(3, _w_ef_load, "int8", res["sd"], res["params"], 3, timeout_s=60)
    for r in range(3):
        _check_conserved(res3[r]["dec"], res3[r]["true"], sd["residual"], res3[r]["after"], f"int8 rank {r} of 3")
    for n, t in res3[0]["after"].items():
        assert torch.equal(t, res3[2]["after"][n])


def test_every_ranks_state_dict_reshards_to_the_same_bits(ef_runs):
    # Without communication: the list of per-rank dicts gives the collective's totals bit for bit,
    # and a per-rank dict refuses another world size.
    for codec in ("int8", "sign"):
        sd = torch.load(io.BytesIO(ef_runs[0][codec]["sd"]), weights_only=True)
        merged = fddp.reshard([ef_runs[1][codec]["per_rank"], ef_runs[0][codec]["per_rank"]])
        assert merged["form"] == "total" and merged["world_size"] == 2
        assert sorted(merged["residual"]) == sorted(sd["residual"])
        for n, t in sd["residual"].items():
            assert torch.equal(merged["residual"][n].view(torch.int32), t.view(torch.int32)), (codec, n)
    with pytest.raises(ValueError, match="every rank"):
        fddp.reshard([ef_runs[0]["int8"]["per_rank"]])


# ---- int8 + error feedback trains like fp32; stats --------------------------------------------------


def _w_train(rank, world, steps):
    out = {}
    for codec in ("fp32", "int8"):
        ddp, state = _make(rank, {}, codec)
        opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
        torch.manual_seed(123)
        w_true = torch.randn(32, 8)  # a learnable target, the same on every rank
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(7919 * step + rank)
            x = torch.randn(32, 32, generator=g)
            y = torch.tanh(x @ w_true) + 0.05 * torch.randn(32, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[codec] = {"losses": losses, "stats": state.stats}
    return out


def test_int8_ef_training_within_1pct_of_fp32_and_stats():
    steps = 100
    res = spawn.run(2, _w_train, steps, timeout_s=60)

    def final(codec):  # mean over ranks of the last 10 steps' loss
        return sum(sum(r[codec]["losses"][-10:]) for r in res) / (10 * len(res))

    f32, i8 = final("fp32"), final("int8")
    assert f32 < 0.5 * sum(r["fp32"]["losses"][0] for r in res) / len(res), "fp32 did not train"
    assert abs(i8 - f32) <= 0.01 * f32, (f32, i8)

    st = res[0]["int8"]["stats"]
    assert st["codec"] == "int8" and st["error_feedback"] and st["world_size"] == 2
    assert len(st["steps"]) == steps and [s["step"] for s in st["steps"]] == list(range(steps))
    last = st["steps"][-1]
    assert last["step"] == steps - 1 and len(last["buckets"]) > 1
    for b in last["buckets"]:
        for k in ("bucket", "numel", "wire_bytes", "fp32_bytes", "encode_s", "exchange_s", "decode_s", "comm_s",
                  "client_residual_norm", "server_residual_norm", "input_norm", "rel_error"):
            assert k in b, k
        assert 0 < b["wire_bytes"] < b["fp32_bytes"]
        assert b["encode_s"] >= 0 and b["decode_s"] >= 0 and b["comm_s"] > 0
        assert 0 < b["rel_error"] < 0.05
        assert math.isfinite(b["client_residual_norm"]) and b["client_residual_norm"] > 0
    assert sum(b["numel"] for b in last["buckets"]) == sum(p.numel() for p in Net().parameters())
    assert 3.0 < last["compression"] < 4.5, last["compression"]
    assert 0 < last["rel_error"] < 0.05 and last["residual_norm"] > 0
    fp = res[0]["fp32"]["stats"]["steps"][-1]
    assert fp["rel_error"] == 0.0 and fp["residual_norm"] == 0.0 and 0.9 < fp["compression"] < 1.1


# ---- AMP / GradScaler: one rank's inf reaches every rank, residuals stay finite --------------------


def _w_amp(rank, world):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ddp, state = _make(rank, {}, "int8", grad_scaler=scaler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    log = []
    for step in range(5):
        x, y = _data(step, rank)
        if step == 3 and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        scaler.scale(loss).backward()
        before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
        res_finite = all(bool(torch.isfinite(b.ef.client).all() and torch.isfinite(b.ef.server).all())
                         for b in state.residuals.bufs.values())
        res_norm = math.sqrt(sum(float(b.ef.client.square().sum()) for b in state.residuals.bufs.values()))
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(before[n], p) for n, p in ddp.module.named_parameters())
        log.append({"grads_finite": grads_finite, "res_finite": res_finite, "changed": changed,
                    "scale": scale, "res_norm": res_norm})
    return log


def test_amp_grad_scaler_nonfinite_on_one_rank():
    logs = spawn.run(2, _w_amp, timeout_s=60)
    for r, log in enumerate(logs):
        for step, e in enumerate(log):
            assert e["res_finite"], (r, step)
            if step == 3:
                assert not e["grads_finite"], f"rank {r}: the inf on rank 1 did not reach rank {r}"
                assert not e["changed"], f"rank {r}: the step was not skipped"
            else:
                assert e["grads_finite"] and e["changed"], (r, step, e)
        assert log[4]["scale"] == log[3]["scale"] / 2
        assert log[4]["res_norm"] > 0
