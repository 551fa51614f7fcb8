"""The chunked sparse codec across 2 gloo ranks: the gathered sum through the collectives (every
replica decodes every peer's payload), the two-stage all-reduce, and DiLoCo with SparseLoCo's recipe
(error_decay, outer step without momentum): replicas bitwise equal after every sync, resume bit for
bit with a fragment in flight, error_decay agreed by every replica and checked."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import flatcomm.collectives as C
from flatcomm.diloco import DiLoCo
from flatcomm.ops.codecs import Codec, decode, encode
from flatcomm.tools import spawn

SMALL = Codec("sparse", block_size=128, keep=8)  # several chunks in a small model


def _data(rank, n=1000):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1


def _collectives(rank, world):
    out = {}
    n = 1000
    for codec in (SMALL, Codec("sparse4", block_size=256, keep=32)):
        x, r = _data(rank, n)
        rows = torch.empty(world * n)
        C.all_gather(rows, x, codec=codec, residual=r)
        want = []
        for d in range(world):  # every rank's payload, re-encoded here from its known data
            xd, rd = _data(d, n)
            want.append(decode(encode(xd, codec, residual=rd), codec, n))
        out[f"gathered {codec.name}"] = torch.equal(rows, torch.cat(want))
        # two-stage: reduce-scatter of sparse payloads, the owner re-sparsifies with its server residual
        y = x.clone()
        fb = C.ErrorFeedback(torch.zeros(n), torch.zeros(n))
        C.all_reduce(y, codec=codec, residual=fb)
        hashes = [torch.empty(n) for _ in range(world)]
        torch.distributed.all_gather(hashes, y)
        out[f"two-stage {codec.name} equal"] = all(torch.equal(hashes[0], h) for h in hashes)
        out[f"two-stage {codec.name} sparse"] = int((y != 0).sum()) <= world * n * codec.keep / codec.block_size + world
    # ranks keeping different counts per chunk would exchange payloads of other sizes: refused on every rank
    x, _ = _data(rank, n)
    try:
        C.all_gather(torch.empty(world * n), x, codec=Codec("sparse", block_size=128, keep=8 + 8 * rank))
        out["keep mismatch"] = False
    except ValueError as e:
        out["keep mismatch"] = "disagree" in str(e)
    return out


def test_sparse_through_the_collectives():
    res = spawn.run(2, _collectives, timeout_s=60)
    for rank, per in enumerate(res):
        assert all(per.values()), f"rank {rank}: {per}"


H, STEPS, KILL = 4, 16, 6


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))  # 683 values


def _train(net, opt, steps, replica, start=0):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * replica + t)
        opt.zero_grad()
        net(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        opt.step()


RECIPE = dict(sync_every=H, codec=SMALL, fragments=2, fragment_sync_delay=1, verify_every=1, error_decay=0.95,
              outer_lr=1.0, outer_momentum=0.0)


def _fresh(**kw):
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    return net, opt, DiLoCo(net, opt, **{**RECIPE, **kw})


def _masters(outer):
    return torch.cat([f.master for f in outer.fragments])


def _recipe(rank, world, ckpt):
    out = {}
    net, opt, outer = _fresh()
    _train(net, opt, KILL, rank)  # verify_every=1: a replica mismatch would raise here
    out["in flight at save"] = outer.pending is not None
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()},
               os.path.join(ckpt, f"{rank}.pt"))
    _train(net, opt, STEPS - KILL, rank, start=KILL)
    straight = _masters(outer)
    out["residuals kept"] = all(bool(f.residuals[0].abs().sum() > 0) for f in outer.fragments)
    out["syncs"] = outer.syncs
    out["bytes per sync"] = [s["bytes_per_sync"] for s in outer.stats["fragments"]]
    sd = torch.load(os.path.join(ckpt, f"{rank}.pt"), weights_only=True)
    net, opt, outer = _fresh()
    net.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
    outer.load_state_dict(sd["outer"])
    _train(net, opt, STEPS - KILL, rank, start=KILL)
    out["resumed bit for bit"] = torch.equal(straight.view(torch.int32), _masters(outer).view(torch.int32))
    # the decay matters, and every replica must use the same one
    net, opt, outer = _fresh(error_decay=1.0)
    _train(net, opt, STEPS, rank)
    out["decay changes the run"] = not torch.equal(straight, _masters(outer))
    try:
        _fresh(error_decay=0.9 if rank == 1 else 0.95)
        out["decay mismatch"] = "no exception"
    except RuntimeError as e:
        out["decay mismatch"] = "configuration" in str(e)
    return out


def test_diloco_sparseloco_recipe_equal_replicas_and_resume():
    with tempfile.TemporaryDirectory() as ckpt:
        res = spawn.run(2, _recipe, ckpt, timeout_s=90)
    for rank, per in enumerate(res):
        assert per["in flight at save"] and per["resumed bit for bit"] and per["residuals kept"], per
        assert per["decay changes the run"] and per["decay mismatch"] is True, per
        assert per["syncs"] == 2 * STEPS // H - 1  # the last fragment's sync is still in flight
        # each fragment's payload: ceil(numel / 128) chunks of 8 kept values
        assert all(0 < b < 0.1 * 4 * 683 for b in per["bytes per sync"]), per


def _bad_decay(rank, world):
    out = {}
    for decay in (-0.1, 1.5, float("nan"), "0.9"):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        try:
            DiLoCo(net, opt, sync_every=H, codec="sparse", error_decay=decay)
            out[repr(decay)] = "no exception"
        except ValueError as e:
            out[repr(decay)] = "error_decay" in str(e)
    return out


def test_error_decay_is_checked():
    res = spawn.run(2, _bad_decay, timeout_s=60)
    for per in res:
        assert all(v is True for v in per.values()), per


def _default_sum(rank, world):
    """mode=None: a sparse codec runs the gathered exact sum, int4 the ordered one, bit for bit;
    the outer recipe left at None is the codec's."""
    out = {}
    for codec in (SMALL, Codec("int4")):
        masters = {}
        for mode in (None, "exact", "ordered"):
            if mode == "exact" and not codec.chunked:
                continue
            net, opt, outer = _fresh(codec=codec, mode=mode, fragments=1, fragment_sync_delay=0)
            _train(net, opt, 2 * H, rank)
            masters[mode] = _masters(outer)
            if mode is None:
                out[f"{codec.name} gathered"] = outer.config.plan.gathered
                out[f"{codec.name} options mode"] = outer.config.options()["mode"]
        same = "exact" if codec.chunked else "ordered"
        out[f"{codec.name} default is {same}"] = torch.equal(masters[None], masters[same])
        if codec.chunked:
            out[f"{codec.name} ordered differs"] = not torch.equal(masters[None], masters["ordered"])
    # the outer recipe left at None: the codec's (SparseLoCo's for sparse); one given is kept
    for codec, given in ((SMALL, {}), (Codec("int4"), {}), (SMALL, {"outer_lr": 0.7})):
        net = _net()
        outer = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=H, codec=codec, **given)
        c = outer.config
        out[f"{codec.name} recipe {given}"] = (c.lr, c.momentum, c.plan.error_decay)
        outer.close()
    return out


def test_default_sum_and_recipe_by_codec_and_replicas():
    from flatcomm.diloco.sync import GATHERED_UP_TO, default_mode
    assert default_mode(SMALL, GATHERED_UP_TO, False) == "exact"
    assert default_mode(SMALL, GATHERED_UP_TO + 1, False) == "ordered"  # gathered bytes grow as R - 1
    assert default_mode(SMALL, 2, True) == "ordered"  # a two-level sync cannot gather
    assert default_mode(Codec("int4"), 2, False) == default_mode(Codec("fp32"), 2, False) == "ordered"
    res = spawn.run(2, _default_sum, timeout_s=90)
    for per in res:
        assert per == {"sparse gathered": True, "sparse options mode": "exact", "sparse default is exact": True,
                       "sparse ordered differs": True, "int4 gathered": False, "int4 options mode": "ordered",
                       "int4 default is ordered": True, "sparse recipe {}": (2.0, 0.0, 0.95),
                       "int4 recipe {}": (0.7, 0.9, 1.0), "sparse recipe {'outer_lr': 0.7}": (0.7, 0.0, 0.95)}, per
