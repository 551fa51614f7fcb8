"""The worker threads that run flatcomm's collectives, and the :class:`Handle` of an async call.

One worker thread per key (the token of a process group's context, or of a topology's pair of
groups: :mod:`flatcomm.comm.context`, which joins the thread when the group is destroyed) runs every collective
of that key, synchronous ones included, in submission order, so every rank issues its collectives
(header exchange and chunk exchanges) in the same order: a check issued from the caller's thread
while an earlier asynchronous collective is still exchanging chunks on the worker could pair with a
different collective on a peer (gloo matches collectives by issue order) and hang. Nothing blocks
inside a future callback.

Call order: a call that reads its values when it is posted (a small call, a header check) is posted
from the caller's thread only while nothing of the group is in flight (:func:`post_if_idle`); a
call for the native lane only while the worker has nothing and no small call is unfinished
(:func:`post_to_lane_if_idle`: the lane runs its calls after every earlier native one). Every
other call is queued here, and the worker first finishes what came before it (the lane's calls,
the small calls posted from a caller's thread). So a group's calls take effect in call order,
whatever mix of routes they take.

Destroying a group first lets its calls in flight finish (:func:`drain`, as gloo drains its queue),
as long as they keep finishing: every rank posted them, so every rank completes them alike.
"""
from __future__ import annotations

import collections
import concurrent.futures
import datetime
import logging
import threading
import time
import weakref
from typing import Callable, List, Optional, Sequence, TypeVar, Union

import torch

from . import context, groups, streams as _streams
from .labels import label
from ..ops.native import extension

__all__ = ["CLOSE_DRAIN_S", "LANE_TIMEOUT", "Handle", "call", "drain", "in_order", "is_on", "key_of", "post_if_idle",
           "post_to_lane_if_idle", "run", "submit"]

T = TypeVar("T")
log = logging.getLogger("flatcomm")

# The profiler label of a collective, from the first word of its description.
_LABELS = {"all_reduce": "flatcomm.all_reduce", "reduce_scatter": "flatcomm.reduce_scatter",
           "all_gather": "flatcomm.all_gather", "two-level": "flatcomm.hierarchical"}
_current = groups.on_worker  # .key: the key of the worker thread we are on, if any


def key_of(group) -> int:
    """The worker key of a process group (None: the default group): its context's token."""
    return context.of(group).token


def is_on(key) -> bool:
    """Whether the calling thread is the worker of ``key``."""
    return getattr(_current, "key", object()) == key


def _mark(key) -> None:
    _current.key = key
    _current.active = True


def _executor(key) -> concurrent.futures.ThreadPoolExecutor:
    ctx = context.by_token(key)

    def make() -> concurrent.futures.ThreadPoolExecutor:
        ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flatcomm", initializer=_mark,
                                                   initargs=(key,))
        # Closed with the group: its calls drained first (while they keep finishing), what is left
        # cancelled, its thread joined (unless closing on that thread itself, which then ends after
        # its current call).
        ctx.on_drain(lambda: None if drain(key) else log.warning(
            "flatcomm: calls of a destroyed group did not finish within %s s of each other: failed", CLOSE_DRAIN_S))
        ctx.on_close(lambda: ex.shutdown(wait=ctx.waits and not is_on(key), cancel_futures=True))
        return ex

    return ctx.slot("worker", make)


def _on_side(fn: Callable[[], None], streams: Optional[_streams.CallStreams],
             keep: Sequence[Optional[torch.Tensor]] = ()) -> Callable[[], None]:
    """fn, run on the side stream when ``streams`` (CUDA) is given."""
    if streams is None:
        return fn

    def on_side():
        with streams.side(keep):
            fn()

    return on_side


class _Lane:
    """What of a key's calls is in flight outside the native lane: how many are queued or running
    on its worker, and the small calls posted from a caller's thread that have not written their
    result yet (see the module's docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.busy = 0
        self.finished = 0  # worker calls ended (drain's measure of progress)
        self.posted: "collections.deque" = collections.deque()  # (.done, .finish()) of posted small calls

    def posted_pending(self) -> bool:
        while self.posted and self.posted[0].done:
            self.posted.popleft()
        return bool(self.posted)


def _lane(key) -> _Lane:
    return context.by_token(key).slot("lane", _Lane)


LANE_TIMEOUT = "native lane timeout"  # context slot, set once the group has a native lane


def _native_in_flight(key) -> int:
    """Native calls of the group posted and not finished (0 for a group that has made none)."""
    ctx = context.by_token(key)
    return extension.lane_in_flight(key) if ctx.get(LANE_TIMEOUT) is not None else 0


def _finish_earlier(key) -> None:
    """Finish the calls that came before this one outside the worker: the native lane's
    (:mod:`flatcomm.comm.lane`, small native ones included) and the small calls posted from a
    caller's thread (their results written now; their errors are their own waiters')."""
    timeout = context.by_token(key).get(LANE_TIMEOUT)
    if timeout is not None:
        extension.lane_drain(key, timeout)
    lane = _lane(key)
    with lane.lock:
        pending = list(lane.posted)
        lane.posted.clear()
    for posted in pending:
        try:
            posted.finish()
        except Exception:  # noqa: BLE001 - raised to that call's own waiter
            pass


def _enqueue(key, fn: Callable[[], T]) -> "concurrent.futures.Future":
    """``fn`` queued on the worker of ``key``, counted in its lane until it ends."""
    lane = _lane(key)

    def task() -> T:
        try:
            _finish_earlier(key)
            return fn()
        finally:
            with lane.lock:
                lane.busy -= 1
                lane.finished += 1

    with lane.lock:
        lane.busy += 1
    try:
        return _executor(key).submit(task)
    except BaseException:
        with lane.lock:
            lane.busy -= 1
        raise


def post_if_idle(key, post: Callable[[], T], track: bool = False) -> Optional[T]:
    """``post()`` run on the calling thread when nothing of the group of ``key`` is in flight: no
    call queued or running on its worker, none on its native lane, no small call unfinished (else
    None: queue the call on the worker, which runs it after them). For a call that reads its
    values when posted. ``post`` only issues an exchange, never waits for one; ``track``: what it
    returns is a small call the worker must finish before its next call (``.done``,
    ``.finish()``)."""
    lane = _lane(key)
    with lane.lock:
        if lane.busy or lane.posted_pending() or _native_in_flight(key):
            return None
        posted = post()
        if track:
            lane.posted.append(posted)
        return posted


def post_to_lane_if_idle(key, post: Callable[[], T]) -> Optional[T]:
    """``post()`` (a call for the group's native lane, which starts only once every native call
    posted before it finished) run on the calling thread when nothing is queued or running on the
    worker of ``key`` and no small call posted from a caller's thread is unfinished; else None."""
    lane = _lane(key)
    with lane.lock:
        if lane.busy or lane.posted_pending():
            return None
        return post()


CLOSE_DRAIN_S = 5.0  # a closing group waits for its calls in flight while one finishes within this


def drain(key) -> bool:
    """Wait for every call of the group of ``key`` in flight (its worker's, its native lane's, its
    posted small calls') while they keep finishing: give up once none finished for
    :data:`CLOSE_DRAIN_S` (a peer that will never join). True when all finished."""
    if is_on(key):
        return False  # (closing from the worker itself: its own call is one of them)
    lane = _lane(key)
    try:
        done = _enqueue(key, lambda: None)  # runs once everything before it finished
    except RuntimeError:  # the interpreter is exiting: the worker's executor ran what it had
        done = None
    seen, last = None, time.monotonic()
    while True:
        try:
            if done is not None:
                done.result(timeout=0.05)
                return True
            if not (_native_in_flight(key) or lane.posted_pending()):
                return True
            time.sleep(0.05)
        except concurrent.futures.TimeoutError:
            pass
        except Exception:  # noqa: BLE001 - e.g. the lane's drain timed out
            return False
        progress = (lane.finished, extension.lane_completed(key))
        if progress != seen:
            seen, last = progress, time.monotonic()
        elif time.monotonic() - last > CLOSE_DRAIN_S:
            return False


def submit(key, device: torch.device, fn: Callable[[], None]) -> "concurrent.futures.Future":
    """Queue ``fn`` (no collective) on the worker of ``key``, on the side stream for CUDA tensors
    (the DDP hook's norms, which read the bucket before the all-reduce rewrites it)."""
    return _enqueue(key, _on_side(fn, _streams.for_call(key, device)))


def in_order(key, fn: Callable[[], None]) -> "concurrent.futures.Future":
    """``fn``'s outcome as a Future, run in order with the other calls on the worker of ``key``:
    queued there, or run inline when called from that worker (a call built on others)."""
    if not is_on(key):
        return submit(key, torch.device("cpu"), fn)
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        fn()
        future.set_result(None)
    except BaseException as e:  # noqa: BLE001 - the Future holds it
        future.set_exception(e)
    return future


def call(key, fn: Callable[[], object]) -> object:
    """Run ``fn`` on the worker of ``key`` and return its result (inline when already there)."""
    if is_on(key):
        return fn()
    return _enqueue(key, fn).result()


def run(key, fn: Callable[[], None], value: torch.Tensor, async_op: bool,
        keep: Sequence[Optional[torch.Tensor]] = (), what: str = "collective", group=None) -> Optional["Handle"]:
    """Run a collective's body on the worker of ``key``. ``keep``: the caller's tensors it uses
    (CUDA: protected from reuse by the caching allocator while the side stream runs). Called from
    that worker itself (a collective built on others), the body runs inline, in order."""
    grad = torch.is_grad_enabled()  # grad mode is thread-local: keep the caller's
    streams = _streams.for_call(key, value.device)  # None unless CUDA
    inner = _on_side(fn, streams, keep)
    name = _LABELS.get(what.split(" ", 1)[0], "flatcomm.comm.collective")  # the profiler label

    def body():
        with torch.set_grad_enabled(grad), label(name):
            inner()

    with label(name):
        return _run_body(key, body, value, async_op, streams, what, group)


def _run_body(key, body: Callable[[], None], value: torch.Tensor, async_op: bool,
              streams: Optional[_streams.CallStreams], what: str, group) -> Optional["Handle"]:
    if is_on(key):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            body()
            future.set_result(None)
        except BaseException as e:  # noqa: BLE001 - surfaces on wait(), or below when synchronous
            if not async_op:
                raise
            future.set_exception(e)
    else:
        future = _enqueue(key, body)
        if not async_op:
            future.result()
    if not async_op:
        if streams is not None:  # the work is enqueued: order the caller's stream after it
            streams.join_current()
        return None
    return Handle(future, value, streams, what, group)


class Handle:
    """Result of ``async_op=True``: ``wait()`` blocks (and re-raises errors), ``get_future()``
    gives a ``torch.futures.Future`` completed with the output tensor (CUDA-aware for CUDA
    tensors: see :mod:`flatcomm.comm.streams`). ``decision``: what ``codec="auto"`` chose (a
    :class:`flatcomm.autotune.Decision`), else None."""

    decision = None

    def __init__(self, future: "concurrent.futures.Future", value: torch.Tensor,
                 streams: Optional[_streams.CallStreams] = None, what: str = "collective", group=None):
        self._cf = future
        self._what = what  # for the timeout message
        self._group = weakref.ref(group) if group is not None else None  # (see header.CallHeader)
        self._value = value
        self._streams = streams  # CUDA only: the future is CUDA-aware
        self._torch_future: torch.futures.Future = (
            torch.futures.Future() if streams is None else streams.future())
        future.add_done_callback(self._complete)

    def _complete(self, cf: "concurrent.futures.Future") -> None:
        exc = concurrent.futures.CancelledError(
            f"flatcomm: {self._what} was cancelled: its process group was destroyed before it ran"
        ) if cf.cancelled() else cf.exception()
        if exc is not None:
            self._torch_future.set_exception(exc)
        elif self._streams is None:
            self._torch_future.set_result(self._value)
        else:
            try:
                self._streams.complete(self._torch_future, self._value)
            except BaseException as e:  # noqa: BLE001 - never leave the future pending
                self._torch_future.set_exception(e)

    def wait(self, timeout: Union[None, float, datetime.timedelta] = None) -> torch.Tensor:
        """Block until the collective is enqueued (CPU: done); with CUDA tensors the current
        stream is then made to wait for it, like ``Work.wait()`` of NCCL. Re-raises the
        collective's error. ``timeout``: seconds or a ``timedelta`` (as ``Work.wait`` takes;
        ``timedelta(0)``, Work's default, and None mean no limit): raise ``TimeoutError`` naming
        the collective if it has not finished by then (it stays in flight: wait again; the group's
        own timeout fails it if a peer never joins). Returns the output tensor (``Work.wait``
        returns True; the tensor is more useful and is truthy for the common ``if h.wait()``
        only when non-empty, so test :meth:`is_success` instead)."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"flatcomm: Handle.wait timeout must be seconds > 0, a timedelta or None, "
                             f"got {timeout!r}")
        try:
            self._cf.result(timeout)
        except concurrent.futures.CancelledError:
            raise concurrent.futures.CancelledError(
                f"flatcomm: {self._what} was cancelled: its process group was destroyed before it ran") from None
        except concurrent.futures.TimeoutError:
            if self._cf.done():  # the collective itself raised a TimeoutError: keep it
                raise
            group = self._group() if self._group is not None else None
            t = groups.group_timeout(group) if group is not None or self._group is None else None
            raise TimeoutError(
                f"flatcomm: {self._what} did not finish within {timeout} s (still in flight; "
                f"the group's own timeout{f' of {t}' if t is not None else ''} fails it if a peer never joins)"
            ) from None
        if self._streams is not None:
            self._streams.join_current()
        return self._value

    def cancel(self) -> bool:
        """Drop the collective if its worker has not started it (a two-level call that failed
        cancels its remaining tier calls); ``wait()`` then raises ``CancelledError``."""
        return self._cf.cancel()

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not), without blocking."""
        return self._cf.done() and (self._streams is None or self._streams.finished())

    def is_success(self) -> bool:
        """Whether the collective has finished without an error (False while in flight), as
        ``Work.is_success``."""
        return self.is_completed() and self._cf.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the collective raised, or None (also while it is still in flight), as
        ``Work.exception``."""
        return self._cf.exception() if self._cf.done() else None

    def result(self) -> List[torch.Tensor]:
        """The output tensors, as ``Work.result``: ``[output]`` (the tensor written in place).
        Blocks until the collective finishes and re-raises its error."""
        return [self.wait()]

    def get_future(self) -> torch.futures.Future:
        return self._torch_future
