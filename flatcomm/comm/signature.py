"""The signature fields of a collective's call header (:mod:`flatcomm.comm.header`): every field
that decides a payload's size or layout, exactly (floats as their float64 bits)."""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from .fields import AUTO_CODEC, DEVICE_TYPES, DTYPES, MODES
from .header_table import float_bits
from ..ops.codecs import CODECS, Codec

__all__ = ["codec_fields", "device_field", "exact_fields", "signature"]


def codec_fields(codec, prefix: str = "") -> List[Tuple[str, int]]:
    """A codec's header fields (``"auto"``: :data:`AUTO_CODEC`); the topk ratio's exact bits."""
    if isinstance(codec, str) and codec == "auto":
        return [(prefix + "codec", AUTO_CODEC), (prefix + "block_size", 0), (prefix + "topk ratio", 0)]
    # The chunked sparse codecs send their kept share (keep / block_size, exact in float64) in the
    # ratio field: ranks keeping different counts per chunk would exchange payloads of other sizes.
    ratio = codec.keep / codec.block_size if codec.chunked else codec.ratio
    return [(prefix + "codec", CODECS.index(codec.name)), (prefix + "block_size", codec.block_size),
            (prefix + "topk ratio", float_bits(ratio))]


def device_field(device: torch.device) -> Tuple[str, int]:
    t = device.type
    return ("device", DEVICE_TYPES.index(t) if t in DEVICE_TYPES else len(DEVICE_TYPES))


def signature(kind: int, numel: int, codec: Union[Codec, str], mode: str, scale: float, dtype: torch.dtype,
              chunks: int, extra: Sequence[Tuple[str, int]] = ()) -> List[Tuple[str, int]]:
    return [("collective", kind), ("numel", numel)] + codec_fields(codec) + [
        ("mode", MODES.index(mode)),
        ("op scale", float_bits(scale)),
        ("dtype", DTYPES.index(dtype)),
        ("chunks", chunks),
    ] + list(extra)


def exact_fields(mode: str, block: int, headroom: int) -> List[Tuple[str, int]]:
    # Ranks that disagree on the exact-mode grid would exchange exponent lists of different sizes.
    exact = mode == "exact"
    return [("exact_block", block if exact else 0), ("headroom", headroom if exact else 0)]
