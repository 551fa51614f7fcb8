"""Which route an all-reduce takes, decided in one place from its checked arguments.

An all-reduce's route depends only on its shape (numel, dtype, device, codec, mode, error feedback,
the group's size and header slot), never on timing, so it is decided once per shape
(:func:`of`), kept with a prepared call (:mod:`flatcomm.comm.prepared`), and every all-reduce runs
on the route :func:`of` gave (:func:`run`: the collectives facade's calls through :func:`all_reduce`,
a prepared call's queued posts); no path below decides again. When a call is
*posted* is a separate matter of call order (:mod:`flatcomm.comm.worker`): a route that may be
posted from the caller's thread is queued on the group's worker while earlier calls are in flight,
with the same exchanges and bits.

The routes, cheapest first (docs/backend.md has the table a user reads, and a test keeps the two
equal):

========================  ========================================================================
``small-native``          ordered fp32, or exact mode (fp32, bf16, fp16), in the header's payload
                          slot: one exchange, summed in C++ on gloo's thread
                          (:mod:`flatcomm.comm.small_native`)
``small``                 the other calls whose data fits the slot (ordered bf16/fp16, error
                          feedback): one exchange, summed in Python (:mod:`flatcomm.comm.small`)
``gathered``              up to :data:`flatcomm.comm.small.GATHER_TABLE_BYTES` in all: the header,
                          then one all-gather of the payloads, on the worker
``native``                lossless fp32, ordered or exact, on CPU point-to-point transfers: one C++
                          op on the native lane once the ranks agreed its plan (its second call
                          on), before that on the worker after its header (:mod:`flatcomm.comm.lane`)
``pipelined``             everything else ordered: encode, exchange and decode-sum chunk by chunk
                          on the worker (:mod:`flatcomm.comm.flat`)
``exact``                 exact mode over the gather table that does not run natively (CUDA, bf16,
                          fp16: :mod:`flatcomm.comm.exact`)
========================  ========================================================================

The backend adds two of its own (:mod:`flatcomm.backend.reduce`): ``passed-through`` (a reduction
flatcomm does not change, run by the inner backend after its header check) and ``full`` (a call the
collectives facade routes each time: CUDA tensors, several tensors, ``codec="auto"``, two levels).
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from . import args, flat, groups, rejected, small, small_native, worker
from .args import Call
from .fields import KIND_IDS
from .spec import CallSpec

__all__ = ["Route", "all_reduce", "of", "run"]


class Route(str, enum.Enum):
    SMALL_NATIVE = "small-native"
    SMALL = "small"
    GATHERED = "gathered"
    NATIVE = "native"
    PIPELINED = "pipelined"
    EXACT = "exact"
    PASSED_THROUGH = "passed-through"
    FULL = "full"

    def __str__(self) -> str:
        return self.value


def of(group, a: Call, mode: str) -> Route:
    """The route of an all-reduce with the checked arguments ``a`` on ``group`` (a private group)."""
    if small.fits_all_reduce(group, a, mode):
        if not small.in_slot(group, a, mode):
            return Route.GATHERED
        native = small_native.name_if_native(group, a, mode, True) is not None
        return Route.SMALL_NATIVE if native else Route.SMALL
    if flat.runs_natively(group, a, mode):
        return Route.NATIVE
    return Route.EXACT if mode == "exact" else Route.PIPELINED


_IN_ONE_EXCHANGE = (Route.SMALL_NATIVE, Route.SMALL, Route.GATHERED)


def run(r: Route, group, a: Call, spec: CallSpec, tensor: torch.Tensor) -> Optional[worker.Handle]:
    """Run the checked all-reduce ``a`` (of ``tensor``, the caller's) on route ``r`` (:func:`of`'s),
    on the group's worker or, for the small routes, posted where call order allows. The native
    routes' C++ posts are :mod:`flatcomm.comm.prepared`'s; here they run as their Python-posted
    equivalents (the small call in Python, the native op on the worker), with the same bits."""
    if r in _IN_ONE_EXCHANGE:
        return small.all_reduce(group, a, spec, tensor, slot=r is not Route.GATHERED)
    return flat.checked_all_reduce(group, a, spec, tensor, native=r is Route.NATIVE)


def all_reduce(tensor: torch.Tensor, spec: CallSpec = CallSpec(), group=None) -> Optional[worker.Handle]:
    """All-reduce ``tensor`` in place on its route (see :func:`flatcomm.collectives.all_reduce`)."""
    group = groups.private_group(group)
    a = rejected.in_step(group, KIND_IDS["all_reduce"], spec.async_op, lambda: args.all_reduce_call(group, tensor, spec))
    if isinstance(a, worker.Handle):
        return a
    return run(of(group, a, spec.mode), group, a, spec, tensor)
