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
``small-native``          fp32, bf16 or fp16 in the header's payload slot, exact mode or ordered
                          with the values' own codec: one exchange, summed in C++ on gloo's thread
                          (:mod:`flatcomm.comm.small_native`)
``small``                 the other calls whose data fits the slot (a codec other than the values'
                          dtype, error feedback): one exchange, summed in Python
                          (:mod:`flatcomm.comm.small`)
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

``FLATCOMM_ROUTES_OFF`` (comma-separated route names, the same on every rank) turns routes off for
an A/B in the bench: a call whose route is off takes the next one of this table that runs it
(``small-native``, ``small``, ``gathered``, ``native``, then ``pipelined``, or ``exact`` in exact
mode), with the same sums; ``pipelined`` and ``exact`` cannot be turned off. It is read when a
call's route is decided (once per shape of a prepared call).

The backend adds two of its own (:mod:`flatcomm.backend.reduce`): ``passed-through`` (a reduction
flatcomm does not change, run by the inner backend after its header check) and ``full`` (a call the
collectives facade routes each time: CUDA tensors, several tensors, ``codec="auto"``, two levels).
"""
from __future__ import annotations

import enum
import os
from typing import FrozenSet, Optional

import torch

from . import args, flat, groups, rejected, small, small_native, worker
from .args import Call
from .fields import KIND_IDS
from .spec import CallSpec

__all__ = ["ROUTES_OFF_ENV", "Route", "all_reduce", "of", "parse_routes_off", "routes_off", "run"]

ROUTES_OFF_ENV = "FLATCOMM_ROUTES_OFF"


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
    """The route of an all-reduce with the checked arguments ``a`` on ``group`` (a private group):
    the cheapest that runs it and is not turned off (:func:`routes_off`)."""
    off = routes_off()
    last = Route.EXACT if mode == "exact" else Route.PIPELINED
    if small.fits_all_reduce(group, a, mode):
        if small.in_slot(group, a, mode):
            if Route.SMALL_NATIVE not in off and small_native.name_if_native(group, a, mode, True) is not None:
                return Route.SMALL_NATIVE
            if Route.SMALL not in off:
                return Route.SMALL
        if Route.GATHERED not in off:
            return Route.GATHERED
    if Route.NATIVE not in off and flat.runs_natively(group, a, mode):
        return Route.NATIVE
    return last


_CANNOT_BE_OFF = (Route.PIPELINED, Route.EXACT, Route.PASSED_THROUGH, Route.FULL)


def routes_off() -> FrozenSet[Route]:
    """The routes :data:`ROUTES_OFF_ENV` turns off (none by default): :func:`parse_routes_off`."""
    return parse_routes_off(os.environ.get(ROUTES_OFF_ENV, ""))


def parse_routes_off(raw: str) -> FrozenSet[Route]:
    """The routes named in ``raw`` (comma-separated); a name that is not a route that can be
    turned off raises ValueError naming it."""
    if not raw.strip():
        return frozenset()
    names = {n.strip() for n in raw.split(",") if n.strip()}
    known = {r.value: r for r in Route if r not in _CANNOT_BE_OFF}
    bad = sorted(names - set(known))
    if bad:
        raise ValueError(f"flatcomm: {ROUTES_OFF_ENV}={raw!r}: {', '.join(bad)} cannot be turned off; "
                         f"routes that can: {', '.join(sorted(known))}")
    return frozenset(known[n] for n in names)


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
