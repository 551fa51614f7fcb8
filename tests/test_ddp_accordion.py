"""flatcomm.ddp.accordion.Accordion: a precise codec in intervals after the gradient norm changed by
at least the threshold, the State's codec otherwise; the decisions follow a float64 recomputation
from the reduced gradients, agree on every rank, and survive a checkpoint."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.ops.codecs import resolve
from flatcomm.ddp.accordion import Accordion, policy
from flatcomm.tools import spawn

EVERY, THRESHOLD = 3, 0.5


def _done(t):
    f = torch.futures.Future()
    f.set_result(t)
    return f


def _expected(norms, threshold):
    """Critical flag of each interval from the interval norms (float64): the first two are critical."""
    crit = [True, True]
    for i in range(1, len(norms) - 1):
        crit.append(abs(norms[i - 1] - norms[i]) / norms[i - 1] >= threshold)
    return crit[:len(norms)]


def test_decisions_follow_the_interval_norms():
    acc = Accordion(low="int8", every=2, threshold=0.5)
    sign = resolve("sign", 64)
    key = (1, 2)
    # interval gradient norms 10, 10, 30, 31, 31, 5: changes -, 0, 2.0, 0.03, 0, 0.84
    scales = [10, 10, 30, 31, 31, 5, 5]
    got = []
    for step in range(2 * len(scales)):
        c = acc.choose(key, step, sign)
        got.append(c.name)
        g = torch.full((4,), scales[step // 2] / 8 ** 0.5)  # sqrt(2 steps * ||g||^2) = scale
        acc.watch(key, step, _done(g)).wait()
    crit = _expected([float(s) for s in scales], 0.5)
    want = [("int8" if c else "sign") for c in crit for _ in range(2)]
    assert got == want
    assert acc.choose(key, 2 * len(scales), sign).block_size == 64  # low takes sign's block size


def test_bad_arguments():
    for kw, match in ((dict(every=0), "every must be an int >= 1"), (dict(threshold=0), "threshold"),
                      (dict(threshold=float("inf")), "threshold"), (dict(low="auto"), "not 'auto'")):
        with pytest.raises(ValueError, match=match):
            Accordion(**kw)
    with pytest.raises(TypeError, match="accordion must be"):
        policy(3)
    assert policy(None) is None and policy(False) is None
    assert policy("fp32").low.name == "fp32" and policy(True).low.name == "int8"


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))


def _w_accordion(rank, world, steps):
    net = _net()
    ddp = DDP(net)  # one bucket: the reduced gradient is all the parameters' grads
    with pytest.raises(ValueError, match="does not combine with codec='auto'"):
        fddp.State("auto", accordion=True)
    acc = Accordion(low="int8", every=EVERY, threshold=THRESHOLD)
    state = fddp.register(ddp, "sign", accordion=acc, start_step=0)
    grads = []
    sd = None
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        amp = 1.0 if step < 9 else 30.0  # a jump in gradient size at interval 3
        x, y = torch.randn(7, 19, generator=g), amp * torch.randn(7, 5, generator=g)
        ddp.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).double())
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=-1e-3)
        if step == 10:
            sd = state.state_dict()
    codecs = [s["buckets"][0]["codec"] for s in state.stats["steps"]]
    norms = [math.sqrt(sum(float(g.dot(g)) for g in grads[i:i + EVERY])) for i in range(0, steps, EVERY)]
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    # a fresh State loaded at step 11 takes the same decision for the interval it is in
    acc2 = Accordion(low="int8", every=EVERY, threshold=THRESHOLD)
    ddp2 = DDP(_net())
    state2 = fddp.register(ddp2, "sign", accordion=acc2, start_step=0)
    state2.load_state_dict(sd)
    return codecs, norms, weights, sd["accordion"]["buckets"], state2.accordion._tracks


def test_ddp_switches_on_norm_changes_and_ranks_agree():
    steps = 5 * EVERY
    outs = spawn.run(2, _w_accordion, steps, timeout_s=120)
    codecs, norms, w0, saved, _ = outs[0]
    crit = _expected(norms, THRESHOLD)
    want = [("int8" if c else "sign") for c in crit for _ in range(EVERY)]
    assert codecs == want, (codecs, norms)
    assert "sign" in codecs and codecs[-1] == "int8", "the jump at interval 3 must make interval 4 critical"
    assert outs[1][0] == codecs and torch.equal(outs[1][2], w0), "ranks must agree"
    (names, rec), = saved.items()
    assert names.startswith("0.weight") or "0.weight" in names.split(",")
    assert rec["interval"] == 10 // EVERY and math.isfinite(rec["prev"])
    (track,) = outs[0][4].values()
    assert (track.interval, track.prev, track.critical) == (rec["interval"], rec["prev"], rec["critical"])
