"""The signature fields of a collective's call header (:mod:`flatcomm.comm.header`): every field
that decides a payload's size or layout, exactly (floats as their float64 bits)."""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from .fields import AUTO_CODEC, DEVICE_TYPES, DTYPES, MODES, pairs
from .header_table import float_bits
from ..ops.codecs import CODECS, Codec

__all__ = ["codec_fields", "device_field", "exact_fields", "signature"]


def codec_fields(codec, intra: bool = False) -> List[Tuple[str, int]]:
    """A codec's header fields (``"auto"``: :data:`AUTO_CODEC`); the topk ratio's exact bits;
    ``intra``: as the two-level path's intra-node codec."""
    if isinstance(codec, str) and codec == "auto":
        number, block, ratio = AUTO_CODEC, 0, 0
    else:
        # The chunked sparse codecs send their kept share (keep / block_size, exact in float64) in the
        # ratio field: ranks keeping different counts per chunk would exchange payloads of other sizes.
        number, block = CODECS.index(codec.name), codec.block_size
        ratio = float_bits(codec.keep / codec.block_size if codec.chunked else codec.ratio)
    if intra:
        return pairs(intra_codec=number, intra_block_size=block, intra_topk_ratio=ratio)
    return pairs(codec=number, block_size=block, topk_ratio=ratio)


def device_field(device: torch.device) -> Tuple[str, int]:
    t = device.type
    return pairs(device=DEVICE_TYPES.index(t) if t in DEVICE_TYPES else len(DEVICE_TYPES))[0]


def signature(kind: int, numel: int, codec: Union[Codec, str], mode: str, scale: float, dtype: torch.dtype,
              chunks: int, extra: Sequence[Tuple[str, int]] = ()) -> List[Tuple[str, int]]:
    return (pairs(collective=kind, numel=numel) + codec_fields(codec)
            + pairs(mode=MODES.index(mode), op_scale=float_bits(scale), dtype=DTYPES.index(dtype), chunks=chunks)
            + list(extra))


def exact_fields(mode: str, block: int, headroom: int) -> List[Tuple[str, int]]:
    # Ranks that disagree on the exact-mode grid would exchange exponent lists of different sizes.
    exact = mode == "exact"
    return pairs(exact_block=block if exact else 0, headroom=headroom if exact else 0)
