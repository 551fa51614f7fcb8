"""encode / decode: payload bits and decoded values equal the reference; per-codec error bounds;
special values (zeros, subnormals, values near FLT_MAX, inf/NaN)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import BLOCK_SIZES, CODECS, DTYPES, SIZES, assert_bits_equal, make_input

RATIO = 0.05

# every codec x dtype x size; the block size cycles with the case index so all four appear for
# every codec and size over the dtypes.
MATRIX = [
    pytest.param(codec, dtype, n, BLOCK_SIZES[(i + j) % 4], id=f"{codec}-{str(dtype)[6:]}-{n}-B{BLOCK_SIZES[(i + j) % 4]}")
    for i, (codec, n) in enumerate(itertools.product(CODECS, SIZES))
    for j, dtype in enumerate(DTYPES)
]


def _enc(x, codec, b, **kw):
    return flatcomm.encode(x, codec, block_size=b, ratio=RATIO, **kw)


def _dec(p, codec, n, b, **kw):
    return flatcomm.decode(p, codec, n, block_size=b, ratio=RATIO, **kw)


@pytest.mark.parametrize("codec,dtype,n,b", MATRIX)
def test_encode_decode_bits_match_reference(gen, codec, dtype, n, b):
    x = make_input(gen, n, dtype)
    p = _enc(x, codec, b)
    assert p.dtype == torch.uint8 and p.dim() == 1
    assert p.numel() == flatcomm.wire_bytes(codec, n, block_size=b, ratio=RATIO)
    assert_bits_equal(p, R.encode(x, codec, block_size=b, ratio=RATIO), "payload")
    d = _dec(p, codec, n, b)
    assert_bits_equal(d, R.decode(p, codec, n, block_size=b, ratio=RATIO), "decode")
    for out_dtype in (torch.bfloat16, torch.float16):
        assert_bits_equal(_dec(p, codec, n, b, dtype=out_dtype),
                          R.decode(p, codec, n, block_size=b, ratio=RATIO, dtype=out_dtype), f"decode {out_dtype}")


@pytest.mark.parametrize("codec", R.BLOCKWISE)
@pytest.mark.parametrize("b", BLOCK_SIZES)
@pytest.mark.parametrize("n", [1, 33, 4097, 10000])
def test_every_block_size(gen, codec, b, n):
    x = make_input(gen, n, torch.float32, kind="wide")
    r = torch.randn(n, generator=gen) * 1e-3
    r_ref = r.clone()
    p = _enc(x, codec, b, residual=r)
    assert_bits_equal(p, R.encode(x, codec, block_size=b, residual=r_ref), "payload")
    assert_bits_equal(r, r_ref, "residual")


def test_payload_padding_is_zero(gen):
    for codec, n, b in itertools.product(CODECS, (1, 33, 97, 257), (32, 64)):
        x = make_input(gen, n)
        p = _enc(x, codec, b)
        k = R.topk_k(n, RATIO) if codec == "topk" else min(64, b) if codec in R.CHUNKED else 0
        nb, off, total = R.layout(codec, n, b, k)
        assert p.numel() == total
        if codec in R.BLOCKWISE:
            assert (p[4 * nb:off] == 0).all()
            assert (p[off + -(-n * R.CODE_BITS[codec] // 8):] == 0).all()
        elif codec == "topk":
            assert (p[4 * k:off] == 0).all() and (p[off + 4 * k:] == 0).all()
        elif codec in R.CHUNKED:
            nc, off2, g = R.sparse.layout(codec, n, b, k)
            assert (p[4 * g["levels"] * nc:off2] == 0).all() and (p[off2 + nc * g["rec_bytes"]:] == 0).all()
        else:
            assert (p[n * R.CAST_BYTES[codec]:] == 0).all()


def test_fp32_roundtrip_is_exact(gen):
    x = make_input(gen, 4099, kind="wide")
    x[::7] = -0.0
    assert_bits_equal(_dec(_enc(x, "fp32", 256), "fp32", 4099, 256), x)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_int_error_bound(gen, codec, dtype, b):
    n = 5000
    x = make_input(gen, n, dtype, kind="mixed")
    p = _enc(x, codec, b)
    d = _dec(p, codec, n, b).double()
    x64 = x.double()
    qmax = R.QMAX[codec]
    scales = R.block_scales(p, codec, n, b).double()
    # scale = max|x| / qmax per block, to fp32 rounding
    absmax = torch.nn.functional.pad(x64.abs(), (0, -n % b)).reshape(-1, b).amax(1)
    assert torch.allclose(scales, absmax / qmax, rtol=2**-23, atol=0)
    s = scales.repeat_interleave(b)[:n]
    # |x - decode| <= scale / 2, up to fp32 rounding of the code arithmetic (a few 1e-5 of a step)
    assert ((x64 - d).abs() <= s / 2 * (1 + 1e-4) + 2.0**-149).all()
    assert ((x64 - d).abs() <= R.dequant_error_bound(x, codec, b)).all()
    # codes are integers in [-qmax, qmax] and decode is code * scale in fp32
    _, off, _ = R.layout(codec, n, b)
    raw = p[off:].to(torch.int64)
    if codec == "int8":
        q = torch.where(raw >= 128, raw - 256, raw)[:n]
    else:
        q = torch.stack([raw & 15, raw >> 4], 1).reshape(-1)[:n] - 8
    assert (q.abs() <= qmax).all()
    assert_bits_equal(d.float(), q.float() * s.float(), "code * scale")


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_error_bound(gen, codec, dtype):
    x = make_input(gen, 20000, dtype, kind="mixed")
    d = _dec(_enc(x, codec, 256), codec, x.numel(), 256).double()
    x64 = x.double()
    u = 2.0**-8 if codec == "bf16" else 2.0**-11
    tiny = 2.0**-134 if codec == "bf16" else 2.0**-25
    assert ((x64 - d).abs() <= torch.maximum(x64.abs() * u, torch.full_like(x64, tiny))).all()
    if dtype == torch.bfloat16 and codec == "bf16" or dtype == torch.float16 and codec == "fp16":
        assert_bits_equal(d.float(), x.float(), "lossless when the input is already that type")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_sign_magnitudes_are_block_mean(gen, dtype, b):
    n = 3 * b + 17
    x = make_input(gen, n, dtype)
    p = _enc(x, "sign", b)
    d = _dec(p, "sign", n, b).double()
    x64 = x.double()
    xb = torch.nn.functional.pad(x64.abs(), (0, -n % b)).reshape(-1, b)
    counts = torch.tensor([min(b, n - i * b) for i in range(xb.shape[0])], dtype=torch.float64)
    mean = (xb.sum(1) / counts).repeat_interleave(b)[:n]
    rel = (b / 32 + 8) * 2.0**-24
    assert ((d.abs() - mean).abs() <= mean * rel + 2.0**-149).all()
    # the sign bit: set exactly for negative values (not for -0.0)
    assert torch.equal(d.signbit(), x64 < 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,ratio", [(1, 0.01), (97, 0.01), (1000, 0.1), (4099, 0.3), (257, 1.0), (65537, 0.01)])
def test_topk_keeps_exactly_the_k_largest(gen, dtype, n, ratio):
    x = make_input(gen, n, dtype)
    p = flatcomm.encode(x, "topk", ratio=ratio)
    d = flatcomm.decode(p, "topk", n, ratio=ratio)
    k = R.topk_k(n, ratio)
    idx, val = R.topk_entries(p, n, ratio)
    assert idx.numel() == k
    assert (idx[1:] > idx[:-1]).all(), "indices strictly ascending"
    xf = x.float()
    assert_bits_equal(val, xf[idx], "kept values are exact")
    # the kept set is the k largest |x| with ties to the lower index
    # larger |x| first, then the lower index (numpy lexsort: last key is primary)
    order = np.lexsort((np.arange(n), -R.abs_bits(xf).numpy()))
    want = torch.from_numpy(np.sort(order[:k])).to(torch.int64)
    assert torch.equal(idx, want)
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx] = False
    assert (d[rest] == 0).all() and not d[rest].signbit().any()
    if k < n:  # every kept magnitude >= every dropped one
        assert xf[idx].abs().min() >= xf[rest].abs().max()


# ---- special values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_all_zero_blocks_decode_to_zero(codec):
    n = 1000
    x = torch.zeros(n)
    x[300:400] = torch.linspace(-1, 1, 100)  # blocks elsewhere are all zero
    r = torch.zeros(n)
    p = flatcomm.encode(x, codec, residual=r, block_size=64, ratio=0.5)
    d = flatcomm.decode(p, codec, n, block_size=64, ratio=0.5)
    zero = torch.ones(n, dtype=torch.bool)
    zero[256:448] = False
    assert_bits_equal(d[zero], torch.zeros(int(zero.sum())), "zero blocks")
    assert_bits_equal(r[zero], torch.zeros(int(zero.sum())), "residual of zero blocks")
    if codec in R.BLOCKWISE:
        sc = R.block_scales(p, codec, n, 64)
        assert (sc[[0, 1, 2, 3, 7, 8, 15]] == 0).all()
    assert torch.isfinite(d).all() and torch.isfinite(r).all()
    assert_bits_equal(p, R.encode(x, codec, residual=torch.zeros(n), block_size=64, ratio=0.5))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("tiny", [1e-45, 1e-40, 1e-38, 2.0**-126])
def test_subnormal_values(gen, codec, tiny):
    n = 300
    x = (torch.randn(n, generator=gen) * tiny).float()  # many subnormals, some exact zeros
    x[5] = tiny
    r = torch.zeros(n)
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=32, ratio=0.2)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=32, ratio=0.2), "payload")
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, n, block_size=32, ratio=0.2)
    assert torch.isfinite(d).all() and torch.isfinite(r).all()
    gap, allowed = R.ef_identity_error(x, torch.zeros(n), d, r)
    assert (gap <= allowed).all()
    if codec in ("int8", "int4", "bf16", "fp16", "fp32"):
        assert ((x.double() - d.double()).abs() <= R.dequant_error_bound(x, codec, 32)).all()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_near_float_max(gen, codec, dtype):
    n = 256
    x = torch.randn(n, generator=gen) * 1e37
    x[3] = 3.4028234e38
    x[100] = -3.4028234e38
    x[200:210] = 3.4e38
    if dtype == torch.bfloat16:  # keep the input finite: bf16's largest value is 3.3895e38
        big = torch.finfo(torch.bfloat16).max
        x = x.clamp(-big, big)
    x = x.to(dtype)
    assert torch.isfinite(x).all()
    p = flatcomm.encode(x, codec, block_size=64, ratio=0.1)
    assert_bits_equal(p, R.encode(x, codec, block_size=64, ratio=0.1))
    d = flatcomm.decode(p, codec, n, block_size=64, ratio=0.1)
    if codec == "fp16":
        assert torch.isinf(d[x.float().abs() >= 65520]).all()
        return
    if codec == "bf16" and dtype == torch.float32:
        # above the largest bf16 (3.3895e38 + half ulp) the cast overflows to inf, per element
        big = x.float().abs() > 3.3961775e38
        assert torch.isinf(d[big]).all() and torch.isfinite(d[~big]).all()
        return
    assert torch.isfinite(d).all(), "decode of values near FLT_MAX must stay finite"
    if codec in ("int8", "int4", "fp32", "bf16"):
        assert ((x.double() - d.double()).abs() <= R.dequant_error_bound(x, codec, 64)).all()
    if codec == "sign":
        mean = x.double().abs().reshape(-1, 64).mean(1).repeat_interleave(64)
        assert torch.allclose(d.double().abs(), mean, rtol=1e-5)


@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_poisons_only_its_block(gen, codec, bad, dtype):
    n, b = 1000, 64
    x = make_input(gen, n, dtype)
    x[130] = bad  # block 2
    x[999] = bad  # last (partial) block
    r = torch.randn(n, generator=gen) * 1e-3
    r_old = r.clone()
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=b)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=b), "payload")
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, n, block_size=b)
    poisoned = torch.zeros(n, dtype=torch.bool)
    poisoned[128:192] = True
    poisoned[960:] = True
    assert torch.isnan(d[poisoned]).all(), "the whole block decodes to NaN"
    assert torch.isfinite(d[~poisoned]).all(), "other blocks unaffected"
    assert_bits_equal(r[poisoned], r_old[poisoned], "poisoned block keeps its old residual")
    assert torch.isfinite(r).all()
    # other blocks equal the encoding of x without the bad values
    x2 = x.clone()
    x2[poisoned] = 0
    d2 = flatcomm.decode(flatcomm.encode(x2, codec, residual=r_old.clone(), block_size=b), codec, n, block_size=b)
    assert_bits_equal(d[~poisoned], d2[~poisoned], "unaffected blocks")


@pytest.mark.parametrize("codec", ["sparse", "sparse4", "sparse1"])
def test_chunked_sparse_levels(gen, codec):
    """Direct check: each chunk's kept values (the `keep` largest |v|) decode to their sign times a
    level between the chunk's smallest and largest kept |v|; everything else decodes to zero."""
    n, b, keep = 5000, 256, 16
    x = make_input(gen, n, kind="mixed")
    d = flatcomm.decode(flatcomm.encode(x, flatcomm.Codec(codec, block_size=b, keep=keep)),
                        flatcomm.Codec(codec, block_size=b, keep=keep), n).double()
    x64 = x.double()
    for c in range(0, n, b):
        xc, dc = x64[c:c + b], d[c:c + b]
        kept = sorted(sorted(range(len(xc)), key=lambda i: (-abs(float(xc[i])), i))[:keep])
        mask = torch.zeros(len(xc), dtype=torch.bool)
        mask[kept] = True
        assert (dc[~mask] == 0).all()
        lo, hi = xc[mask].abs().min(), xc[mask].abs().max()
        nz = dc[mask] != 0
        assert (torch.sign(dc[mask][nz]) == torch.sign(xc[mask][nz])).all()
        assert ((dc[mask].abs() >= lo * (1 - 2**-23)) | ~nz).all() and (dc[mask].abs() <= hi * (1 + 2**-23)).all()


@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp16", "topk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_per_element_for_casts_and_topk(gen, codec, dtype):
    n = 500
    x = make_input(gen, n, dtype)
    x[[10, 20, 30]] = torch.tensor([math.inf, -math.inf, math.nan]).to(dtype)
    r = torch.randn(n, generator=gen) * 1e-3
    r_old, r_ref = r.clone(), r.clone()
    p = flatcomm.encode(x, codec, residual=r, ratio=0.1)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, ratio=0.1), "payload")
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, n, ratio=0.1)
    assert_bits_equal(r[[10, 20, 30]], r_old[[10, 20, 30]], "non-finite elements keep their residual")
    assert torch.isfinite(r).all()
    if codec != "topk":
        assert torch.isinf(d[10]) and d[10] > 0 and torch.isinf(d[20]) and d[20] < 0 and torch.isnan(d[30])
        others = torch.ones(n, dtype=torch.bool)
        others[[10, 20, 30]] = False
        assert torch.isfinite(d[others]).all()
    else:  # inf and NaN rank above every finite magnitude, so they are sent
        idx, _ = R.topk_entries(p, n, 0.1)
        assert {10, 20, 30} <= set(idx.tolist())


def test_fp16_overflow_is_inf_and_keeps_residual():
    x = torch.tensor([1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6])
    r = torch.full((6,), 0.25)
    p = flatcomm.encode(x, "fp16", residual=r)
    d = flatcomm.decode(p, "fp16", 6)
    assert d[:3].isfinite().all() and torch.isinf(d[3:]).all()
    assert_bits_equal(r[3:], torch.full((3,), 0.25), "overflowed elements keep their residual")
    assert_bits_equal(r[:3], (x[:3] + 0.25) - d[:3])


def test_encode_accepts_any_shape(gen):
    x = make_input(gen, 6 * 70).reshape(6, 7, 10)
    for codec in CODECS:
        assert_bits_equal(flatcomm.encode(x, codec, ratio=0.1), flatcomm.encode(x.reshape(-1), codec, ratio=0.1))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("stoch", [False, True])
def test_signed_zeros(codec, stoch):
    # -0.0 inputs and residuals: payload and residual bits (including the sign of zero) as the reference
    if stoch and codec not in R.STOCHASTIC:
        return
    x = torch.tensor([-0.0, 0.0, -0.0, 1.0, -0.0, -1e-45, 0.0, -0.0] * 8)
    r = torch.tensor([-0.0, -0.0, 0.0, -0.0] * 16)
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=32, ratio=0.1, stochastic=stoch)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=32, ratio=0.1, stochastic=stoch))
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, 64, block_size=32, ratio=0.1)
    assert_bits_equal(d, R.decode(p, codec, 64, block_size=32, ratio=0.1))


def test_int8_scale_steps_down_at_float_max():
    # FLT_MAX / 127 rounds so that scale * 127 overflows: the kernel steps scale down one ulp
    x = torch.zeros(64)
    x[0] = 3.4028234663852886e38
    x[1] = -3.4028234663852886e38
    x[2] = 1.0
    p = flatcomm.encode(x, "int8", block_size=32)
    s = R.block_scales(p, "int8", 64, 32)[0]
    naive = torch.tensor(3.4028234663852886e38) / torch.tensor(127.0)
    assert torch.isinf(naive * 127.0)
    assert R.f32_bits(s).item() == R.f32_bits(naive).item() - 1
    assert torch.isfinite(s * 127.0)
    d = flatcomm.decode(p, "int8", 64, block_size=32)
    assert torch.isfinite(d).all() and d[0] == s * 127 and d[1] == -s * 127


@pytest.mark.parametrize("codec", ["int8", "int4", "sign", "bf16", "fp16", "topk"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_decode_low_precision_output_with_nonfinite(gen, codec, out_dtype):
    n = 300
    x = make_input(gen, n) * 100
    x[[3, 100, 250]] = torch.tensor([math.nan, math.inf, -math.inf])
    x[200] = 1e6  # fp16 output overflows to inf
    p = flatcomm.encode(x, codec, block_size=32, ratio=0.2)
    got = flatcomm.decode(p, codec, n, block_size=32, ratio=0.2, dtype=out_dtype)
    assert got.dtype == out_dtype
    assert_bits_equal(got, R.decode(p, codec, n, block_size=32, ratio=0.2, dtype=out_dtype))
