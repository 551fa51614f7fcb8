"""DiLoCo(codec="auto"): the choice (densest candidate whose sync fits; the sparsest when none does),
and on 2 gloo ranks: every replica takes the same codec from agreed measurements, records it in the
stats and the checkpoint, and a resume keeps it (bit for bit with the uninterrupted run); a sparse
choice runs the sparse recipe, bit for bit as the same codec and recipe named by hand."""
from __future__ import annotations

import pytest
import torch

from flatcomm.diloco import DiLoCo
from flatcomm.diloco.auto import SPARSE_RECIPE, Auto, Choice, Recipe, choose, sync_bytes
from flatcomm.ops.codecs import Codec
from flatcomm.tools import spawn

N = 1 << 20  # values of the largest fragment


def _pick(bytes_per_s, *, delay=1, step_s=0.1, fragments=4, world=2, gathered=False, latency_s=1e-3):
    return choose(numel=N, fragments=fragments, world=world, gathered=gathered, sync_every=40, delay=delay,
                  step_s=step_s, latency_s=latency_s, bytes_per_s=bytes_per_s)


def test_the_densest_codec_that_fits():
    # int4's 0.53 MB in 0.8 x 0.1 s needs ~7 MB/s; sparse keep 64 ~0.1 MB/s. Never fp32 or int8: int4
    # reached a lower loss at a fixed wall-clock on every link measured (docs/diloco.md).
    assert (_pick(1e9).codec, _pick(2e7).codec, _pick(8e6).codec) == ("int4", "int4", "int4")
    assert _pick(5e6).codec == "sparse"
    c = _pick(1.25e6)  # 10 Mbit/s
    assert (c.codec, c.keep, c.fits) == ("sparse", 256, True)
    assert c.sync_s <= c.budget_s == pytest.approx(0.08) and c.to_codec() == Codec("sparse", keep=256)
    slow = _pick(1e3)
    assert (slow.codec, slow.keep, slow.fits) == ("sparse", 32, False)  # none fits: the sparsest
    # no delay: every fragment's sync stalls the loop; together at most 25% of the H steps (4 x 0.53 MB
    # in 1 s needs ~2.1 MB/s)
    assert (_pick(2.5e6, delay=0).codec, _pick(1.5e6, delay=0).codec) == ("int4", "sparse")
    # the gathered sum sends R - 1 payloads: 4 replicas need a sparser codec than the two-stage sum
    assert sync_bytes(Codec("int4"), N, 4, True) == 3 * Codec("int4").wire_bytes(N)
    assert sync_bytes(Codec("int4"), N, 4, False) == 6 * Codec("int4").wire_bytes(N // 4)
    assert _pick(5e5, world=4, gathered=True).keep < _pick(5e5, world=4).keep
    # DiLoCo's default (mode=None) gathers the sparse candidates only: int4 is priced two-stage
    by_codec = lambda c: c.chunked  # noqa: E731
    assert _pick(2e7, world=4, gathered=by_codec).sync_s == _pick(2e7, world=4).sync_s  # int4
    assert _pick(5e5, world=4, gathered=by_codec) == _pick(5e5, world=4, gathered=True)  # sparse


def test_a_choice_from_a_checkpoint_is_checked():
    c = _pick(1.25e6)
    assert Choice.from_dict(c.as_dict()) == c
    old = {**c.as_dict(), "codec": "fp32", "keep": 0}  # an earlier release's choice: a resume keeps it
    assert Choice.from_dict(old).to_codec() == Codec("fp32")
    for bad in ({**c.as_dict(), "codec": "int2"}, {**c.as_dict(), "keep": 100}, {"codec": "fp32"}, "fp32"):
        with pytest.raises(ValueError, match="auto codec"):
            Choice.from_dict(bad)


def test_auto_knobs_are_checked_and_the_default_recipe_keeps_the_repr():
    # the repr enters a checkpoint's fingerprint: the default recipe leaves it as earlier releases wrote it
    assert repr(Auto()) == "Auto(headroom=0.8, overhead=0.25, step_s=None, latency_s=None, bytes_per_s=None)"
    assert "sparse_recipe=None" in repr(Auto(sparse_recipe=None))
    assert (SPARSE_RECIPE.outer_lr, SPARSE_RECIPE.outer_momentum, SPARSE_RECIPE.error_decay) == (2.0, 0.0, 0.95)
    for bad in (Recipe(outer_lr=-1.0), Recipe(outer_momentum=1.0), Recipe(error_decay=1.5),
                Recipe(outer_lr=float("nan")), Recipe(outer_lr=float("inf")), Recipe(error_decay=True)):
        with pytest.raises(ValueError, match="Recipe"):
            Auto(sparse_recipe=bad).check()
    with pytest.raises(TypeError, match="sparse_recipe"):
        Auto(sparse_recipe=(2.0, 0.0, 0.95)).check()


def _train(rank, world, steps, knobs, save_at=None, resume=None, **recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = DiLoCo(model, opt, sync_every=4, codec=knobs, fragments=2, fragment_sync_delay=1, verify_every=1,
                   mode="exact", **recipe)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        outer.load_state_dict(resume["outer"])
        start = resume["step"]
    g = torch.Generator().manual_seed(rank)
    saved = None
    for step in range(steps):
        x = torch.randn(8, 64, generator=g)
        if step < start:
            continue
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if save_at is not None and step + 1 == save_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": __import__("copy").deepcopy(opt.state_dict()), "outer": outer.state_dict(),
                     "step": step + 1}
    outer.finish()
    choice = outer.stats["auto"]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"choice": choice, "weights": weights, "saved": saved, "codec": str(outer.config.plan.codec),
            "keep": outer.config.plan.codec.keep}


def _run(rank, world):
    out = {}
    slow = Auto(bytes_per_s=2e4, latency_s=1e-3, step_s=0.01)  # the link given: a sparse codec
    a = _train(rank, world, 12, slow, save_at=6)
    b = _train(rank, world, 12, slow, resume=a["saved"])
    out["slow"] = (a["choice"]["codec"], a["choice"]["keep"], a["keep"])
    out["resumed equal"] = torch.equal(a["weights"], b["weights"]) and b["choice"] == a["choice"]
    fast = Auto(bytes_per_s=1e12, latency_s=1e-6, step_s=1.0)  # int4, the densest candidate
    c = _train(rank, world, 12, fast, save_at=6)
    d = _train(rank, world, 12, fast, resume=c["saved"])
    out["fast"] = c["choice"]["codec"]
    out["fast resumed equal"] = torch.equal(c["weights"], d["weights"]) and d["choice"] == c["choice"]
    measured = _train(rank, world, 8, "auto")  # loopback, measured: the link is fast
    out["measured"] = (measured["choice"]["codec"], measured["choice"]["fits"])
    out["weights"] = a["weights"]
    out["choice"] = measured["choice"]
    # the sparse choice ran SparseLoCo's recipe: the same bits as the codec and recipe named by hand
    chosen = Codec("sparse", keep=a["keep"])
    by_hand = _train(rank, world, 12, chosen, outer_lr=2.0, outer_momentum=0.0, error_decay=0.95)
    out["sparse recipe"] = torch.equal(a["weights"], by_hand["weights"])
    kept = _train(rank, world, 12, Auto(bytes_per_s=2e4, latency_s=1e-3, step_s=0.01, sparse_recipe=None))
    diloco_recipe = dict(outer_lr=0.7, outer_momentum=0.9, error_decay=1.0)  # codec="auto" configures DiLoCo's
    out["configured recipe"] = torch.equal(kept["weights"], _train(rank, world, 12, chosen, **diloco_recipe)["weights"])
    out["recipes differ"] = not torch.equal(kept["weights"], a["weights"])
    return out


def test_replicas_agree_record_and_resume_the_choice():
    r0, r1 = spawn.run(2, _run, timeout_s=120)
    assert r0["slow"][0] == "sparse" and r0["slow"][1] == r0["slow"][2] and r0["slow"] == r1["slow"]
    assert r0["resumed equal"] and r1["resumed equal"]
    assert r0["fast"] == "int4" and r0["fast resumed equal"] and r1["fast resumed equal"]
    assert torch.equal(r0["weights"], r1["weights"])
    assert r0["choice"] == r1["choice"]  # the same measurements on every replica
    assert r0["measured"][0] == "int4" and r0["measured"][1]
    for r in (r0, r1):
        assert r["sparse recipe"] and r["configured recipe"] and r["recipes differ"]


def _with_topology(rank, world):
    import flatcomm

    m = torch.nn.Linear(4, 4)
    try:
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=2, codec="auto",
               topology=flatcomm.Topology(local_size=1))
    except ValueError as e:
        return "flat outer sync" in str(e)
    return False


def test_auto_refuses_a_topology():
    assert all(spawn.run(2, _with_topology, timeout_s=60))
