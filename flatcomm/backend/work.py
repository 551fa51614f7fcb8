"""The one ``dist.Work`` type the flatcomm backend makes in Python: a reduction it runs itself, and a
coalesced call it passes through as several calls of the inner backend.

Its parts are flatcomm collectives (:class:`flatcomm.comm.worker.Handle`, one per dtype of a
coalesced call) or the inner backend's own ``dist.Work`` objects (the same waitable interface), and
a local ``finish`` step (copy a staged result back into the caller's tensors). The other calls
return what runs them: a native route's C++ ``Work`` (csrc/comm/native_work.h), the inner backend's
``Work`` for a single call passed through. ``wait(timeout)`` waits for
all of them, on the calling thread: ``timedelta(0)`` (``Work.wait``'s default) means the group's own timeout, so no wait is
unbounded; an error of the collective (raised on every rank of the call, see the collectives'
call header) is re-raised. ``get_future()`` completes with the output tensors once ``finish`` ran,
as DDP's reducer expects.

A failed future must be failed *in C++*: Python's ``Future.set_exception`` stores the exception as
the future's value (raised only by Python's unwrap), so DDP's reducer, which reads the value in C++,
took the exception object for its bucket and crashed (SIGSEGV in ``parseCppCommHookResult``). The
future handed out is therefore a ``then`` of the one we complete: a callback that raises fails its
child future with a C++ error, which the reducer rethrows and ``backward()`` raises in Python.
"""
from __future__ import annotations

import datetime
import threading
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..collectives import Handle

__all__ = ["ReductionWork"]

Part = Union[Handle, dist.Work]  # a flatcomm collective or an inner backend's call


def _error_of(part: Part) -> Optional[BaseException]:
    """The error a finished part raised, or None (also while in flight). An inner backend's Work:
    its finished ``wait()`` raises it (``Work.exception`` is deprecated in torch and warns, and
    gloo's reduce-scatter works have no future)."""
    if isinstance(part, Handle):
        return part.exception()
    if not part.is_completed():
        return None
    try:
        part.wait()
    except BaseException as e:  # noqa: BLE001 - the part's error, returned
        return e
    return None


def _futures(parts: Sequence[Part]) -> List[torch.futures.Future]:
    try:
        return [p.get_future() for p in parts]
    except RuntimeError as e:  # gloo's reduce-scatter: "Work::getFuture not implemented"
        raise RuntimeError(f"flatcomm backend: this call runs on the inner backend, whose work has no future "
                           f"here ({e}); wait() on the work instead") from None


def _unwrapped(source: torch.futures.Future):
    """The source's value, or its exception raised (which fails the child future in C++)."""
    return source.value()


class ReductionWork(dist.Work):
    """``handles``: the calls in flight (:data:`Part`); ``outputs``: what the future completes with;
    ``finish``: run once, after every handle succeeded; ``timeout``: the group's timeout (None:
    each part's own).

    Nothing is chained at construction: ``wait()`` waits for the handles and runs ``finish`` on
    the waiting thread (a synchronous ``dist.all_reduce`` then costs no thread hop); the future is
    built on the first ``get_future()``."""

    def __init__(self, handles: Sequence[Optional[Part]], outputs: List[torch.Tensor],
                 finish: Optional[Callable[[], None]], timeout: Optional[datetime.timedelta]):
        super().__init__()
        self._handles = [h for h in handles if h is not None]
        self._outputs = outputs
        self._finish = finish
        self._timeout = timeout
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._source: Optional[torch.futures.Future] = None
        self._future: Optional[torch.futures.Future] = None
        self._published = False

    def _settle(self) -> None:
        """Run ``finish`` once every handle is done (on the thread that sees the last one done)."""
        with self._lock:
            if not self._done:
                self._done = True
                try:
                    error = next((e for e in map(_error_of, self._handles) if e is not None), None)
                    if error is not None:
                        raise error
                    if self._finish is not None:
                        self._finish()
                except BaseException as e:  # noqa: BLE001 - the waiter re-raises it
                    self._error = e
        self._publish()

    def _publish(self) -> None:
        """Complete the future handed out, if any, once settled (exactly once)."""
        with self._lock:
            if not self._done or self._source is None or self._published:
                return
            self._published = True
        if self._error is not None:
            self._source.set_exception(self._error)
        else:
            self._source.set_result(self._outputs)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        limit = timeout if timeout and timeout.total_seconds() > 0 else self._timeout
        for h in self._handles:
            try:
                if limit is not None:
                    h.wait(limit)  # raises TimeoutError naming the collective, or the collective's error
                else:
                    h.wait()
            except BaseException:  # noqa: BLE001 - a finished part keeps its error; _settle raises it
                if not h.is_completed():
                    raise  # timed out (gloo: a RuntimeError), still in flight: wait again
        self._settle()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done and all(h.is_completed() for h in self._handles):
            self._settle()
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error if self.is_completed() else None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        parts = _futures(self._handles) if self._future is None else []
        with self._lock:
            if self._future is None:
                self._source = torch.futures.Future()
                self._future = self._source.then(_unwrapped)
                chain = True
            else:
                chain = False
        if chain:
            if self._handles:
                torch.futures.collect_all(parts).then(lambda _: self._settle())
            else:
                self._settle()
            self._publish()
        return self._future

    def synchronize(self) -> None:
        self.wait()
