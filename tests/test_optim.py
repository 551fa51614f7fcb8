"""flatcomm.optim.OnebitAdam: the warm-up is torch's AdamW bit for bit; the compressed phase equals a
hand-written reference (local momenta, flatcomm.ops.reference's bit-exact codec in the two-stage
all-reduce with error feedback, frozen variance); ranks keep identical weights; checkpoints carry
everything; bad arguments are clear errors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.optim as fo
from flatcomm.ops import reference as R
from flatcomm.collectives import shard_bounds
from flatcomm.tools import spawn

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.99), 1e-8, 0.05


def _net(seed=0):
    torch.manual_seed(seed)
    # odd sizes: 19*37+37+37*5+5 = 930 values, not a multiple of any block size
    return torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    return torch.randn(9, 19, generator=g), torch.randn(9, 5, generator=g)


def _local_grads(net, weights, x, y):
    """This rank's own gradient at ``weights`` (a plain copy of the model, no DDP)."""
    ref = _net()
    with torch.no_grad():
        for p, w in zip(ref.parameters(), weights):
            p.copy_(w)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def _ref_all_reduce(ms, clients, servers, codec, bs, world):
    """flatcomm's ordered two-stage all-reduce (avg) of the per-rank flat tensors ``ms``, one chunk,
    written with flatcomm.ops.reference: encode each rank's value + client residual per shard; the shard's
    owner decodes the rows in rank order, sums, scales and re-encodes with its server residual."""
    n = ms[0].numel()
    b = shard_bounds(n, world, bs)
    out = torch.empty(n)
    for d in range(world):
        a, e = b[d], b[d + 1]
        if e == a:
            continue
        rows = torch.stack([R.encode(ms[r][a:e], codec, residual=clients[r][a:e], block_size=bs)
                            for r in range(world)])
        enc = R.decode_sum(rows, codec, e - a, block_size=bs, scale=1.0 / world, reencode=codec,
                           residual=servers[d][a:e], reencode_block_size=bs)
        out[a:e] = R.decode(enc, codec, e - a, block_size=bs)
    return out


def _w_phases(rank, world, codec, bs, warm, steps, space):
    net = _net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    opt = fo.OnebitAdam(ddp.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, warmup_steps=warm,
                        codec=codec, block_size=bs, space=space)
    fo.register(ddp, opt)
    # torch's AdamW on a second DDP copy with the default all-reduce: the warm-up's reference
    tnet = _net()
    tddp = DDP(tnet, bucket_cap_mb=0.001)
    topt = torch.optim.AdamW(tddp.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    # the compressed phase's reference state, emulating every rank (moments, residuals)
    n = sum(p.numel() for p in net.parameters())
    clients = [torch.zeros(n) for _ in range(world)]
    servers = [torch.zeros(n) for _ in range(world)]
    ref_w = m = v = None
    out = {"warm_bitwise": [], "m_bitwise": [], "w_maxdiff": [], "weights": None, "wire": []}
    b1, b2 = BETAS
    for step in range(steps):
        x, y = _batch(step, rank)
        if step < warm:
            for o, d in ((opt, ddp), (topt, tddp)):
                o.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(d(x), y).backward()
                o.step()
            out["warm_bitwise"].append(all(torch.equal(p, q) for p, q in zip(net.parameters(), tnet.parameters())))
            continue
        if ref_w is None:  # the compressed phase starts from the warm-up's weights and moments
            ref_w = [p.detach().clone() for p in net.parameters()]
            m = [opt.state[p]["exp_avg"].clone() for p in net.parameters()]
            v = [opt.state[p]["exp_avg_sq"].clone() for p in net.parameters()]
            v = [vv.clamp(min=0.01 * float(vv.mean())) for vv in v]  # the freeze's variance floor
        # every rank's local gradient at the current weights (each rank computes its own, then gathers)
        g_mine = torch.cat([g.reshape(-1) for g in _local_grads(net, ref_w, x, y)])
        g_all = [torch.empty_like(g_mine) for _ in range(world)]
        dist.all_gather(g_all, g_mine)
        t = step + 1
        bc1, bc2s = 1 - b1 ** t, (1 - b2 ** warm) ** 0.5
        d = [(vv.sqrt() / bc2s).add_(EPS) for vv in v]
        m_flat = torch.cat([mm.reshape(-1) for mm in m])
        d_flat = torch.cat([dd.reshape(-1) for dd in d])
        ms = []
        for r in range(world):
            # p *= 1 - lr wd; m_r = lerp(m, g_r, 1 - b1), per parameter as the optimizer does
            parts, o = [], 0
            for mm in m:
                k = mm.numel()
                parts.append(m_flat[o:o + k].clone().lerp_(g_all[r][o:o + k], 1 - b1))
                o += k
            ms.append(torch.cat(parts) if space == "momentum" else torch.cat(parts) / d_flat)
        avg = _ref_all_reduce(ms, clients, servers, codec, bs, world)
        o = 0
        for i, w in enumerate(ref_w):
            k = w.numel()
            part = avg[o:o + k].view_as(w)
            o += k
            w.mul_(1 - LR * WD)
            if space == "momentum":
                m[i] = part.clone()
                w.addcdiv_(m[i], d[i], value=-(LR / bc1))
            else:  # the codec compressed Adam's update m / d
                m[i] = part * d[i]
                w.add_(part, alpha=-(LR / bc1))
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        out["wire"].append(opt.last_wire_bytes)
        out["m_bitwise"].append(all(torch.equal(opt.state[p]["exp_avg"], mm) for p, mm in zip(net.parameters(), m)))
        out["w_maxdiff"].append(max(float((p - w).abs().max()) for p, w in zip(net.parameters(), ref_w)))
        # the variance stayed frozen
        assert all(torch.equal(opt.state[p]["exp_avg_sq"], vv) for p, vv in zip(net.parameters(), v))
    out["weights"] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    out["stats"] = (opt.stats.wire_bytes, opt.stats.calls, len(opt.param_groups))
    return out


@pytest.mark.parametrize("codec,bs,space", [("sign", 32, "momentum"), ("int4", 64, "momentum"),
                                            ("int8", 256, "momentum"), ("sign", 64, "update")])
def test_warmup_is_adamw_then_compressed_momentum_matches_the_reference(codec, bs, space):
    warm, steps = 3, 8
    outs = spawn.run(2, _w_phases, codec, bs, warm, steps, space, timeout_s=180)
    for r in outs:
        assert r["warm_bitwise"] == [True] * warm
        assert r["m_bitwise"] == [True] * (steps - warm), r["m_bitwise"]
        # the same operations in the same order: the weights match the reference to the last bit
        assert max(r["w_maxdiff"]) == 0.0, r["w_maxdiff"]
        assert all(0 < w < 930 * 4 for w in r["wire"])
        # .stats: every compressed step's all-reduces (one per parameter group), summed
        wire, calls, ngroups = r["stats"]
        assert wire == sum(r["wire"]) and calls == ngroups * (steps - warm)
    assert torch.equal(outs[0]["weights"], outs[1]["weights"]), "ranks must keep identical weights"


def _w_no_ef_differs(rank, world):
    """Error feedback matters: the same run without residuals ends elsewhere."""
    res = []
    for ef in (True, False):
        net = _net()
        ddp = DDP(net)
        opt = fo.OnebitAdam(ddp.parameters(), lr=LR, warmup_steps=2, codec="sign", error_feedback=ef)
        fo.register(ddp, opt)
        for step in range(6):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        res.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        assert (opt.state_dict()[fo.STATE_KEY]["residuals"] == []) == (not ef)
    return not torch.equal(res[0], res[1])


def test_error_feedback_off_changes_the_result():
    assert all(spawn.run(2, _w_no_ef_differs, timeout_s=120))


def _run(ddp, opt, rank, steps, start):
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _w_checkpoint(rank, world):
    net = _net()
    ddp = DDP(net)
    opt = fo.OnebitAdam(ddp.parameters(), lr=LR, warmup_steps=3, codec="sign", block_size=32)
    fo.register(ddp, opt)
    _run(ddp, opt, rank, 5, 0)
    sd = copy.deepcopy(opt.state_dict())  # like torch's, it holds the live moment tensors
    snap = [p.detach().clone() for p in net.parameters()]
    _run(ddp, opt, rank, 4, 5)
    want = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def resumed(state):
        """A fresh model and optimizer at the snapshot, loaded from ``state``, 4 more steps."""
        net2 = _net(seed=1)
        with torch.no_grad():
            for p, s in zip(net2.parameters(), snap):
                p.copy_(s)
        ddp2 = DDP(net2)
        opt2 = fo.OnebitAdam(ddp2.parameters(), lr=LR, warmup_steps=3, codec="sign", block_size=32)
        fo.register(ddp2, opt2)
        opt2.load_state_dict(state)
        assert opt2.compressing and opt2.steps_done == 5
        _run(ddp2, opt2, rank, 4, 5)
        return torch.cat([p.detach().reshape(-1) for p in net2.parameters()]), opt2

    got, _ = resumed(sd)
    # the residuals are needed: loading without them ends elsewhere
    lost = dict(sd)
    lost[fo.STATE_KEY] = dict(sd[fo.STATE_KEY], residuals=[])
    other, opt3 = resumed(lost)
    errors = []
    for change, match in ((dict(world_size=3), "world size 3"), (dict(codec="int8"), "codec int8"),
                          (dict(warmup_steps=4), "warmup_steps 4")):
        bad = dict(sd)
        bad[fo.STATE_KEY] = dict(sd[fo.STATE_KEY], **change)
        with pytest.raises(ValueError, match=match):
            opt3.load_state_dict(bad)
        errors.append(match)
    bad = dict(sd)
    r0 = sd[fo.STATE_KEY]["residuals"][0]
    bad[fo.STATE_KEY] = dict(sd[fo.STATE_KEY], residuals=[{"client": r0["client"][:-1], "server": r0["server"]}])
    with pytest.raises(ValueError, match="residual 'client' of group 0 must be an fp32 tensor of 930"):
        opt3.load_state_dict(bad)
    nan = r0["client"].clone()
    nan[3] = float("nan")
    bad[fo.STATE_KEY] = dict(sd[fo.STATE_KEY], residuals=[{"client": nan, "server": r0["server"]}])
    with pytest.raises(ValueError, match="not finite"):
        opt3.load_state_dict(bad)
    with pytest.raises(ValueError, match="not an OnebitAdam state_dict"):
        opt3.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).state_dict())
    return torch.equal(got, want), torch.equal(other, want), len(errors)


def test_checkpoint_carries_residuals_moments_and_step():
    for same, without_residuals, _ in spawn.run(2, _w_checkpoint, timeout_s=180):
        assert same, "a loaded optimizer must continue bit for bit"
        assert not without_residuals, "the residuals must matter (else the test proves nothing)"


def test_bad_arguments_are_clear_errors():
    ps = [torch.nn.Parameter(torch.zeros(3))]
    for kw, match in ((dict(lr=-1.0), "lr must be"), (dict(lr=float("nan")), "lr must be"),
                      (dict(betas=(0.9,)), "betas must be a pair"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
                      (dict(eps=-1e-8), "eps must be"), (dict(weight_decay=-0.1), "weight_decay"),
                      (dict(warmup_steps=0), "warmup_steps must be an int >= 1"),
                      (dict(warmup_steps=2.5), "warmup_steps"), (dict(codec="auto"), "codec='auto'"),
                      (dict(chunks=0), "chunks must be"), (dict(space="grad"), "space must be")):
        with pytest.raises(ValueError, match=match):
            fo.OnebitAdam(ps, **kw)
    with pytest.raises(ValueError, match="unknown codec|codec"):
        fo.OnebitAdam(ps, codec="int3")
    with pytest.raises(TypeError, match="codec must be"):
        fo.OnebitAdam(ps, codec=8)
    with pytest.raises(TypeError, match="parameter 0 of group 0 is torch.float64"):
        fo.OnebitAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        fo.register(torch.nn.Linear(2, 2), fo.OnebitAdam(ps))


def _w_floor(rank, world, floor):
    """Coordinates 20.. of p, and all of q, get no gradient during the warm-up (v = 0 there), then one."""
    p = torch.nn.Parameter(torch.zeros(40))
    q = torch.nn.Parameter(torch.zeros(7))
    opt = fo.OnebitAdam([p, q], lr=1e-3, weight_decay=0.0, warmup_steps=3, codec="int8", variance_floor=floor)
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        grad = torch.randn(40, generator=g)  # the same on both ranks: the warm-up's averaged gradient
        if step < 3:
            grad[20:] = 0
        p.grad = grad
        q.grad = torch.randn(7, generator=g) if step >= 3 else None
        before = p.detach().clone()
        v_before = opt.state[p]["exp_avg_sq"].clone() if p in opt.state else None
        opt.step()
    q_v = opt.state[q]["exp_avg_sq"]
    return (max((p.detach() - before).abs().max().item(), q.detach().abs().max().item()), v_before,
            opt.state[p]["exp_avg_sq"].clone(), q_v.clone())


def _w_floors(rank, world, floors):
    return [_w_floor(rank, world, f) for f in floors]  # one spawn for both runs


def test_variance_floor_keeps_unseen_coordinates_finite():
    without, with_floor = spawn.run(2, _w_floors, (0.0, 0.01), timeout_s=120)[0]
    step0 = without[0]
    assert step0 > 1e2, "without the floor a coordinate with v = 0 takes a step of lr * m / eps"
    step, v_before, v_after, q_v = with_floor
    assert step < 0.1, step
    assert torch.equal(v_after, v_before.clamp(min=0.01 * float(v_before.mean())))
    assert (v_before[20:] == 0).all() and (v_after[20:] > 0).all()
    # q had no gradient at all in the warm-up: its floor is from the group's mean (p's 40 and q's 7)
    assert torch.allclose(q_v, torch.full((7,), 0.01 * float(v_before.double().sum()) / 47), rtol=1e-6)
