"""out= variants (encode_into, decode_into, decode_sum_into, decode_sum_encode_into): the same bits
as the functional ops, written into caller buffers that may hold garbage (padding must be zeroed)."""
from __future__ import annotations

import pytest
import torch

import flatcomm

from _support.kernels import CODECS, assert_bits_equal, make_input

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.flatcomm, "encode_into"), reason="no *_into ops in this build")


def _garbage(n, dtype=torch.uint8):
    """A buffer full of non-zero junk, so unwritten bytes or elements would show."""
    return torch.full((n,), 0xAB if dtype == torch.uint8 else 7.0, dtype=dtype)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 33, 257, 4099])
def test_encode_out(gen, codec, n):
    x = make_input(gen, n)
    r1 = torch.randn(n, generator=gen) * 1e-2
    r2 = r1.clone()
    want = flatcomm.encode(x, codec, residual=r1, block_size=64, ratio=0.1)
    buf = _garbage(want.numel())
    got = flatcomm.encode(x, codec, residual=r2, block_size=64, ratio=0.1, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert_bits_equal(buf, want, "payload incl. zero padding")
    assert_bits_equal(r2, r1, "residual")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_out(gen, codec, dtype):
    n = 1000
    p = flatcomm.encode(make_input(gen, n), codec, block_size=32, ratio=0.1)
    out = _garbage(n, dtype)
    flatcomm.decode(p, codec, n, block_size=32, ratio=0.1, out=out)
    assert_bits_equal(out, flatcomm.decode(p, codec, n, block_size=32, ratio=0.1, dtype=dtype))


@pytest.mark.parametrize("codec", CODECS)
def test_decode_sum_out(gen, codec):
    n = 3000
    P = torch.stack([flatcomm.encode(make_input(gen, n), codec, block_size=64, ratio=0.1) for _ in range(3)])
    out = _garbage(n, torch.float32)
    flatcomm.decode_sum(P, codec, n, block_size=64, ratio=0.1, scale=0.5, out=out)
    assert_bits_equal(out, flatcomm.decode_sum(P, codec, n, block_size=64, ratio=0.1, scale=0.5))
    if flatcomm.resolve(codec).reencodes_fused:  # topk and the chunked sparse codecs: not fused
        r1 = torch.randn(n, generator=gen) * 1e-3
        r2 = r1.clone()
        want = flatcomm.decode_sum(P, codec, n, block_size=64, ratio=0.1, reencode=codec, residual=r1)
        buf = _garbage(want.numel())
        flatcomm.decode_sum(P, codec, n, block_size=64, ratio=0.1, reencode=codec, residual=r2, out=buf)
        assert_bits_equal(buf, want)
        assert_bits_equal(r2, r1)


def test_out_wrong_size_is_an_error(gen):
    x = make_input(gen, 100)
    with pytest.raises(RuntimeError, match="flatcomm: .*(bytes|elements)"):
        flatcomm.encode(x, "int8", out=torch.empty(16, dtype=torch.uint8))
    p = flatcomm.encode(x, "int8")
    with pytest.raises(RuntimeError, match="flatcomm: .*elements"):
        flatcomm.decode(p, "int8", 100, out=torch.empty(99))
