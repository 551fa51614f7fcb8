"""Which NaN a fixed-order sum returns: where several rows hold NaN at one element, the first NaN row's
payload (quieted), at every element position (vector body and scalar tail of every tile), on every
instruction set, and for every codec whose decoded values keep a payload. A compiler may swap the
operands of `+` in one loop and not in another (csrc/core/common.h add_in_order); before that rule
was explicit the fused decode_sum kept row 0's payload in its vector body and row 1's in its tails,
so two paths of one sum at different tile offsets disagreed (the small path against the shard-sized
sum of the pipelined path)."""
from __future__ import annotations

import pytest
import torch

from flatcomm import _C
from flatcomm.ops.codecs import decode, decode_sum, encode, resolve
from flatcomm.ops.sums import ordered_sum

ISAS = ("baseline", "avx2", "avx512")
SIZES = (1, 7, 31, 33, 1000, 2049, 4099)  # tails of every length against 8-, 16- and 32-wide loops


def _nan(payload: int) -> torch.Tensor:
    return torch.tensor([payload], dtype=torch.int32).view(torch.float32)


def _rows(n: int, first_nan: int) -> torch.Tensor:
    """Three rows: row `first_nan` and every later row NaN (distinct payloads, one signalling), the
    earlier ones finite; so the sum's NaN must be row `first_nan`'s, quieted."""
    g = torch.Generator().manual_seed(n + first_nan)
    x = torch.randn(3, n, generator=g)
    payloads = (0x7F800001, -0x400000 + 5, 0x7FC00123)  # a signalling NaN, a negative and a quiet one
    for r in range(first_nan, 3):
        x[r] = _nan(payloads[r])
    return x


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_sums_keep_the_first_nan_rows_payload_everywhere(isa, codec, restore_simd):
    if not _C.set_simd(isa):
        pytest.skip(f"{isa} not supported here")
    c = resolve(codec)
    for n in SIZES:
        for first in range(3):
            x = _rows(n, first)
            payloads = torch.stack([encode(r, c) for r in x])
            # the first NaN row as its payload carries it (bf16: the NaN's top half), widened, quieted
            want = decode(payloads[first], c, n).view(torch.int32) | 0x00400000
            got = decode_sum(payloads, c, n).view(torch.int32)
            assert torch.equal(got, want), (isa, codec, n, first, (got != want).nonzero()[:4].flatten().tolist())
            if codec == "fp32":
                assert torch.equal(ordered_sum(x).view(torch.int32), want), ("ordered_sum", isa, n, first)
