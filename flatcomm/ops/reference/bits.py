"""Bit patterns, conversions, the counter-based generator, payload layout and blockwise helpers of
the reference (see :mod:`flatcomm.ops.reference`)."""
from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = [
    "CODECS", "CAST", "BLOCKWISE", "CHUNKED", "CAST_BYTES", "CODE_BITS", "QMAX", "STOCHASTIC", "ALIGN", "TILE",
    "ABS_MASK", "INF_BITS", "QNAN_BITS", "FLT_MAX", "FLT_MIN_NORMAL", "SIGN_HUGE_BITS", "SIGN_LANES",
    "EXP_ZERO", "EXP_NONFINITE", "DEFAULT_HEADROOM", "f32_bits", "f32_from_bits", "abs_bits",
    "f32_to_bf16_bits", "bf16_bits_to_f32", "f32_to_f16_bits", "f16_bits_to_f32", "load_f32",
    "store_as", "splitmix64_int", "splitmix64_t", "seed_key", "random_u32", "random_unit", "topk_k",
    "layout", "wire_bytes", "int_block_params", "round_half_even", "floor_small", "sign_block_scale"
]


CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "sign", "topk", "sparse", "sparse4", "sparse1")
CHUNKED = ("sparse", "sparse4", "sparse1")  # chunked sparse: the k largest of each chunk (reference/sparse.py)
CAST = ("fp32", "bf16", "fp16")
BLOCKWISE = ("int8", "int4", "sign")
CAST_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CODE_BITS = {"int8": 8, "int4": 4, "sign": 1}
QMAX = {"int8": 127.0, "int4": 7.0}
STOCHASTIC = ("int8", "int4", "bf16")

ALIGN = 16
TILE = 2048  # the CPU kernels' tile (only matters for documentation: results never depend on it)

ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000  # |x| bits >= this <=> inf or NaN
QNAN_BITS = 0x7FC00000
FLT_MAX = 3.4028234663852886e38
FLT_MIN_NORMAL = 2.0**-126
SIGN_HUGE_BITS = 0x6F800000  # 2^96: sign codec sums |v| * 2^-32 when max |v| >= this
SIGN_LANES = 32

EXP_ZERO = -200
EXP_NONFINITE = 1 << 20
DEFAULT_HEADROOM = 12

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


# ---- bit patterns ---------------------------------------------------------------------------------


def f32_bits(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit pattern of fp32 values, held in int64 (always >= 0)."""
    return v.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def f32_from_bits(b: torch.Tensor) -> torch.Tensor:
    """fp32 values from uint32 bit patterns held in int64."""
    b = b & 0xFFFFFFFF
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def abs_bits(v: torch.Tensor) -> torch.Tensor:
    return f32_bits(v) & ABS_MASK


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value, dtype=torch.float32)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of a contiguous tensor (the host is little-endian, as the kernels')."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def _zeros_u8(n: int) -> torch.Tensor:
    return torch.zeros(max(0, n), dtype=torch.uint8)


# ---- bf16 / fp16 conversions (round to nearest even, as csrc/core/common.h) ----------------------


def f32_to_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """RNE fp32 -> bf16 (NaN becomes a quiet NaN keeping sign and top payload bits)."""
    u = f32_bits(v)
    rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & ABS_MASK) > INF_BITS
    return torch.where(nan, (u >> 16) | 0x40, rne) & 0xFFFF


def bf16_bits_to_f32(h: torch.Tensor) -> torch.Tensor:
    return f32_from_bits((h & 0xFFFF) << 16)


def f32_to_f16_bits(v: torch.Tensor) -> torch.Tensor:
    """RNE fp32 -> fp16 (overflow to inf; NaN becomes sign | 0x7E00, as the kernel's Dukhan code)."""
    v = v.to(torch.float32)
    h = v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    sign = (f32_bits(v) >> 16) & 0x8000
    return torch.where(torch.isnan(v), sign | 0x7E00, h)


def f16_bits_to_f32(h: torch.Tensor) -> torch.Tensor:
    h = h & 0xFFFF
    return torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16).view(torch.float16).to(torch.float32)


def load_f32(x: torch.Tensor) -> torch.Tensor:
    """Elem<DT>::load: fp32/bf16/fp16 -> fp32 (exact), flattened."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"reference: unsupported dtype {x.dtype}")
    return x.reshape(-1).to(torch.float32)


def store_as(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elem<DT>::store: fp32 -> dtype with the kernels' RNE conversions."""
    if dtype == torch.float32:
        return v.clone()
    if dtype == torch.bfloat16:
        h = f32_to_bf16_bits(v)
        return torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16).view(torch.bfloat16)
    if dtype == torch.float16:
        h = f32_to_f16_bits(v)
        return torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16).view(torch.float16)
    raise TypeError(f"reference: unsupported dtype {dtype}")


# ---- counter-based random numbers (csrc/core/rng.h) ----------------------------------------------


def _s64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64_int(z: int) -> int:
    """splitmix64 finaliser on Python ints (uint64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def splitmix64_t(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors (uint64 bits; torch's int64 mul/add wrap modulo 2^64)."""
    z = (z ^ _lsr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _s64(0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def seed_key(seed: int) -> int:
    return splitmix64_int((seed + _GOLDEN) & _M64)


def random_u32(seed: int, index: torch.Tensor) -> torch.Tensor:
    """random_u32(seed_key(seed), index) for int64 element indices, as int64 in [0, 2^32)."""
    key = _s64(seed_key(seed))
    z = index.to(torch.int64) * _s64(_GOLDEN) + key
    return _lsr(splitmix64_t(z), 32)


def random_unit(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in [0, 1) with 24 random bits."""
    return (random_u32(seed, index) >> 8).to(torch.float32) * 2.0**-24


# ---- layout ---------------------------------------------------------------------------------------


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def topk_k(n: int, ratio: float) -> int:
    """Values kept by topk (flatcomm.Codec.k)."""
    if n == 0:
        return 0
    return min(n, max(1, math.ceil(ratio * n)))


def layout(codec: str, n: int, block_size: int = 256, k: int = 0) -> Tuple[int, int, int]:
    """(nblocks, codes_offset, total bytes) of a payload, as core::layout."""
    if n <= 0:
        return 0, 0, 0
    if codec in CAST:
        return 0, 0, _round_up(n * CAST_BYTES[codec], ALIGN)
    if codec == "topk":
        off = _round_up(4 * k, ALIGN)
        return 0, off, _round_up(off + 4 * k, ALIGN)
    if codec in CHUNKED:  # k: kept per chunk of block_size
        from .sparse import layout as chunked_layout, wire_bytes as chunked_bytes
        nb, off, _ = chunked_layout(codec, n, block_size, k)
        return nb, off, chunked_bytes(codec, n, block_size, k)
    nb = -(-n // block_size)
    off = _round_up(4 * nb, ALIGN)
    return nb, off, _round_up(off + -(-n * CODE_BITS[codec] // 8), ALIGN)


def wire_bytes(codec: str, n: int, block_size: int = 256, ratio: float = 0.01, keep: int = 64) -> int:
    k = topk_k(n, ratio) if codec == "topk" else (min(keep, block_size) if codec in CHUNKED else 0)
    return layout(codec, n, block_size, k)[2]


def _assemble(total: int, *pieces: Tuple[int, torch.Tensor]) -> torch.Tensor:
    out = _zeros_u8(total)
    for off, data in pieces:
        out[off:off + data.numel()] = data
    return out


# ---- blockwise helpers ------------------------------------------------------------------------------


def _blocked(v: torch.Tensor, block_size: int) -> torch.Tensor:
    """[nblocks, block_size] view of v, the last block padded with +0 (neutral for every use)."""
    n = v.numel()
    nb = -(-n // block_size)
    return torch.nn.functional.pad(v, (0, nb * block_size - n)).reshape(nb, block_size)


def int_block_params(max_abs_bits: torch.Tensor, qmax: float):
    """(scale, pre, inv, finite) per block, as core::int_block_params."""
    finite = max_abs_bits < INF_BITS
    absmax = f32_from_bits(torch.where(finite, max_abs_bits, 0))
    s = absmax / _full(absmax, qmax)
    # qmax * s rounding up past FLT_MAX: step s down one ulp
    over = ~(s * qmax <= FLT_MAX)
    s = torch.where(over, f32_from_bits(f32_bits(s) - 1), s)
    # subnormal scale: round up one ulp when qmax * s falls short of max|v|
    under = (s < FLT_MIN_NORMAL) & (s * qmax < absmax)
    s = torch.where(under, f32_from_bits(f32_bits(s) + 1), s)
    pre = torch.where(s < FLT_MIN_NORMAL, _full(s, 2.0**64), _full(s, 1.0))
    inv = torch.where(s > 0, _full(s, 1.0) / (s * pre), _full(s, 0.0))
    nan = f32_from_bits(torch.full_like(max_abs_bits, QNAN_BITS))
    scale = torch.where(finite, s, nan)
    pre = torch.where(finite, pre, _full(s, 1.0))
    inv = torch.where(finite, inv, _full(s, 0.0))
    return scale, pre, inv, finite


_MAGIC = 12582912.0  # 1.5 * 2^23


def round_half_even(t: torch.Tensor) -> torch.Tensor:
    """The kernel's (t + 1.5 * 2^23) - 1.5 * 2^23: ties to even, like torch.round, except that
    it never returns -0.0 (so a code of "-0" decodes, and leaves a residual, as +0)."""
    return (t + _MAGIC) - _MAGIC


def floor_small(t: torch.Tensor) -> torch.Tensor:
    """Largest integer <= t for |t| < 2^22, as core::floor_small."""
    r = round_half_even(t)
    return torch.where(r > t, r - 1.0, r)


def _fmin(a: torch.Tensor, b: float) -> torch.Tensor:  # a < b ? a : b  (NaN -> b)
    return torch.where(a < b, a, _full(a, b))


def _fmax(a: torch.Tensor, b: float) -> torch.Tensor:  # a > b ? a : b  (NaN -> b)
    return torch.where(a > b, a, _full(a, b))


def sign_block_scale(vb: torch.Tensor, counts: torch.Tensor, max_abs_bits: torch.Tensor) -> torch.Tensor:
    """Sign codec scale: mean |v| summed in the 32-lane order of core/codec.h.

    Lane j adds |v[j]| * pre, |v[j + 32]| * pre, ... in turn; lanes are then folded pairwise (j with
    j + 16, then j + 8, ...); mean = sum / count; scale = mean / pre. pre = 2^-32 for blocks with
    max |v| >= 2^96 (overflow guard), else 1. Non-finite blocks get NaN.
    """
    nb, B = vb.shape
    pre = torch.where(max_abs_bits >= SIGN_HUGE_BITS, _full(counts, 2.0**-32), _full(counts, 1.0))
    a = vb.abs() * pre[:, None]
    chunks = a.reshape(nb, B // SIGN_LANES, SIGN_LANES)
    lanes = torch.zeros(nb, SIGN_LANES, dtype=torch.float32)
    for c in range(chunks.shape[1]):  # padding adds +0.0: a no-op on lanes >= +0
        lanes = lanes + chunks[:, c, :]
    w = SIGN_LANES // 2
    while w > 0:
        lanes = torch.cat([lanes[:, :w] + lanes[:, w:2 * w], lanes[:, 2 * w:]], dim=1)
        w //= 2
    mean = lanes[:, 0] / counts.to(torch.float32)
    scale = mean / pre
    nan = f32_from_bits(torch.full_like(max_abs_bits, QNAN_BITS))
    return torch.where(max_abs_bits < INF_BITS, scale, nan)
