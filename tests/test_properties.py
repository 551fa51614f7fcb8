"""Hypothesis property tests: fp32 round trip, EF identity, per-codec bounds, and bit equality with
the reference on adversarial inputs (subnormals, ties, values near FLT_MAX, repeated magnitudes)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import flatcomm
from flatcomm.ops import reference as R

from _support.kernels import assert_bits_equal

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32)
moderate32 = st.floats(width=32, min_value=-(2.0**100), max_value=2.0**100)
blocks = st.sampled_from([32, 64, 256, 4096])


def arrays(elements, min_size=0, max_size=700):
    return hnp.arrays(np.float32, st.integers(min_size, max_size), elements=elements)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).clone()


@SETTINGS
@given(arrays(any32))
def test_fp32_roundtrip_exact(a):
    x = t(a)
    assert_bits_equal(flatcomm.decode(flatcomm.encode(x, "fp32"), "fp32", x.numel()), x)


@SETTINGS
@given(arrays(finite32), st.sampled_from(R.CODECS), blocks, st.floats(0.001, 1.0), st.booleans(), st.integers(0, 2**63 - 1))
def test_matches_reference(a, codec, b, ratio, stoch, seed):
    x = t(a)
    stoch = stoch and codec in R.STOCHASTIC
    p = flatcomm.encode(x, codec, block_size=b, ratio=ratio, stochastic=stoch, seed=seed)
    assert_bits_equal(p, R.encode(x, codec, block_size=b, ratio=ratio, stochastic=stoch, seed=seed), "payload")
    assert_bits_equal(flatcomm.decode(p, codec, x.numel(), block_size=b, ratio=ratio),
                      R.decode(p, codec, x.numel(), block_size=b, ratio=ratio), "decode")


@SETTINGS
@given(st.integers(1, 600).flatmap(lambda n: st.tuples(arrays(moderate32, n, n), arrays(moderate32, n, n))),
       st.sampled_from(R.CODECS), blocks)
def test_ef_identity(xr, codec, b):
    x, r = t(xr[0]), t(xr[1])
    r_old = r.clone()
    r_ref = r.clone()
    p = flatcomm.encode(x, codec, residual=r, block_size=b, ratio=0.1)
    assert_bits_equal(p, R.encode(x, codec, residual=r_ref, block_size=b, ratio=0.1))
    assert_bits_equal(r, r_ref, "residual")
    d = flatcomm.decode(p, codec, x.numel(), block_size=b, ratio=0.1)
    v = x + r_old
    fin = torch.isfinite(d)
    gap, allowed = R.ef_identity_error(x, r_old, d, r)
    assert (gap[fin] <= allowed[fin]).all()
    assert_bits_equal(r[~fin], r_old[~fin], "non-finite keeps the old residual")
    assert torch.isfinite(r).all()
    if codec in ("int8", "int4", "bf16", "fp16", "fp32"):
        bound = R.dequant_error_bound(x, codec, b, residual=r_old)
        assert ((v.double() - d.double()).abs()[fin] <= bound[fin]).all()


@SETTINGS
@given(arrays(finite32, 1), st.sampled_from(["int8", "int4"]), blocks)
def test_int_bound_and_codes(a, codec, b):
    x = t(a)
    n = x.numel()
    p = flatcomm.encode(x, codec, block_size=b)
    d = flatcomm.decode(p, codec, n, block_size=b)
    assert torch.isfinite(d).all()
    assert ((x.double() - d.double()).abs() <= R.dequant_error_bound(x, codec, b)).all()
    # decoded magnitudes never exceed the block max by more than rounding
    absmax = torch.nn.functional.pad(x.double().abs(), (0, -n % b)).reshape(-1, b).amax(1).repeat_interleave(b)[:n]
    assert (d.double().abs() <= absmax * (1 + 2.0**-22) + 2.0**-140).all()


@SETTINGS
@given(st.integers(1, 6).flatmap(lambda w: hnp.arrays(np.float32, st.tuples(st.just(w), st.integers(0, 300)),
                                                        elements=finite32)),
       st.sampled_from([1, 7, 32, 256]))
def test_exact_sum_permutation_invariant(a, b):
    x = t(a)
    got = flatcomm.exact_sum(x, b)
    assert_bits_equal(got, R.exact_sum(x, b))
    assert_bits_equal(flatcomm.exact_sum(x.flip(0).contiguous(), b), got)


@SETTINGS
@given(st.integers(1, 6).flatmap(lambda w: hnp.arrays(np.float32, st.tuples(st.just(w), st.integers(0, 64)),
                                                        elements=st.floats(width=32, min_value=-2.0**20, max_value=2.0**20))))
def test_exact_sum_correct_rounding_small_range(a):
    # |v| <= 2^20 and v a multiple of 2^-6 after rounding below: 26 binades, inside the guarantee
    x = (t(a) * 64).round() / 64
    assert_bits_equal(flatcomm.exact_sum(x, 4096), R.exact_sum_exact(x))


@SETTINGS
@given(st.integers(1, 5).flatmap(lambda w: hnp.arrays(np.float32, st.tuples(st.just(w), st.integers(0, 300)),
                                                        elements=moderate32)),
       st.sampled_from(R.CODECS), blocks, st.floats(-4, 4).filter(lambda s: s != 0))
def test_decode_sum_matches_reference(a, codec, b, scale):
    x = t(a)
    P = torch.stack([flatcomm.encode(x[i], codec, block_size=b, ratio=0.2) for i in range(x.shape[0])])
    n = x.shape[1]
    assert_bits_equal(flatcomm.decode_sum(P, codec, n, block_size=b, ratio=0.2, scale=scale),
                      R.decode_sum(P, codec, n, block_size=b, ratio=0.2, scale=scale))
