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

from . import bits, codecs, sums
from .bits import *  # noqa: F401,F403
from .codecs import *  # noqa: F401,F403
from .sums import *  # noqa: F401,F403

__all__ = bits.__all__ + codecs.__all__ + sums.__all__  # type: ignore[attr-defined]
