"""The bench's SparseLoCo baseline (flatcomm/tools/bench/sparseloco.py): its packing, chunking and
quantizer against float64 / plain-Python references, and its outer sync on 2 gloo ranks against a
reference recomputed from both ranks' known weights (replicas equal, bytes as the formula says)."""
from __future__ import annotations

import pytest
import torch

from flatcomm.tools import spawn
from flatcomm.tools.bench import sparseloco as S


def test_pack12_and_codes_round_trip():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4096, (2 * 37,), generator=g)
    assert torch.equal(S.unpack12(S.pack12(idx), idx.numel()), idx)
    assert torch.equal(S.unpack12(S.pack12(idx[:5]), 5), idx[:5])  # odd: padded
    assert S.pack12(idx).numel() == 37 * 3  # 12 bits each
    assert S.pack12(torch.tensor([4095, 1])).tolist() == [0xFF, 0x1F, 0x00]  # Templar's byte layout
    for bits in (1, 2, 4, 8):
        q = torch.randint(0, 1 << bits, (53,), generator=g)
        packed = S.pack_codes(q, bits)
        assert packed.numel() == (53 * bits + 7) // 8
        assert torch.equal(S.unpack_codes(packed, 53, bits), q)


@pytest.mark.parametrize("shape", [(128, 192), (96, 7), (65,), (128,), (8, 3, 5), (1, 1)])
def test_chunks_cut_join_and_tiles(shape):
    x = torch.randn(shape, dtype=torch.float64)
    ch = S.Chunks(torch.Size(shape), 64, 64)
    c = ch.cut(x)
    assert c.shape == (ch.count, ch.size)
    assert torch.equal(ch.join(c), x)
    if len(shape) == 2 and ch.count > 1:  # tile 1 is the h x w block right of (or below) tile 0
        h, w = ch.h, ch.w
        assert torch.equal(c[1].reshape(h, w), x[:h, w:2 * w] if x.shape[1] // w > 1 else x[h:2 * h, :w])
    assert (ch.k % 2 == 0 and 2 <= ch.k <= ch.size) or ch.k == ch.size == 1
    assert S.largest_divisor_upto(67, 64) == 1 and S.largest_divisor_upto(192, 64) == 64
    assert S.largest_divisor_upto(96, 64) == 48


def test_quantize_bins_are_bin_means():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(1000, generator=g) * 0.01 + 0.002
    q, qp = S.quantize(v, 4, 6.0)
    vd = v.double()
    c = vd - vd.mean()
    scale = 6.0 * (c.norm() / (c.numel() - 1) ** 0.5) / 4
    want = torch.clamp(torch.round(c / scale + 2), 0, 3).long()
    assert (q != want).sum() <= 2  # fp32 vs fp64 rounding at bin edges only
    for b in range(4):
        sel = q == b
        if sel.any():
            assert abs(float(qp[2 + b]) - float((v[sel] - v.mean()).double().mean())) < 1e-7
    dq = S.dequantize(q, qp)
    assert dq.unique().numel() <= 4
    z, zp = S.quantize(torch.zeros(10), 4, 6.0)  # zero spread: scale 1, every value in the middle bin
    assert torch.equal(S.dequantize(z, zp), torch.zeros(10))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))


def _train(rank, world, steps, h):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = S.SparseLoCo(model, opt, sync_every=h, topk=16)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 128, generator=g)).pow(2).mean().backward()
        opt.step()
    outer.verify()
    return {"weights": [p.detach().clone() for p in model.parameters()], "stats": outer.stats,
            "error": [e.clone() for e in outer.error]}


def _one_sync(rank, world, chunking):
    """One sync after 3 local steps, with every rank's pre-sync weights known here to recompute it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = S.SparseLoCo(model, opt, sync_every=3, topk=16, chunking=chunking)
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 128, generator=g)).pow(2).mean().backward()
        if step == 2:
            outer._hook.remove()
            opt.step()
            before = [p.detach().clone() for p in model.parameters()]
            outer.after_inner_step()
        else:
            opt.step()
    every = [None] * world
    torch.distributed.all_gather_object(every, before)
    return {"before": every, "after": [p.detach().clone() for p in model.parameters()],
            "error": [e.clone() for e in outer.error], "payload": outer.payload_bytes}


def _flat(ts):
    return [torch.cat([t.reshape(-1) for t in ts])]


def _reference_sync(model, befores, topk, chunking):
    """SparseLoCo's sync recomputed per replica and tensor in float64 from the pre-sync weights."""
    masters = [p.detach().double() for p in model.parameters()]
    if chunking == "flat":
        masters, befores = _flat(masters), [_flat(b) for b in befores]
    out = []
    for t, m in enumerate(masters):
        ch = S.FlatChunks(m.numel(), 64 * 64, topk) if chunking == "flat" else S.Chunks(m.shape, 64, topk)
        idxs, vals = [], []
        for b in befores:
            x = ch.cut(m - b[t].double())  # the error starts at zero: e = delta
            idx = torch.topk(x.float().abs(), ch.k, dim=-1, sorted=False).indices
            q, qp = S.quantize(torch.gather(x, 1, idx).float().reshape(-1), 4, 6.0)
            idxs.append(idx)
            vals.append(S.dequantize(q, qp).double().reshape(idx.shape))
        norms = torch.stack([v.norm() for v in vals])
        med = norms.min() if len(vals) == 2 else norms.median()
        vals = [v * min(1.0, float(med / (n + 1e-8))) for v, n in zip(vals, norms)]
        s = torch.zeros(ch.count, ch.size, dtype=torch.float64)
        c = torch.zeros_like(s)
        for i, v in zip(idxs, vals):
            s.scatter_add_(1, i, v)
            c.scatter_add_(1, i, torch.ones_like(v))
        out.append(m - ch.join(torch.where(c > 0, s / c.clamp_min(1), s)))
    return out


@pytest.mark.parametrize("chunking", ["tiles", "flat"])
def test_sync_matches_reference_on_two_ranks(chunking):
    res = spawn.run(2, _one_sync, chunking, timeout_s=120)
    want = _reference_sync(_model(), res[0]["before"], 16, chunking)
    for r in res:
        after = _flat(r["after"]) if chunking == "flat" else r["after"]
        for a, w in zip(after, want):
            assert torch.allclose(a.double(), w, atol=1e-6), (a.double() - w).abs().max()
    assert torch.equal(torch.cat([t.flatten() for t in res[0]["after"]]),
                       torch.cat([t.flatten() for t in res[1]["after"]]))
    if chunking == "flat":
        assert res[0]["payload"] == S.FlatChunks(sum(p.numel() for p in _model().parameters()), 4096,
                                                 16).payload_bytes(4)
        return
    # the error accumulator keeps exactly what was not sent (a tensor's kept values + error = delta)
    m0 = [p.detach() for p in _model().parameters()]
    assert all((e != 0).any() for e in res[0]["error"])
    delta = [m - b for m, b in zip(m0, res[0]["before"][0])]
    kept = [d - e for d, e in zip(delta, res[0]["error"])]
    for k, ch in zip(kept, (S.Chunks(d.shape, 64, 16) for d in delta)):
        assert int((ch.cut(k) != 0).sum(1).max()) <= ch.k  # at most k values sent per chunk
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    assert res[0]["payload"] == sum(S.Chunks(p.shape, 64, 16).payload_bytes(4) for p in model.parameters())
    assert abs(S.nominal_bytes_per_param(model, 2, topk=16) - res[0]["payload"] / n) < 1e-12


def test_training_replicas_equal_and_bytes_counted():
    res = spawn.run(2, _train, 8, 4, timeout_s=120)
    for a, b in zip(res[0]["weights"], res[1]["weights"]):
        assert torch.equal(a, b)
    st = res[0]["stats"]
    assert st["syncs"] == 2 and st["wire_bytes"] == 2 * st["payload_bytes"]


def test_bytes_formula_at_4096_chunks():
    m = torch.nn.Linear(256, 512, bias=False)  # 32 tiles of 64 x 64
    bpp = S.nominal_bytes_per_param(m, 2)
    assert abs(bpp - (32 * 64 * 14 / 8 + 24) / (256 * 512)) < 1e-12
    assert abs(S.nominal_bytes_per_param(m, 4) - 3 * bpp) < 1e-12
    assert 0.0273 < bpp < 0.0276  # 14 bits per kept value, + 24 B per tensor
    lm = torch.nn.Sequential(torch.nn.Linear(100, 103), torch.nn.Linear(103, 7))  # 11,131 values: 3 runs
    assert S.nominal_bytes_per_param(lm, 2, chunking="flat") == (3 * 64 * 14 / 8 + 24) / 11131


def test_bench_diloco_formulas():
    """`bench diloco`'s per-row formula: two-stage 2 (R-1)/R payloads, gathered and SparseLoCo R-1."""
    from flatcomm.ops.codecs import wire_bytes
    from flatcomm.tools.bench.diloco import formula

    m = torch.nn.Linear(512, 1024)
    n = sum(p.numel() for p in m.parameters())
    payload = wire_bytes("sparse", n) / n
    assert 0 <= wire_bytes("sparse", n) - 88 * -(-n // 4096) <= 16  # 88 B per 4,096-value chunk + a header
    assert formula("sparse", m, 2)[0] == pytest.approx(payload)
    assert formula("sparse", m, 4)[0] == pytest.approx(1.5 * payload)
    assert formula("sparse:exact", m, 4)[0] == pytest.approx(3 * payload)
    assert formula("int4", m, 4)[0] == pytest.approx(1.5 * wire_bytes("int4", n) / n)
    assert formula("sparseloco", m, 4)[0] == pytest.approx(S.nominal_bytes_per_param(m, 4))
    assert formula("sparseloco:flat", m, 2)[0] == pytest.approx(S.nominal_bytes_per_param(m, 2, chunking="flat"))


def _bench_rows(rank, world):
    from flatcomm.tools.bench.diloco import _outer, formula

    out = {}
    for spec in ("sparse", "sparse:exact", "sparseloco", "sparseloco:flat"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 192), torch.nn.Linear(192, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        outer = _outer(spec, model, opt)
        for step in range(2):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step + 10 * rank)
            model(torch.randn(4, 128, generator=g)).pow(2).mean().backward()
            opt.step()
        n = sum(p.numel() for p in model.parameters())
        mode = getattr(getattr(outer, "config", None), "plan", None)
        out[spec] = {"type": type(outer).__name__, "mode": mode.mode if mode else None,
                     "counted": outer.stats["wire_bytes"] / outer.stats["syncs"] / n,
                     "formula": formula(spec, model, world)[0]}
        outer.close()
    return out


def test_bench_diloco_rows_count_what_the_formula_says():
    """`bench diloco`'s rows build what their names say, and each sync's own byte count matches the
    row's formula (the counters are checked against both in the bench itself)."""
    r = spawn.run(2, _bench_rows, timeout_s=120)[0]
    assert (r["sparse"]["type"], r["sparse"]["mode"]) == ("DiLoCo", "ordered")
    assert (r["sparse:exact"]["type"], r["sparse:exact"]["mode"]) == ("DiLoCo", "exact")
    assert r["sparseloco"]["type"] == r["sparseloco:flat"]["type"] == "SparseLoCo"
    for spec, row in r.items():
        assert row["counted"] == pytest.approx(row["formula"], rel=0.02), spec
