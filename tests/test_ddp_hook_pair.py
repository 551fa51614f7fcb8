"""ddp.register_comm_hook(State(codec), hook), torch's (state, hook) convention (Lightning's GPU path):
the State's checkpoints never lose a residual silently, and loads refuse dicts that lack them."""
from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.tools import spawn


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 6))


def _train(ddp, steps: int, rank: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _rank(rank: int, world: int) -> dict:
    out: dict = {}
    # The pair, as torch and Lightning register it: no model.
    pair = DDP(_net(), bucket_cap_mb=0.001)
    state = fddp.State("int8")
    pair.register_comm_hook(state, fddp.hook)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _train(pair, 3, rank)
    out["warned"] = any("state.attach" in str(w.message) for w in seen)
    try:
        state.state_dict()
        out["unnamed_save"] = "saved"
    except ValueError as e:
        out["unnamed_save"] = str(e)
    state.attach(pair)
    sd = state.state_dict()
    names = [n for n, _ in pair.module.named_parameters()]
    out["names"] = sorted(sd["client"]) == sorted(names)
    out["nonzero"] = sum(int(sd["client"][n].any()) for n in names)

    # The same run through register(): the same residuals, bit for bit.
    ref = DDP(_net(), bucket_cap_mb=0.001)
    ref_state = fddp.register(ref, "int8")
    _train(ref, 3, rank)
    ref_sd = ref_state.state_dict()
    out["same_as_register"] = all(torch.equal(sd["client"][n], ref_sd["client"][n]) and
                                  torch.equal(sd["server"][n], ref_sd["server"][n]) for n in names)

    # A dict without residuals (what earlier versions saved for the pair) is refused...
    empty = dict(sd, client={}, server={}, buckets=[], decisions=[])
    fresh = fddp.State("int8", model=DDP(_net(), bucket_cap_mb=0.001))
    try:
        fresh.load_state_dict(empty)
        out["empty_load"] = "loaded"
    except ValueError as e:
        out["empty_load"] = str(e)
    # ... and so is one missing a parameter; the failed loads changed nothing.
    partial = dict(sd, client={k: v for k, v in sd["client"].items() if k != names[0]})
    try:
        fresh.load_state_dict(partial)
        out["partial_load"] = "loaded"
    except KeyError as e:
        out["partial_load"] = str(e)
    out["fresh_untouched"] = fresh.step == 0 and not fresh.residuals.bufs
    # A State holding residuals refuses a dict that would wipe them.
    try:
        ref_state.load_state_dict(dict(ref_sd, client={}, server={}, step=0))
        out["wipe_load"] = "loaded"
    except ValueError as e:
        out["wipe_load"] = str(e)
    out["ref_kept"] = all(torch.equal(ref_state.state_dict()["client"][n], ref_sd["client"][n]) for n in names)
    # The complete dict loads into a fresh State.
    fresh.load_state_dict(sd)
    out["full_load"] = fresh.step == 3
    return out


def test_state_hook_pair_keeps_every_residual_or_raises():
    for o in spawn.run(2, _rank, timeout_s=120):
        assert o["warned"], o
        assert "attach" in o["unnamed_save"], o
        assert o["names"] and o["nonzero"] >= 3, o
        assert o["same_as_register"], o
        assert "no residuals" in o["empty_load"], o
        assert "missing parameters" in o["partial_load"], o
        assert o["fresh_untouched"], o
        assert "wipe" in o["wipe_load"] and o["ref_kept"], o
        assert o["full_load"], o

