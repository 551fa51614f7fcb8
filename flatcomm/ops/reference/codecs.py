"""The reference encode, decode and fused decode-sum (see :mod:`flatcomm.ops.reference`)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import sparse
from .bits import *  # noqa: F401,F403
from .bits import _M64, _assemble, _blocked, _fmax, _fmin, _full, _u8, _zeros_u8

__all__ = [
    "encode", "topk_entries", "block_scales", "decode_f32", "decode", "decode_rows", "decode_sum"
]


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
    keep: int = 64,
) -> torch.Tensor:
    """Payload bytes of ``flatcomm.encode`` (bit-exact); updates ``residual`` in place like the kernel.
    ``keep``: the chunked sparse codecs' kept values per chunk of ``block_size`` (at most the chunk)."""
    if codec not in CODECS:
        raise ValueError(f"reference: unknown codec {codec!r}")
    if stochastic and codec not in STOCHASTIC:
        raise ValueError("reference: stochastic rounding is available for int8, int4 and bf16 only")
    if codec in sparse.CHUNKED_BITS:
        p, new_r = sparse.encode(x, codec, residual=residual, chunk=block_size, keep=min(keep, block_size))
        if residual is not None and new_r is not None:
            residual.view(-1).copy_(new_r)
        return p
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
    if codec in CAST:
        new, ok, parts = _encode_cast(v, codec, stochastic, seed)
    elif codec == "topk":
        new, ok, parts = _encode_topk(v, k, off)
    else:
        new, ok, parts = _encode_blocks(v, codec, block_size, nb, off, stochastic, seed)
    if residual is not None:
        assert r_old is not None  # loaded above whenever there is a residual
        # the residual keeps its old value where the encoding is not finite (the kernel's rule)
        residual.view(-1).copy_(torch.where(ok, new, r_old))
    return _assemble(total, *parts)


# Each codec family's encoding: (the new residual, where it replaces the old one, the payload's
# (offset, bytes) parts).
_Encoded = Tuple[torch.Tensor, torch.Tensor, Tuple[Tuple[int, torch.Tensor], ...]]


def _encode_cast(v: torch.Tensor, codec: str, stochastic: bool, seed: int) -> _Encoded:
    if codec == "fp32":
        d = v
        data = _u8(v)
    elif codec == "bf16":
        if stochastic:
            u = f32_bits(v)
            rnd = (u + (random_u32(seed, torch.arange(v.numel(), dtype=torch.int64)) & 0xFFFF)) >> 16
            h = torch.where((u & ABS_MASK) >= INF_BITS, f32_to_bf16_bits(v), rnd & 0xFFFF)
        else:
            h = f32_to_bf16_bits(v)
        d = bf16_bits_to_f32(h)
        data = _u8(torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16))
    else:
        h = f32_to_f16_bits(v)
        d = f16_bits_to_f32(h)
        data = _u8(torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16))
    return v - d, torch.isfinite(d), ((0, data),)


def _encode_topk(v: torch.Tensor, k: int, off: int) -> _Encoded:
    n = v.numel()
    ab = abs_bits(v)
    # larger |v| bits first, ties to the lower index (stable sort keeps index order)
    order = torch.sort(ab, descending=True, stable=True).indices[:k]
    kept = torch.sort(order).values
    take = torch.zeros(n, dtype=torch.bool)
    take[kept] = True
    return torch.where(take, _full(v, 0.0), v), ab < INF_BITS, ((0, _u8(kept.to(torch.int32))), (off, _u8(v[kept])))


def _encode_blocks(v: torch.Tensor, codec: str, block_size: int, nb: int, off: int, stochastic: bool,
                   seed: int) -> _Encoded:
    """sign, int8, int4: a scale per block, then the codes."""
    n = v.numel()
    vb = _blocked(v, block_size)
    counts = torch.clamp(n - torch.arange(nb, dtype=torch.int64) * block_size, max=block_size)
    mab = abs_bits(vb).amax(dim=1)
    finite_block = mab < INF_BITS
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
            gidx = _blocked(torch.arange(n, dtype=torch.int64), block_size)  # global index (padding: 0, discarded)
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
    return v - d, finite_block.repeat_interleave(block_size)[:n], ((0, _u8(scale)), (off, codes))


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
               ratio: float = 0.01, keep: int = 64) -> torch.Tensor:
    """fp32 values of a payload, parsed from its bytes."""
    payload = payload.reshape(-1)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    if codec in sparse.CHUNKED_BITS:
        return sparse.decode(payload, codec, n, block_size, min(keep, block_size))
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
    if codec == "topk" or codec in sparse.CHUNKED_BITS or not (rows >= 1 and (rows - 1) * row_numel < numel <= rows * row_numel):
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
    keep: int = 64,
) -> torch.Tensor:
    """``flatcomm.decode_sum`` (bit-exact): ((d0 + d1) + d2) + ..., then one multiply by fp32(scale).

    topk and chunked sparse rows only add at their kept positions (other elements are left
    untouched, not "+ 0.0"); a non-finite chunk of a chunked row sets its chunk to NaN.
    With ``reencode`` the fp32 sum is encoded like :func:`encode` (same global element indices).
    """
    rows = payloads.shape[0]
    out = torch.zeros(n, dtype=torch.float32)
    for r in range(rows):
        if codec in sparse.CHUNKED_BITS:
            if r == 0:
                out = torch.zeros(n, dtype=torch.float32)
            kk = min(keep, block_size)
            for c, ent in enumerate(sparse.entries(payloads[r], codec, n, block_size, kk)):
                if ent is None:
                    out[c * block_size:(c + 1) * block_size] = float("nan")
                    continue
                idx = torch.tensor([c * block_size + p for p in ent[0]], dtype=torch.int64)
                val = ent[1]
                out[idx] = val if r == 0 else out[idx] + val
        elif codec == "topk":
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
