"""What one collective call asks for, apart from its tensors and its group: a frozen
:class:`CallSpec`, built once at the facade (:mod:`flatcomm.collectives`) from the public
keywords and handed down unchanged through the layers (:mod:`flatcomm.comm.flat`,
:mod:`flatcomm.comm.two_level`), which check it once, in the argument layer
(:mod:`flatcomm.comm.args`: inside :func:`~flatcomm.comm.rejected.in_step`, so that a rejected
field is every rank's error). A layer that settles a field (``codec="auto"`` resolved by the
tuner, a tier's own codec) passes ``dataclasses.replace(spec, ...)`` on: nobody mutates a spec.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union

import torch

from ..ops.codecs import CodecLike
from ..ops.sums import DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM

if TYPE_CHECKING:  # (the layers that check a spec import this module)
    from .args import ErrorFeedback, OpLike
    from .layout import CommStats
    from .two_level_args import TieredFeedback, TierStats

__all__ = ["CallSpec"]


@dataclasses.dataclass(frozen=True, eq=False)
class CallSpec:
    """The options of one collective call, as the public functions name them (see
    :func:`flatcomm.collectives.all_reduce`). The types say what each field holds once checked;
    values come from callers unchecked, and the argument layer checks every field.

    Args:
        codec: a codec name (``"auto"`` too) or a :class:`flatcomm.Codec`.
        op: ``"avg"`` / ``"sum"`` or a ``torch.distributed.ReduceOp`` (reductions only).
        mode: ``"ordered"`` or ``"exact"`` (reductions only).
        async_op: return a Handle instead of waiting.
        residual: an ErrorFeedback, a Tensor (one-stage calls) or a TieredFeedback (two-level).
        chunks: pipeline chunks (None: chosen from the size; reductions only).
        stats: a CommStats (two-level: a TierStats) to add this call's counters to.
        validate: exchange and check the call header (the cross-rank consistency check).
        exact_block: exact mode's block size (reductions only).
        headroom: exact mode's headroom bits (reductions only).
        intra_codec: the node tier's codec of a two-level call (unused by the flat path).
    """

    codec: Union[CodecLike, str] = "fp32"
    op: "OpLike" = "avg"
    mode: str = "ordered"
    async_op: bool = False
    residual: Optional[Union["ErrorFeedback", torch.Tensor, "TieredFeedback"]] = None
    chunks: Optional[int] = None
    stats: Optional[Union["CommStats", "TierStats"]] = None
    validate: bool = True
    exact_block: int = DEFAULT_EXACT_BLOCK
    headroom: int = DEFAULT_HEADROOM
    intra_codec: Union[CodecLike, str] = "fp32"
