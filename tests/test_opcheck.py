"""torch.library.opcheck for every flatcomm op: schema (incl. the in-place residual), fake kernels,
autograd registration and AOT dispatch."""
from __future__ import annotations

import pytest
import torch

import flatcomm  # noqa: F401  (registers the ops)
from flatcomm.ops import reference as R

ops = torch.ops.flatcomm


def _x(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def _k(codec, n, b, ratio=0.05):
    """The op's k: topk's kept count, or the chunked sparse codecs' default kept per chunk of b."""
    if codec in R.CHUNKED:
        return min(64, b)
    return R.topk_k(n, ratio) if codec == "topk" else 0


ENCODE_CASES = []
for codec in R.CODECS:
    for n, dtype, b, with_r, stoch in [(1, torch.float32, 32, False, False), (257, torch.bfloat16, 64, True, False),
                                       (1000, torch.float16, 256, True, codec in R.STOCHASTIC)]:
        ENCODE_CASES.append(pytest.param(codec, n, dtype, b, with_r, stoch, id=f"{codec}-{n}-{str(dtype)[6:]}-r{int(with_r)}-s{int(stoch)}"))


@pytest.mark.parametrize("codec,n,dtype,b,with_r,stoch", ENCODE_CASES)
def test_opcheck_encode(codec, n, dtype, b, with_r, stoch):
    x = _x(n, dtype)
    r = _x(n, seed=1) * 0.01 if with_r else None
    torch.library.opcheck(ops.encode, (x, codec, b, _k(codec, n, b), r, stoch, 3))


@pytest.mark.parametrize("codec", R.CODECS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_decode(codec, out_dtype):
    n, b = 300, 64
    p = flatcomm.encode(_x(n), codec, block_size=b, ratio=0.05)
    torch.library.opcheck(ops.decode, (p, codec, n, b, _k(codec, n, b), out_dtype))


@pytest.mark.parametrize("codec", R.CODECS)
@pytest.mark.parametrize("W", [1, 3])
def test_opcheck_decode_sum(codec, W):
    n, b = 300, 32
    P = torch.stack([flatcomm.encode(_x(n, seed=s), codec, block_size=b, ratio=0.05) for s in range(W)])
    torch.library.opcheck(ops.decode_sum, (P, codec, n, b, _k(codec, n, b), 1.0 / W))


@pytest.mark.parametrize("codec,out,with_r,stoch", [("int8", "int8", True, False), ("topk", "bf16", True, True),
                                                    ("fp16", "sign", False, False), ("int4", "fp32", True, False)])
def test_opcheck_decode_sum_encode(codec, out, with_r, stoch):
    n, b = 500, 64
    P = torch.stack([flatcomm.encode(_x(n, seed=s), codec, block_size=b, ratio=0.05) for s in range(2)])
    r = _x(n, seed=9) * 0.01 if with_r else None
    torch.library.opcheck(ops.decode_sum_encode, (P, codec, n, b, _k(codec, n, b), 0.5, out, 32, r, stoch, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("W,n", [(1, 5), (3, 300)])
def test_opcheck_sums(dtype, W, n):
    x = torch.stack([_x(n, dtype, seed=s) for s in range(W)])
    torch.library.opcheck(ops.ordered_sum, (x,))
    torch.library.opcheck(ops.exact_exponents, (x, 64))
    torch.library.opcheck(ops.exact_exponents, (x[0], 32))
    torch.library.opcheck(ops.exact_sum, (x, 64, 12))
    E = flatcomm.exact_exponents(x, 64)
    torch.library.opcheck(ops.to_exact, (x[0].contiguous(), E, 64, 12))
    acc = sum(flatcomm.to_exact(x[r].contiguous(), E, 64) for r in range(W))
    torch.library.opcheck(ops.from_exact, (acc, E, 64, 12))


_HAS_INTO = all(hasattr(ops, f"{o}_into") for o in ("encode", "decode", "decode_sum", "decode_sum_encode"))


@pytest.mark.skipif(not _HAS_INTO, reason="this build has no *_into ops")
@pytest.mark.parametrize("codec", ["int8", "topk", "bf16", "sign"])
def test_opcheck_into_variants(codec):
    n, b = 300, 64
    k = _k(codec, n, b)
    x = _x(n)
    payload = torch.empty(flatcomm.wire_bytes(codec, n, block_size=b, ratio=0.05), dtype=torch.uint8)
    torch.library.opcheck(ops.encode_into, (x, codec, b, k, _x(n, seed=2) * 0.01, False, 0, payload))
    p = flatcomm.encode(x, codec, block_size=b, ratio=0.05)
    torch.library.opcheck(ops.decode_into, (p, codec, n, b, k, torch.empty(n)))
    P = torch.stack([p, p])
    torch.library.opcheck(ops.decode_sum_into, (P, codec, n, b, k, 0.5, torch.empty(n)))
    out = torch.empty(flatcomm.wire_bytes("int8", n, block_size=32), dtype=torch.uint8)
    torch.library.opcheck(ops.decode_sum_encode_into,
                          (P, codec, n, b, k, 0.5, "int8", 32, torch.zeros(n), False, 0, out))


@pytest.mark.parametrize("codec", [c for c in R.CODECS if c != "topk" and c not in R.CHUNKED])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_decode_rows_into(codec, out_dtype):
    m, b, rows = 100, 32, 3
    P = torch.stack([flatcomm.encode(_x(m, seed=s), codec, block_size=b) for s in range(rows)])
    torch.library.opcheck(ops.decode_rows_into, (P, codec, m, b, torch.empty(rows * m - 7, dtype=out_dtype)))
    torch.library.opcheck(ops.decode_rows_into, (P[:1], codec, m, b, torch.empty(1, dtype=out_dtype)))
