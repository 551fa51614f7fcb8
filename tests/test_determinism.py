"""Determinism: the same bits for 1 or 2 threads and for every CPU SIMD build (baseline, AVX2,
AVX-512 where the CPU has it), on inputs large enough to be split across threads."""
from __future__ import annotations

import pytest
import torch

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import assert_bits_equal

N = (1 << 20) + 4099  # > 1M elements: many parallel ranges, a ragged tail


def _inputs():
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(N, generator=g) * torch.exp2(torch.randint(-10, 11, (N,), generator=g).float())
    x[12345] = float("inf")  # one poisoned block
    r = torch.randn(N, generator=g) * 1e-3
    rows = torch.randn(3, N, generator=g)
    return x, r, rows


def _run_everything():
    """Every op on the big inputs; returns a flat list of result tensors."""
    x, r0, rows = _inputs()
    out = []
    for codec in R.CODECS:
        for dtype in (torch.float32, torch.bfloat16):
            r = r0.clone()
            xs = x.to(dtype)
            stoch = codec in R.STOCHASTIC and dtype == torch.float32
            p = flatcomm.encode(xs, codec, residual=r, block_size=64, ratio=0.01, stochastic=stoch, seed=5)
            out += [p, r, flatcomm.decode(p, codec, N, block_size=64, ratio=0.01)]
        P = torch.stack([flatcomm.encode(rows[i], codec, block_size=256, ratio=0.01) for i in range(3)])
        out.append(flatcomm.decode_sum(P, codec, N, block_size=256, ratio=0.01, scale=1 / 3))
        if codec != "topk":
            r = r0.clone()
            out += [flatcomm.decode_sum(P, codec, N, block_size=256, ratio=0.01, scale=1 / 3, reencode="int8" if codec != "int8" else "sign",
                                        residual=r, reencode_block_size=32), r]
    out.append(flatcomm.ordered_sum(rows))
    out.append(flatcomm.ordered_sum(rows.to(torch.float16)))
    out.append(flatcomm.exact_sum(rows, 256))
    E = flatcomm.exact_exponents(rows, 64)
    acc = sum(flatcomm.to_exact(rows[i], E, 64) for i in range(3))
    out += [E, acc, flatcomm.from_exact(acc, E, 64)]
    return out


def _compare(a, b, what):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert_bits_equal(u, v, f"{what}: result #{i}")


def test_thread_count_independent(restore_threads):
    torch.set_num_threads(1)
    one = _run_everything()
    torch.set_num_threads(2)
    two = _run_everything()
    _compare(one, two, "1 vs 2 threads")


def test_simd_builds_identical(restore_simd):
    supported = flatcomm.build_info()["simd_supported"].split(",")
    assert "baseline" in supported
    results = {}
    for isa in ("baseline", "avx2", "avx512"):
        ok = flatcomm._C.set_simd(isa)
        assert ok == (isa in supported), isa
        if not ok:
            continue
        assert flatcomm.build_info()["simd"] == isa
        results[isa] = _run_everything()
    assert flatcomm._C.set_simd("no-such-isa") is False
    base = results.pop("baseline")
    if not results:
        pytest.skip("only the baseline build runs on this CPU")
    for isa, res in results.items():
        _compare(base, res, f"baseline vs {isa}")


def test_simd_builds_match_reference_small(restore_simd):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5000, generator=g)
    r = torch.randn(5000, generator=g) * 0.01
    for isa in ("baseline", "avx2", "avx512"):
        if not flatcomm._C.set_simd(isa):
            continue
        for codec in R.CODECS:
            r1, r2 = r.clone(), r.clone()
            stoch = codec in R.STOCHASTIC
            p = flatcomm.encode(x, codec, residual=r1, block_size=32, ratio=0.1, stochastic=stoch, seed=1)
            assert_bits_equal(p, R.encode(x, codec, residual=r2, block_size=32, ratio=0.1, stochastic=stoch, seed=1), f"{isa} {codec}")
            assert_bits_equal(r1, r2, f"{isa} {codec} residual")


def test_repeated_calls_identical():
    x, r0, _ = _inputs()
    a = [flatcomm.encode(x, c, residual=r0.clone(), ratio=0.01) for c in R.CODECS]
    b = [flatcomm.encode(x, c, residual=r0.clone(), ratio=0.01) for c in R.CODECS]
    _compare(a, b, "repeat")
