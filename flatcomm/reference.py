"""Pure-torch reference of every flatcomm kernel: the test oracle, and a readable spec of the format.

Nothing here calls a flatcomm op. Every function reproduces the C++ kernels (csrc/core, csrc/cpu)
BIT FOR BIT by performing the same IEEE-754 binary32 operations in the same order, only vectorised
with torch instead of looped in C++:

* all codec math is fp32 (round to nearest even, no fused multiply-add): torch's elementwise fp32
  ``+ - * /`` on CPU tensors are exactly that;
* reductions the kernels do in a fixed order (the sign codec's 32-lane mean, ordered sums) are
  written out in that order;
* unsigned 32/64-bit integer math (bit patterns, the splitmix64 counter hash) is done on int64
  tensors, masking where C++ would have used unsigned arithmetic.

Payload layout (one uint8 buffer, total size a multiple of 16, padding bytes zero):

* cast codecs ``fp32``/``bf16``/``fp16``: the values, element i at byte ``i * esize``;
* blockwise ``int8``/``int4``/``sign``: ``[fp32 scale per block, padded to 16 B][codes]``;
  int8: byte i holds the int8 code; int4: nibble ``i & 1`` (low first) of byte ``i // 2`` holds
  ``q + 8`` (a trailing odd element is paired with a code 0, i.e. high nibble 8); sign: bit
  ``i & 7`` of byte ``i // 8``, 1 = negative;
* ``topk``: ``[uint32 index x k, padded to 16 B][fp32 value x k]``, indices strictly ascending.

Non-finite rule: when ``v = x + residual`` has an inf/NaN in a block, the block's scale is stored as
NaN (so the whole block decodes to NaN) and the block's residual keeps its previous contents. Cast
codecs and topk apply the rule per element, on the encoded value.

Besides the bitwise emulation there are exact helpers (Python integers) and float64 error bounds
for the tests: :func:`exact_sum_exact`, :func:`round_to_f32`, :func:`dequant_error_bound`.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Tuple

import torch

CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "sign", "topk")
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
    nb = -(-n // block_size)
    off = _round_up(4 * nb, ALIGN)
    return nb, off, _round_up(off + -(-n * CODE_BITS[codec] // 8), ALIGN)


def wire_bytes(codec: str, n: int, block_size: int = 256, ratio: float = 0.01) -> int:
    return layout(codec, n, block_size, topk_k(n, ratio) if codec == "topk" else 0)[2]


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


# ---- encode -------------------------------------------------------------------------------------------


def encode(
    x: torch.Tensor,
    codec: str,
    *,
    residual: Optional[torch.Tensor] = None,
    block_size: int = 256,
    ratio: float = 0.01,
    stochastic: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """Payload bytes of ``flatcomm.encode`` (bit-exact); updates ``residual`` in place like the kernel."""
    if codec not in CODECS:
        raise ValueError(f"reference: unknown codec {codec!r}")
    if stochastic and codec not in STOCHASTIC:
        raise ValueError("reference: stochastic rounding is available for int8, int4 and bf16 only")
    n = x.numel()
    k = topk_k(n, ratio) if codec == "topk" else 0
    nb, off, total = layout(codec, n, block_size, k)
    if n == 0:
        return _zeros_u8(0)
    v = load_f32(x)
    if residual is not None:
        r_old = residual.reshape(-1).to(torch.float32)
        v = v + r_old
    else:
        r_old = None
    seed &= _M64
    idx = torch.arange(n, dtype=torch.int64)

    def update_residual(new: torch.Tensor, keep_new: torch.Tensor) -> None:
        if residual is not None:
            assert r_old is not None  # loaded above whenever there is a residual
            residual.view(-1).copy_(torch.where(keep_new, new, r_old))

    if codec in CAST:
        if codec == "fp32":
            d = v
            data = _u8(v)
        elif codec == "bf16":
            if stochastic:
                u = f32_bits(v)
                rnd = (u + (random_u32(seed, idx) & 0xFFFF)) >> 16
                h = torch.where((u & ABS_MASK) >= INF_BITS, f32_to_bf16_bits(v), rnd & 0xFFFF)
            else:
                h = f32_to_bf16_bits(v)
            d = bf16_bits_to_f32(h)
            data = _u8(torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16))
        else:
            h = f32_to_f16_bits(v)
            d = f16_bits_to_f32(h)
            data = _u8(torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16))
        update_residual(v - d, torch.isfinite(d))
        return _assemble(total, (0, data))

    if codec == "topk":
        ab = abs_bits(v)
        # larger |v| bits first, ties to the lower index (stable sort keeps index order)
        order = torch.sort(ab, descending=True, stable=True).indices[:k]
        kept = torch.sort(order).values
        take = torch.zeros(n, dtype=torch.bool)
        take[kept] = True
        update_residual(torch.where(take, _full(v, 0.0), v), ab < INF_BITS)
        return _assemble(total, (0, _u8(kept.to(torch.int32))), (off, _u8(v[kept])))

    # blockwise
    vb = _blocked(v, block_size)
    counts = torch.clamp(n - torch.arange(nb, dtype=torch.int64) * block_size, max=block_size)
    mab = abs_bits(vb).amax(dim=1)
    finite_block = mab < INF_BITS
    gidx = _blocked(idx, block_size)  # global element index (padding: 0, discarded)
    if codec == "sign":
        scale = sign_block_scale(vb, counts, mab)
        neg = (vb < 0).reshape(-1)[:n].to(torch.int64)
        d = torch.where(neg.bool(), -scale.repeat_interleave(block_size)[:n],
                        scale.repeat_interleave(block_size)[:n])
        bits = torch.nn.functional.pad(neg, (0, -n % 8)).reshape(-1, 8)
        codes = (bits << torch.arange(8, dtype=torch.int64)).sum(dim=1).to(torch.uint8)
    else:
        qmax = QMAX[codec]
        scale, pre, inv, _ = int_block_params(mab, qmax)
        t = (vb * pre[:, None]) * inv[:, None]
        t = _fmax(_fmin(t, qmax), -qmax)  # NaN (non-finite blocks only) becomes qmax
        if stochastic:
            q = _fmin(floor_small(t + random_unit(seed, gidx)), qmax)
        else:
            q = round_half_even(t)
        q = q.reshape(-1)[:n]
        d = q * scale.repeat_interleave(block_size)[:n]
        qi = q.to(torch.int64)
        if codec == "int8":
            codes = _u8(qi.to(torch.int8))
        else:
            nib = torch.nn.functional.pad(qi + 8, (0, n % 2), value=8).reshape(-1, 2)
            codes = (nib[:, 0] | (nib[:, 1] << 4)).to(torch.uint8)
    fin = finite_block.repeat_interleave(block_size)[:n]
    update_residual(v - d, fin)
    return _assemble(total, (0, _u8(scale)), (off, codes))


# ---- decode ---------------------------------------------------------------------------------------------


def _payload_f32(p: torch.Tensor, off: int, count: int) -> torch.Tensor:
    return p[off:off + 4 * count].clone().view(torch.float32)


def topk_entries(payload: torch.Tensor, n: int, ratio: float = 0.01) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values fp32) stored in a topk payload."""
    k = topk_k(n, ratio)
    _, off, _ = layout("topk", n, 0, k)
    idx = payload[:4 * k].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return idx, _payload_f32(payload, off, k)


def block_scales(payload: torch.Tensor, codec: str, n: int, block_size: int = 256) -> torch.Tensor:
    nb, _, _ = layout(codec, n, block_size)
    return _payload_f32(payload, 0, nb)


def decode_f32(payload: torch.Tensor, codec: str, n: int, *, block_size: int = 256,
               ratio: float = 0.01) -> torch.Tensor:
    """fp32 values of a payload, parsed from its bytes."""
    payload = payload.reshape(-1)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    if codec == "fp32":
        return _payload_f32(payload, 0, n)
    if codec in ("bf16", "fp16"):
        h = payload[:2 * n].clone().view(torch.int16).to(torch.int64) & 0xFFFF
        return bf16_bits_to_f32(h) if codec == "bf16" else f16_bits_to_f32(h)
    if codec == "topk":
        idx, val = topk_entries(payload, n, ratio)
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = val
        return out
    nb, off, _ = layout(codec, n, block_size)
    scale = _payload_f32(payload, 0, nb).repeat_interleave(block_size)[:n]
    codes = payload[off:].to(torch.int64)
    if codec == "int8":
        q = torch.where(codes[:n] >= 128, codes[:n] - 256, codes[:n]).to(torch.float32)
        return q * scale
    if codec == "int4":
        nib = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)[:n]
        return (nib - 8).to(torch.float32) * scale
    bits = ((codes[:, None] >> torch.arange(8)) & 1).reshape(-1)[:n]
    return torch.where(bits.bool(), -scale, scale)


def decode(payload: torch.Tensor, codec: str, n: int, *, block_size: int = 256, ratio: float = 0.01,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``flatcomm.decode`` (bit-exact): fp32 decode, then an RNE store to ``dtype``."""
    return store_as(decode_f32(payload, codec, n, block_size=block_size, ratio=ratio), dtype)


def decode_rows(payloads: torch.Tensor, codec: str, row_numel: int, numel: int, *, block_size: int = 256,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``flatcomm.decode_rows`` (bit-exact): the fp32 decode of each row ([R, nbytes]) one after the
    other, cut to ``numel`` values (in ((R - 1) * row_numel, R * row_numel]), then an RNE store to ``dtype``."""
    rows = payloads.shape[0]
    if codec == "topk" or not (rows >= 1 and (rows - 1) * row_numel < numel <= rows * row_numel):
        raise ValueError(f"reference: decode_rows of {rows} {codec} rows of {row_numel} into {numel} values")
    v = torch.cat([decode_f32(payloads[r], codec, row_numel, block_size=block_size) for r in range(rows)])
    return store_as(v[:numel], dtype)


def decode_sum(
    payloads: torch.Tensor,
    codec: str,
    n: int,
    *,
    block_size: int = 256,
    ratio: float = 0.01,
    scale: float = 1.0,
    reencode: Optional[str] = None,
    residual: Optional[torch.Tensor] = None,
    reencode_block_size: int = 256,
    stochastic: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """``flatcomm.decode_sum`` (bit-exact): ((d0 + d1) + d2) + ..., then one multiply by fp32(scale).

    topk rows only add at their kept indices (other elements are left untouched, not "+ 0.0").
    With ``reencode`` the fp32 sum is encoded like :func:`encode` (same global element indices).
    """
    rows = payloads.shape[0]
    out = torch.zeros(n, dtype=torch.float32)
    for r in range(rows):
        if codec == "topk":
            idx, val = topk_entries(payloads[r], n, ratio)
            if r == 0:
                out = torch.zeros(n, dtype=torch.float32)
                out[idx] = val
            else:
                out[idx] = out[idx] + val
        else:
            d = decode_f32(payloads[r], codec, n, block_size=block_size, ratio=ratio)
            out = d if r == 0 else out + d
    s32 = torch.tensor(scale, dtype=torch.float64).to(torch.float32)
    if s32.item() != 1.0:
        out = out * s32
    if reencode is None:
        return out
    return encode(out, reencode, residual=residual, block_size=reencode_block_size,
                  stochastic=stochastic, seed=seed)


# ---- ordered and exact sums ---------------------------------------------------------------------------


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the rows of x ([W, n]) in ascending row order (a plain sequential loop)."""
    out = torch.zeros(x.shape[-1], dtype=torch.float32)
    for r in range(x.shape[0]):
        row = x[r].to(torch.float32)
        out = row.clone() if r == 0 else out + row
    return out


def exponent_of_abs_bits(ab: torch.Tensor) -> torch.Tensor:
    """Smallest E with |a| < 2^E (EXP_ZERO for 0, EXP_NONFINITE for inf/NaN), as int64."""
    biased = ab >> 23
    _, bitlen = torch.frexp(ab.to(torch.float64))  # subnormal: a = ab * 2^-149, ab < 2^23
    e = torch.where(biased > 0, biased - 126, bitlen.to(torch.int64) - 149)
    e = torch.where(ab == 0, torch.full_like(e, EXP_ZERO), e)
    return torch.where(ab >= INF_BITS, torch.full_like(e, EXP_NONFINITE), e)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[W, n] fp32 view of x ([n] means W = 1)."""
    v = x.to(torch.float32)
    return v if v.dim() == 2 else v.reshape(1, -1)


def exact_exponents(x: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """Per-block exponent (int32) of x ([n] or [W, n]), the max over rows."""
    v = _rows(x)
    n = v.shape[1]
    if n == 0:
        return torch.zeros(0, dtype=torch.int32)
    nb = -(-n // block_size)
    ab = torch.nn.functional.pad(abs_bits(v), (0, nb * block_size - n)).reshape(v.shape[0], nb, block_size)
    return exponent_of_abs_bits(ab.amax(dim=(0, 2))).to(torch.int32)


def _per_elem(e: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    return e.to(torch.int64).repeat_interleave(block_size)[:n]


def to_fixed(v: torch.Tensor, E: torch.Tensor, precision: int) -> torch.Tensor:
    """round_half_even(v * 2^(P - E)) as int64 (exact in float64); 0 for zero/non-finite blocks."""
    special = (E == EXP_ZERO) | (E == EXP_NONFINITE)
    shift = torch.where(special, torch.zeros_like(E), precision - E)
    t = v.to(torch.float64) * torch.pow(2.0, shift.to(torch.float64))
    t = torch.where(special, torch.zeros_like(t), t)
    return torch.round(t).to(torch.int64)


def from_fixed(m: torch.Tensor, E: torch.Tensor, precision: int) -> torch.Tensor:
    """fp32(m) (RNE) times 2^(E - P), applied in exact power-of-two steps, as core::from_fixed."""
    f = m.to(torch.float32)  # int64 -> fp32 rounds to nearest even (checked in the tests)
    e = E - precision
    for _ in range(3):
        big, small = e > 127, e < -126
        f = torch.where(big, f * 2.0**127, torch.where(small, f * 2.0**-126, f))
        e = torch.where(big, e - 127, torch.where(small, e + 126, e))
    f = f * torch.pow(2.0, e.to(torch.float32))  # exact: -126 <= e <= 127
    f = torch.where((E == EXP_ZERO) | (m == 0), torch.zeros_like(f), f)
    nan = f32_from_bits(torch.full_like(m, QNAN_BITS))
    return torch.where(E == EXP_NONFINITE, nan, f)


def to_exact(x: torch.Tensor, exponents: torch.Tensor, block_size: int = 256,
             headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    v = load_f32(x)
    return to_fixed(v, _per_elem(exponents, v.numel(), block_size), 62 - headroom)


def from_exact(acc: torch.Tensor, exponents: torch.Tensor, block_size: int = 256,
               headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    return from_fixed(acc, _per_elem(exponents, acc.numel(), block_size), 62 - headroom)


def exact_sum(x: torch.Tensor, block_size: int = 256, headroom: int = DEFAULT_HEADROOM) -> torch.Tensor:
    """``flatcomm.exact_sum`` (bit-exact): shared exponent per block, int64 fixed-point sum."""
    v = _rows(x)
    n = v.shape[1]
    E = _per_elem(exact_exponents(v, block_size), n, block_size)
    P = 62 - headroom
    acc = torch.zeros(n, dtype=torch.int64)
    for r in range(v.shape[0]):
        acc = acc + to_fixed(v[r], E, P)
    return from_fixed(acc, E, P)


# ---- exact rational helpers (Python integers; for small tests) -------------------------------------------


def round_to_f32(q: Fraction) -> float:
    """The exact rational q rounded to the nearest fp32 (ties to even), as a Python float."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)  # spacing of fp32 around a (subnormals: 2^-149)
    m = round(a / quantum)  # Fraction.__round__: half to even
    r = m * quantum
    if r > Fraction(FLT_MAX):
        return sign * math.inf
    return sign * float(r)


def exact_sum_exact(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 of the EXACT column sums of x ([W, n]); NaN where a column is non-finite."""
    v = _rows(x).to(torch.float64)
    out = []
    for col in v.t().tolist():
        if not all(math.isfinite(c) for c in col):
            out.append(math.nan)
            continue
        out.append(round_to_f32(sum((Fraction(c) for c in col), Fraction(0))))
    return torch.tensor(out, dtype=torch.float32)


# ---- float64 error bounds ------------------------------------------------------------------------------------


def dequant_error_bound(x: torch.Tensor, codec: str, block_size: int = 256, *,
                        residual: Optional[torch.Tensor] = None, stochastic: bool = False) -> torch.Tensor:
    """Per-element float64 bound on |v - decode(encode(v))| with v = x (+ residual) in fp32.

    int8/int4: a round-to-nearest step is scale / 2; fp32 rounding of t = v * (1 / scale) and of
    code * scale adds a few ulps of the code (qmax * 2^-21 of a step), and a subnormal scale is
    itself rounded by up to 2^-150, which moves the largest code by up to qmax * 2^-150. Stochastic
    rounding: one whole step. bf16/fp16: half an ulp (2^-8 / 2^-11 relative, 2^-134 / 2^-25 absolute
    for subnormals). fp32: 0. inf where the value or its block is non-finite. Not for sign/topk
    (their decoded values are checked directly).
    """
    v = load_f32(x)
    if residual is not None:
        v = v + residual.reshape(-1)
    n = v.numel()
    v64 = v.to(torch.float64)
    if codec == "fp32":
        b = torch.zeros(n, dtype=torch.float64)
    elif codec == "bf16":
        b = torch.maximum(v64.abs() * 2.0**-8, torch.full_like(v64, 2.0**-134))
        if stochastic:
            b = 2 * b
    elif codec == "fp16":
        b = torch.maximum(v64.abs() * 2.0**-11, torch.full_like(v64, 2.0**-25))
        b = torch.where(v64.abs() >= 65520.0, torch.full_like(v64, math.inf), b)
    elif codec in ("int8", "int4"):
        qmax = QMAX[codec]
        mab = abs_bits(_blocked(v, block_size)).amax(dim=1)
        scale, _, _, _ = int_block_params(mab, qmax)
        s = scale.to(torch.float64).repeat_interleave(block_size)[:n]
        step = 1.0 if stochastic else 0.5
        b = s * (step + qmax * 2.0**-21) + qmax * 2.0**-149
    else:
        raise ValueError(f"reference: no simple error bound for codec {codec!r}")
    return torch.where(torch.isnan(b) | ~torch.isfinite(v64), torch.full_like(b, math.inf), b)


def ef_identity_error(x: torch.Tensor, r_old: torch.Tensor, decoded: torch.Tensor,
                      r_new: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(|x + r_old - (decoded + r_new)|, allowed) in float64 for error feedback.

    v = fl(x + r_old) is one fp32 rounding away from x + r_old, and r_new = fl(v - decoded) one more
    (exact for int8/int4/casts by Sterbenz's lemma, not always for sign), so the gap is at most half
    an ulp of each: 2^-24 (|v| + |r_new|), plus the subnormal quantum.
    """
    x64 = load_f32(x).to(torch.float64)
    r0 = r_old.reshape(-1).to(torch.float64)
    d = decoded.reshape(-1).to(torch.float64)
    r1 = r_new.reshape(-1).to(torch.float64)
    gap = ((x64 + r0) - (d + r1)).abs()
    allowed = 2.0**-24 * ((x64 + r0).abs() + r1.abs()) * (1 + 2.0**-20) + 2.0**-149
    return gap, allowed


__all__ = [
    "CODECS", "abs_bits", "block_scales", "decode", "decode_f32", "decode_rows", "decode_sum",
    "dequant_error_bound",
    "ef_identity_error", "encode", "exact_exponents", "exact_sum", "exact_sum_exact",
    "exponent_of_abs_bits", "f32_bits", "f32_from_bits", "from_exact", "from_fixed", "layout",
    "ordered_sum", "random_u32", "random_unit", "round_to_f32", "seed_key", "splitmix64_int",
    "splitmix64_t", "to_exact", "to_fixed", "topk_entries", "topk_k", "wire_bytes",
]
