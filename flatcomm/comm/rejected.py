"""A rejected call that keeps the group in step.

Each collective runs its argument checks (:mod:`flatcomm.comm.args`) through :func:`in_step`. If any
of them raises (a ``ValueError`` or ``TypeError`` naming the argument, or an error nobody foresaw),
the rank still posts the call's header, marked failed with the reason (:func:`fail_in_step`), and
raises the error the header exchange agreed on: every rank of the call raises the same exception
with the same message ("rank 3 failed: TypeError: tensor must be ..."), and the next call pairs with
the peers' next call. With ``async_op=True`` the failed call returns a Handle whose ``wait()``
raises it.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from . import groups, header, worker
from .fields import pairs
from .header import FAILED_TYPE, FAILED_VALUE, CallHeader, has_cpu_backend

__all__ = ["fail_in_step", "in_step"]

T = TypeVar("T")


def fail_in_step(group, kind: int, err: BaseException) -> Optional["concurrent.futures.Future"]:
    """A rank whose arguments were rejected still takes part in the call's header exchange (status
    failed, the reason), so that every rank of the call raises the same error ("rank r failed:
    ...") and every rank's next call pairs with the peers' next call. Returns a future that fails
    with that agreed error once every rank's row is in (or with ``err`` itself if the exchange
    failed: the peers could not be told), or None when there is nobody to tell (one rank, no
    usable group)."""
    try:
        if not groups.exchanges(group):
            return None
        device = torch.device("cpu") if has_cpu_backend(group) else torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no usable group: nothing to keep in step
        return None
    reason = f"{type(err).__name__}: {str(err).removeprefix('flatcomm: ')}"
    status = FAILED_TYPE if isinstance(err, TypeError) else FAILED_VALUE

    def body():
        h = CallHeader(group, pairs(collective=kind), device, reason, status)
        try:
            h.work.wait()
        except Exception as x:  # noqa: BLE001 - the peers never answered: report our own error
            raise err from x
        verdict = h.error()
        raise verdict if verdict is not None else err  # never None: this rank's row says failed

    return worker.in_order(worker.key_of(group), body)


def in_step(group, kind: int, async_op: Any, checks: Callable[[], T]) -> Union[T, worker.Handle]:
    """``checks()``'s result, or, when it raises anything, the agreed error of the call (see the
    module docstring): raised here, or with ``async_op=True`` a Handle that raises it on ``wait()``."""
    try:
        return checks()
    except Exception as err:  # noqa: BLE001 - every failure of a check is reported to every rank
        fut = fail_in_step(group, kind, err)
        if fut is None:  # nobody to tell (one rank)
            raise
        if async_op is True:
            return worker.Handle(fut, torch.empty(0), None, f"{header.KINDS[kind]} (rejected arguments)", group)
        try:
            fut.result()
        except Exception as agreed:  # noqa: BLE001 - always: the future holds the agreed error
            if agreed is err:
                raise
            raise agreed from err
        raise
