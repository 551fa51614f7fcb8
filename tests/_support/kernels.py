"""Inputs and exact comparisons for the kernel tests: sizes, block sizes, dtypes, codecs, random
inputs per test, bit-for-bit equality with the first difference named."""
from __future__ import annotations

import zlib

import torch

from flatcomm.ops.codecs import CODECS

__all__ = ["BLOCK_SIZES", "CODECS", "DTYPES", "SIZES", "assert_bits_equal", "bits", "make_input", "seed_of"]

SIZES = (0, 1, 2, 31, 32, 33, 97, 255, 256, 257, 1000, 4099, 65537)
BLOCK_SIZES = (32, 64, 256, 4096)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_input(g: torch.Generator, n: int, dtype: torch.dtype = torch.float32, kind: str = "mixed") -> torch.Tensor:
    """Random test values of a few shapes of distribution, representable (finite) in ``dtype``.

    mixed: gaussian times a per-element magnitude spread over ~2^+-12, with some exact zeros and a
    few exact ties of magnitude; normal: plain gaussian; wide: magnitudes over 2^+-40 (fp32 only).
    """
    if n == 0:
        return torch.zeros(0, dtype=dtype)
    x = torch.randn(n, generator=g)
    if kind == "mixed":
        x = x * torch.exp2(torch.randint(-12, 13, (n,), generator=g).float())
        x[torch.rand(n, generator=g) < 0.05] = 0.0
        if n >= 8:  # magnitude ties (topk tie-break, int codes at clamp)
            i = torch.randint(0, n, (4,), generator=g)
            x[i] = x[i[0]].abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])
    elif kind == "wide":
        x = x * torch.exp2(torch.randint(-40, 41, (n,), generator=g).float())
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view for exact comparisons (NaN == NaN of the same bits, -0 != +0)."""
    t = t.contiguous()
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ba, bb = bits(a), bits(b)
    if not torch.equal(ba, bb):
        diff = (ba != bb).nonzero().flatten()
        i = diff[0].item()
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} differ; first at {i}: {a.reshape(-1)[i].item()!r} "
            f"vs {b.reshape(-1)[i].item()!r}"
        )
