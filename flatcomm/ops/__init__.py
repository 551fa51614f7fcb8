"""The kernels: codecs with fused error feedback, fused decode-and-sum in a fixed order, ordered and
exact sums, all ``torch.ops.flatcomm`` ops (CPU, CUDA) with fake kernels for ``torch.compile``.

The lowest layer of the library: nothing here knows about process groups. ``reference`` is a slow
pure-torch oracle of every op; ``cupy_backend`` is the optional NVRTC path for CUDA builds of torch
with a CPU build of the extension (registered by ``import flatcomm``, opt-in).
"""
from __future__ import annotations

from .codecs import (
    BLOCKWISE,
    CODECS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_TOPK_RATIO,
    MAX_NUMEL,
    PRECISION,
    Codec,
    CodecLike,
    decode,
    decode_rows,
    decode_sum,
    encode,
    resolve,
    wire_bytes,
)
from .native import extension, ops
from .sums import (
    DEFAULT_EXACT_BLOCK,
    DEFAULT_HEADROOM,
    exact_exponents,
    exact_sum,
    from_exact,
    ordered_sum,
    to_exact,
)

__all__ = [
    "BLOCKWISE", "CODECS", "DEFAULT_BLOCK_SIZE", "DEFAULT_EXACT_BLOCK", "DEFAULT_HEADROOM", "DEFAULT_TOPK_RATIO",
    "MAX_NUMEL", "PRECISION", "Codec", "CodecLike", "decode", "decode_rows", "decode_sum", "encode", "exact_exponents",
    "exact_sum", "extension", "from_exact", "ops", "ordered_sum", "resolve", "to_exact", "wire_bytes",
]
