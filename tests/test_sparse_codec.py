"""The chunked sparse codecs (sparse, sparse4) against the independent reference
(flatcomm/ops/reference/sparse.py), bit for bit, on every instruction set of this CPU; the selected
set and decoded values against a float64 check; corrupt payloads."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flatcomm.ops.codecs as C
from flatcomm.ops.reference import sparse as ref

CHUNKED = [c for c in C.CODECS if C.TABLE[c].kind == "chunk_sparse"]


def _enc(x, codec, r=None, chunk=4096, keep=64):
    return C.encode(x, C.Codec(codec, block_size=chunk, keep=keep), residual=r)


def _dec(p, codec, n, chunk=4096, keep=64):
    return C.decode(p, C.Codec(codec, block_size=chunk, keep=keep), n)


def test_table_rows():
    assert CHUNKED == ["sparse", "sparse4", "sparse1"]
    c = C.resolve("sparse")
    assert (c.block_size, c.keep, c.k(10), c.align, c.chunked, c.sparse, c.reencodes_fused) == \
        (4096, 64, 64, 4096, True, False, False)
    assert C.resolve("int8").block_size == 256  # other codecs keep their default


def test_wire_bytes_budget():
    """4096 / 64, 2-bit: 8 B table + 64 B positions + 16 B codes per chunk = 0.0215 B/param."""
    n = 4096 * 1000
    assert C.wire_bytes("sparse", n) == 88 * 1000
    assert C.wire_bytes("sparse", n) / n <= 0.025
    assert C.wire_bytes("sparse4", n) == (32 + 64 + 32) * 1000
    # sparse1 at 192 of 4,096: a 4 B table, 152 B of positions (4 low bits each + 448 high bits), 24 B of
    # signs = 180 B: 0.0439 B/param, 1.5x top-128's positions for less than sparse's 0.0371 + 21%
    assert C.Codec("sparse1", keep=192).wire_bytes(n) == 180 * 1000
    for codec in CHUNKED:
        for n, chunk, keep in [(1, 32, 1), (100, 64, 5), (5000, 4096, 64), (4097, 128, 128)]:
            assert C.Codec(codec, block_size=chunk, keep=keep).wire_bytes(n) == ref.wire_bytes(codec, n, chunk, keep)


@pytest.mark.parametrize("codec", CHUNKED)
@pytest.mark.parametrize("n,chunk,keep", [(1, 32, 1), (31, 32, 4), (100, 64, 5), (4096, 4096, 64),
                                          (5000, 4096, 64), (3000, 256, 256), (777, 96, 17)])
def test_matches_reference(codec, n, chunk, keep):
    g = torch.Generator().manual_seed(n * 7 + keep)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10
    r = torch.randn(n, generator=g) * 0.1
    r0 = r.clone()
    p = _enc(x, codec, r, chunk, keep)
    rp, rr = ref.encode(x, codec, residual=r0, chunk=chunk, keep=keep)
    assert torch.equal(p, rp)
    assert torch.equal(r.view(torch.int32), rr.view(torch.int32))
    d = _dec(p, codec, n, chunk, keep)
    assert torch.equal(d.view(torch.int32), ref.decode(p, codec, n, chunk, keep).view(torch.int32))
    # float64 checks: the kept set is the top-keep of each chunk (ties to the lower position),
    # decoded + residual gives back v to fp32 rounding, unsent values stay whole in the residual.
    v = (x + r0).double()
    for c in range(math.ceil(n / chunk)):
        vc, dc, rc = v[c * chunk:(c + 1) * chunk], d[c * chunk:(c + 1) * chunk].double(), r[c * chunk:(c + 1) * chunk].double()
        kk = min(keep, len(vc))
        want = sorted(sorted(range(len(vc)), key=lambda i: (-abs(float(vc[i])), i))[:kk])
        got = torch.nonzero(dc != 0).flatten().tolist()
        assert set(got) <= set(want)
        unsent = torch.ones(len(vc), dtype=torch.bool)
        unsent[want] = False
        assert torch.equal(rc[unsent], vc[unsent])
        err = (dc + rc - vc).abs()  # only the fp32 rounding of r = v - d, |v - d| <= 2 max(|v|, |d|)
        assert bool((err <= torch.maximum(vc.abs(), dc.abs()) * 2**-23 + 1e-45).all())


@pytest.mark.parametrize("codec", CHUNKED)
def test_spread_magnitudes_match_reference(codec):
    """The threshold search's paths: kept values within the top exponent, a few exponents down,
    and spread so widely (a handful per exponent) that the digit histogram decides; subnormals."""
    g = torch.Generator().manual_seed(9)
    n = 4096 * 4
    top = torch.randn(n, generator=g)
    few = torch.randn(n, generator=g) * 1e-3
    few[torch.arange(0, 4096, 64)] *= 1e3 * 2.0 ** torch.arange(64).float().div(8).floor()  # 8 per exponent
    wide = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
    tiny = torch.randn(n, generator=g) * 1e-40  # subnormal
    for x in (top, few, wide, tiny):
        r = torch.zeros(n)
        r0 = r.clone()
        p = _enc(x, codec, r)
        rp, rr = ref.encode(x, codec, residual=r0)
        assert torch.equal(p, rp) and torch.equal(r.view(torch.int32), rr.view(torch.int32))


def test_stochastic_and_dtypes():
    x = torch.randn(5000)
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        p = _enc(xd, "sparse")
        rp, _ = ref.encode(xd, "sparse")
        assert torch.equal(p, rp)
    with pytest.raises(RuntimeError, match="stochastic"):
        C.encode(x, "sparse", stochastic=True)


@pytest.mark.parametrize("codec", CHUNKED)
def test_ties_zeros_huge_nonfinite(codec):
    n, chunk, keep = 4096 * 3 + 50, 4096, 64
    x = torch.zeros(n)
    x[4096:8192] = 1.5  # all tied: the first 64 positions win
    x[8192 + 10] = 3e38
    x[8192 + 11] = -3e38
    x[8192 + 12] = float("inf")  # chunk 2 non-finite
    x[-3] = float("nan")  # the last partial chunk non-finite
    r = torch.full((n,), 0.25)
    r0 = r.clone()
    p = _enc(x, codec, r, chunk, keep)
    rp, rr = ref.encode(x, codec, residual=r0, chunk=chunk, keep=keep)
    assert torch.equal(p, rp) and torch.equal(r.view(torch.int32), rr.view(torch.int32))
    d = _dec(p, codec, n, chunk, keep)
    assert torch.equal(torch.nonzero(d[:4096]).flatten(), torch.arange(64))  # zeros + 0.25: first 64
    assert torch.equal(torch.nonzero(d[4096:8192]).flatten(), torch.arange(64))
    assert bool(d[8192:].isnan().all())  # non-finite chunks decode to NaN everywhere
    assert torch.equal(r[8192:], r0[8192:])  # ... and keep their residual
    # huge finite values stay finite
    y = torch.zeros(4096)
    y[:3] = torch.tensor([3.4e38, -3.4e38, 1e38])
    dy = _dec(_enc(y, codec), codec, 4096)
    big = 1e36 if codec == "sparse1" else 1e38  # sparse1's one level: the mean of 64 kept, 61 of them 0
    assert bool(dy.isfinite().all()) and dy[0] > big and dy[1] < -big


def test_empty():
    p = _enc(torch.zeros(0), "sparse", torch.zeros(0))
    assert p.numel() == 0 and _dec(p, "sparse", 0).numel() == 0


def test_error_feedback_sends_everything_eventually():
    """With a constant input, the sum of what is decoded over many rounds tracks the sum of inputs:
    the residual keeps what was not sent."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096 * 2, generator=g)
    r = torch.zeros_like(x)
    total = torch.zeros_like(x, dtype=torch.float64)
    rounds = 1000
    for _ in range(rounds):
        total += _dec(_enc(x, "sparse", r), "sparse", x.numel()).double()
    # nothing is lost (to fp32 rounding), and the residual stays bounded (each value is sent about
    # once every 4096 / 64 rounds), so the average sent converges to x
    assert torch.allclose(total + r.double(), x.double() * rounds, atol=1e-2)
    assert float(r.abs().max()) < 100 * float(x.abs().max())
    assert float((total / rounds - x.double()).norm() / x.double().norm()) < 0.05


def _payload(codec="sparse", n=4096 * 2 + 100):
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    return _enc(x, codec), n


@pytest.mark.parametrize("mutate,match", [
    (lambda p, L: p.__setitem__(0, 0xFF) or p.__setitem__(1, 0xFF) or p.__setitem__(2, 0xFF) or p.__setitem__(3, 0x7F), "table"),
    (lambda p, L: p[0:4].copy_(torch.tensor([0, 0, 0x80, 0x7F], dtype=torch.uint8)), "table"),  # +inf
    (lambda p, L: p[0:4].copy_(torch.tensor([0, 0, 0x80, 0xBF], dtype=torch.uint8)), "table"),  # -1.0
    (lambda p, L: p[L + 64 - 1:L + 64].fill_(0xFF), "kept count|beyond|ascending"),
    (lambda p, L: p[L + 48:L + 64].zero_(), "kept count"),
])
def test_corrupt_payload_is_an_error(mutate, match):
    p, n = _payload()
    nc, off, g = ref.layout("sparse", n, 4096, 64)
    bad = p.clone()
    mutate(bad, off)
    with pytest.raises(RuntimeError, match=match):
        _dec(bad, "sparse", n)
    with pytest.raises(RuntimeError, match=match):
        C.decode_sum(torch.stack([p, bad]), "sparse", n)


def test_random_garbage_never_crashes():
    """Random bytes: a clear error or defined values, never a crash (ASan fuzz covers the bounds)."""
    g = torch.Generator().manual_seed(3)
    for codec in CHUNKED:
        for n in (50, 4096, 9000):
            size = C.wire_bytes(codec, n)
            for _ in range(30):
                p = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
                try:
                    _dec(p, codec, n)
                except RuntimeError as e:
                    assert f"invalid {codec} payload" in str(e)


def test_out_of_range_position_in_last_partial_chunk():
    """A position past the end of a short last chunk (valid for a full chunk) is refused."""
    n = 4096 + 40
    x = torch.zeros(n)
    x[-1] = 5.0
    p = _enc(x, "sparse")
    nc, off, g = ref.layout("sparse", n, 4096, 64)
    buf = bytearray(p.numpy().tobytes())
    base = off + g["rec_bytes"]
    # the last chunk's positions 0..39; move its high bit vector's last one beyond 39
    high0 = 64 * g["low"]
    ones = [q for q in range(g["high"]) if (buf[base + ((high0 + q) >> 3)] >> ((high0 + q) & 7)) & 1]
    last = ones[-1]
    buf[base + ((high0 + last) >> 3)] &= ~(1 << ((high0 + last) & 7)) & 0xFF
    q = last + 2
    buf[base + ((high0 + q) >> 3)] |= 1 << ((high0 + q) & 7)
    bad = torch.tensor(list(buf), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="beyond the chunk"):
        _dec(bad, "sparse", n)


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep"):
        C.Codec("sparse", block_size=64, keep=65)
    with pytest.raises(ValueError, match="multiple of 32"):
        C.Codec("sparse", block_size=100)
    x = torch.randn(1000)
    with pytest.raises(RuntimeError, match="re-encode"):  # no fused re-encode into a chunked codec
        C.decode_sum(C.encode(x, "int8").unsqueeze(0), "int8", 1000, reencode="sparse")
    # from chunked rows the re-encode runs in two passes: decode_sum, then encode
    p, n = _payload()
    P = torch.stack([p, p])
    r1, r2 = torch.zeros(n), torch.zeros(n)
    got = C.decode_sum(P, "sparse", n, scale=0.5, reencode="int8", residual=r1)
    want = C.encode(C.decode_sum(P, "sparse", n, scale=0.5), "int8", residual=r2)
    assert torch.equal(got, want) and torch.equal(r1, r2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="subprocess per ISA")
def test_every_isa_gives_the_same_bytes():
    from flatcomm import _C
    isas = _C.build_info().get("supported_isas", "baseline").split(",") if isinstance(_C.build_info(), dict) else ["baseline"]
    code = ("import torch, flatcomm.ops.codecs as C; g=torch.Generator().manual_seed(5); x=torch.randn(20000, generator=g); "
            "r=torch.randn(20000, generator=g); p=C.encode(x,'sparse',residual=r); "
            "print(int(p.sum()), int(r.view(torch.int32).long().sum()), float(C.decode(p,'sparse',20000).sum()))")
    outs = set()
    for isa in set(isas) | {"baseline"}:
        env = dict(os.environ, FLATCOMM_SIMD=isa.strip())
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                timeout=300, check=True).stdout)
    assert len(outs) == 1
