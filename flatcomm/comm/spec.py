"""What one collective call asks for, apart from its tensors and its group: a frozen
:class:`CallSpec`, built once at the facade (:mod:`flatcomm.collectives`) from the public
keywords and handed down unchanged through the layers (:mod:`flatcomm.comm.flat`,
:mod:`flatcomm.comm.two_level`), which check it once, in the argument layer
(:mod:`flatcomm.comm.args`: inside :func:`~flatcomm.comm.args.in_step`, so that a rejected
field is every rank's error). A layer that settles a field (``codec="auto"`` resolved by the
tuner, a tier's own codec) passes ``dataclasses.replace(spec, ...)`` on: nobody mutates a spec.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..ops.sums import DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM

__all__ = ["CallSpec"]


@dataclasses.dataclass(frozen=True, eq=False)
class CallSpec:
    """The options of one collective call, as the public functions name them (see
    :func:`flatcomm.collectives.all_reduce`). Unchecked: the argument layer checks every field.
    ``intra_codec``: the node tier's codec of a two-level call (unused by the flat path);
    ``op``, ``mode``, ``chunks``, ``exact_block``, ``headroom``: reductions only."""

    codec: Any = "fp32"
    op: Any = "avg"
    mode: Any = "ordered"
    async_op: Any = False
    residual: Any = None  # an ErrorFeedback, a Tensor (one-stage calls) or a TieredFeedback
    chunks: Optional[Any] = None
    stats: Any = None  # a CommStats (or, two-level, a TierStats) to add this call's counters to
    validate: Any = True
    exact_block: Any = DEFAULT_EXACT_BLOCK
    headroom: Any = DEFAULT_HEADROOM
    intra_codec: Any = "fp32"
