"""Reference of the chunked sparse codecs (``sparse``: 2-bit, ``sparse4``: 4-bit, ``sparse1``: the sign
and one level), written from the
format description in ``csrc/core/sparse.h`` with plain Python integers and torch fp32 tensors, one
chunk at a time, independently of the kernels: the bytes and the residual bits they must reproduce.

Per chunk of ``chunk`` values: keep the ``keep`` largest |v| (ties to the lower position), split the
kept magnitudes into ``2^(bits-1)`` bins evenly in their fp32 bit patterns, send each bin's mean
magnitude (fp32, from a float64 mean) as the chunk's table, each kept value as sign + bin, and the
positions Elias-Fano coded. The residual becomes ``v - decoded`` (fp32), ``v`` for unsent values.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Tuple

import torch

__all__ = ["CHUNKED_BITS", "geometry", "layout", "encode", "decode", "entries"]

CHUNKED_BITS = {"sparse": 2, "sparse4": 4, "sparse1": 1}
_ALIGN = 16
_QNAN = struct.unpack("<f", struct.pack("<I", 0x7FC00000))[0]


def _f32(x: float) -> float:
    """x rounded to fp32 (nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bits(x: float) -> int:
    """The fp32 bit pattern of an fp32 value."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def geometry(bits: int, chunk: int, keep: int) -> dict:
    """Sizes of one chunk's table and record (as ``core::sparse_geom``)."""
    if not 1 <= keep <= chunk:  # as core::sparse_args_ok; keep 0 would never end the loop below
        raise ValueError(f"chunked sparse: keep must be in [1, chunk={chunk}], got {keep}")
    low = 0
    while (keep << (low + 1)) <= chunk:
        low += 1
    high = keep + ((chunk - 1) >> low) + 1
    idx_bytes = -(-(keep * low + high) // 8)
    return {"levels": 1 << (bits - 1), "low": low, "high": high, "idx_bytes": idx_bytes,
            "rec_bytes": idx_bytes + -(-(keep * bits) // 8)}


def _round16(v: int) -> int:
    return -(-v // _ALIGN) * _ALIGN


def layout(codec: str, n: int, chunk: int, keep: int) -> Tuple[int, int, dict]:
    """(number of chunks, byte offset of the records, geometry); total = round16(off + nc * rec)."""
    g = geometry(CHUNKED_BITS[codec], chunk, keep)
    nc = -(-n // chunk)
    return nc, _round16(4 * g["levels"] * nc), g


def wire_bytes(codec: str, n: int, chunk: int, keep: int) -> int:
    if n == 0:
        return 0
    nc, off, g = layout(codec, n, chunk, keep)
    return _round16(off + nc * g["rec_bytes"])


def _put(buf: bytearray, base: int, pos: int, value: int, width: int) -> None:
    for b in range(width):
        if (value >> b) & 1:
            buf[base + ((pos + b) >> 3)] |= 1 << ((pos + b) & 7)


def _get(buf: bytes, base: int, pos: int, width: int) -> int:
    return sum(((buf[base + ((pos + b) >> 3)] >> ((pos + b) & 7)) & 1) << b for b in range(width))


def _encode_chunk(v: List[float], g: dict, bits: int, keep: int) -> Tuple[List[float], List[int], List[int],
                                                                       Optional[List[float]]]:
    """(table, kept positions, codes, decoded values of the kept or None for a non-finite chunk)."""
    m = len(v)
    kk = min(keep, m)
    ab = [_bits(x) & 0x7FFFFFFF for x in v]
    if any(a >= 0x7F800000 for a in ab):
        return [float("nan")] * g["levels"], list(range(kk)), [0] * kk, None
    order = sorted(range(m), key=lambda i: (-ab[i], i))  # larger |v| first, then lower position
    pos = sorted(order[:kk])
    lo, hi = min(ab[p] for p in pos), max(ab[p] for p in pos)
    span = hi - lo + 1
    bins = [(ab[p] - lo) * g["levels"] // span for p in pos]
    table = []
    for j in range(g["levels"]):
        mags = [abs(v[p]) for p, b in zip(pos, bins) if b == j]
        s = 0.0
        for x in mags:  # ascending position order, in float64
            s += x
        table.append(_f32(s / len(mags)) if mags else 0.0)
    codes, dec = [], []
    for p, b in zip(pos, bins):
        neg = _bits(v[p]) >> 31
        codes.append(neg | (b << 1))
        dec.append(-table[b] if neg else table[b])
    return table, pos, codes, dec


def encode(x: torch.Tensor, codec: str, *, residual: Optional[torch.Tensor] = None, chunk: int = 4096,
           keep: int = 64) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(payload uint8, new residual or None) for ``x`` (any float dtype) plus ``residual``."""
    bits = CHUNKED_BITS[codec]
    xv = x.reshape(-1).to(torch.float32)
    v = (xv + residual.reshape(-1) if residual is not None else xv).contiguous()  # fp32 adds
    n = v.numel()
    out = bytearray(wire_bytes(codec, n, chunk, keep))
    new_r = residual.reshape(-1).clone() if residual is not None else None
    if n == 0:
        return torch.tensor(list(out), dtype=torch.uint8), new_r
    nc, off, g = layout(codec, n, chunk, keep)
    for c in range(nc):
        vc = v[c * chunk:(c + 1) * chunk]
        table, pos, codes, dec = _encode_chunk(vc.tolist(), g, bits, keep)
        out[4 * g["levels"] * c: 4 * g["levels"] * (c + 1)] = struct.pack(f"<{g['levels']}f", *table)
        base = off + c * g["rec_bytes"]
        for e, (p, code) in enumerate(zip(pos, codes)):
            _put(out, base, e * g["low"], p & ((1 << g["low"]) - 1), g["low"])
            _put(out, base, keep * g["low"] + (p >> g["low"]) + e, 1, 1)
            _put(out, base + g["idx_bytes"], e * bits, code, bits)
        if new_r is not None and dec is not None:
            rc = vc.clone()
            idx = torch.tensor(pos, dtype=torch.int64)
            rc[idx] = vc[idx] - torch.tensor(dec, dtype=torch.float32)  # fp32 subtraction
            new_r[c * chunk:c * chunk + vc.numel()] = rc
    return torch.tensor(list(out), dtype=torch.uint8), new_r


def entries(payload: torch.Tensor, codec: str, n: int, chunk: int = 4096, keep: int = 64):
    """Per chunk: None (non-finite chunk) or (positions, fp32 values as a tensor), from a valid payload."""
    bits = CHUNKED_BITS[codec]
    buf = bytes(payload.reshape(-1).tolist())
    nc, off, g = layout(codec, n, chunk, keep)
    lv = g["levels"]
    result: List[Optional[Tuple[List[int], torch.Tensor]]] = []
    for c in range(nc):
        m = min(chunk, n - c * chunk)
        kk = min(keep, m)
        table = struct.unpack(f"<{lv}f", buf[4 * lv * c:4 * lv * (c + 1)])
        if all(t != t for t in table):
            result.append(None)
            continue
        base = off + c * g["rec_bytes"]
        ones = [q for q in range(g["high"]) if _get(buf, base, keep * g["low"] + q, 1)]
        assert len(ones) == kk, "reference: not a valid payload"
        pos, val = [], []
        for e, q in enumerate(ones):
            pos.append(((q - e) << g["low"]) | _get(buf, base, e * g["low"], g["low"]))
            code = _get(buf, base + g["idx_bytes"], e * bits, bits)
            a = table[code >> 1]
            val.append(-a if code & 1 else a)
        result.append((pos, torch.tensor(val, dtype=torch.float32)))
    return result


def decode(payload: torch.Tensor, codec: str, n: int, chunk: int = 4096, keep: int = 64) -> torch.Tensor:
    """fp32 values of a valid payload: kept values, zeros elsewhere, NaN over a non-finite chunk."""
    out = torch.zeros(n, dtype=torch.float32)
    for c, ent in enumerate(entries(payload, codec, n, chunk, keep)):
        if ent is None:
            out[c * chunk:(c + 1) * chunk] = _QNAN
        elif ent[0]:
            out[torch.tensor([c * chunk + p for p in ent[0]], dtype=torch.int64)] = ent[1]
    return out
