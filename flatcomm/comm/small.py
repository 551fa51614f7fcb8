"""Small collectives in one exchange: the data travels in the call header's payload slot.

A flatcomm collective first all-gathers a fixed-size header row per rank
(:mod:`flatcomm.comm.header`), then moves its payloads in more rounds (an all-to-all and an
all-gather, on CPU point-to-point transfers, :mod:`flatcomm.comm.p2p`). For a small message those
rounds are the whole cost: each is a round trip through the backend (gloo over loopback: ~0.2 ms
for a small all-gather; the point-to-point exchanges several times that), where gloo's own small
all-reduce is about one. When the call's data fits the row's payload slot
(:func:`flatcomm.comm.header.slot_of`: 16 KB up to 4 ranks on the flatcomm backend's groups, none
elsewhere), each rank puts it there and the header exchange is the whole call; up to :data:`GATHER_TABLE_BYTES` of payloads in all, the header
goes first and one all-gather of the payloads follows (two exchanges, on the group's worker). Every
rank checks the header table as before (a mismatch raises the same named error on every rank, and
no payload is used), then computes its result from every rank's payload, with the kernels of the
large path on the same values:

* all-reduce, ordered: the rows decoded and summed in ascending rank order in fp32, times the
  scale (``decode_sum``), rounded to the tensor's dtype once;
* all-reduce and reduce-scatter, exact: ``exact_sum`` over the rows (blocks start at multiples of
  the exact block, as the large path's shards and chunks do, so the same integers);
* reduce-scatter: the same sums over this rank's shard of every row.

The results are the large path's bits (tests/test_small_path.py: fp32/bf16/fp16, odd sizes, zeros,
inf/NaN, both modes, 2 and 3 ranks). Which calls take it is decided only from fields every rank's
header carries (numel, dtype, codec, mode, device) and the group size, so ranks that would choose
differently disagree on a field, and raise. Codecs: the cast codecs (fp32, bf16, fp16); for an
all-reduce only fp32 or the data's own dtype (no re-encoding of the sum). CPU data only.

Error feedback (a residual, with a cast codec): the client residual is added into the payload as the
large path's encoding does. An all-reduce first folds its server residual into the client one (as the
large path does for a lossless codec) and keeps what rounding the sum to the tensor's dtype dropped
in the server residual of the shard this rank owns on the large path, so nothing is lost and every
rank holds the same bits; the result then may differ from the large path's by that residual's order.
A call whose check fails gives the residual back as it was.
"""
from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Callable, List, Optional, Sequence, Union, cast

import torch

from . import groups, header, p2p, worker
from .args import Call
from .labels import label
from .layout import CommStats
from .spec import CallSpec
from ..ops.codecs import decode_sum, encode
from ..ops.sums import exact_sum

__all__ = ["Posted", "PostedHandle", "all_reduce", "all_reduce_parts", "fits_all_reduce", "fits_reduce_scatter",
           "in_slot", "payload_bytes", "reduce_scatter", "rounding_into", "run"]


def rounding_into(total: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out = total - dtype(total)`` (exact in fp32), 0 where the rounding overflows (an inf
    output is the overflow's signal; the residual stays finite)."""
    torch.sub(total, total.to(dtype).float(), out=out)
    out.masked_fill_(~torch.isfinite(out), 0.0)


def payload_bytes(a: Call, mode: str, numel: int) -> int:
    """Bytes of the slot payload: the values themselves in exact mode, else the codec's payload."""
    return numel * a.src.element_size() if mode == "exact" else a.codec.wire_bytes(numel)


def _fits(group, a: Call, mode: str) -> bool:
    if a.src.device.type != "cpu" or not groups.exchanges(group):
        return False
    if mode != "exact" and not a.codec.cast:
        return False
    return a.world * payload_bytes(a, mode, a.src.numel()) <= GATHER_TABLE_BYTES


def in_slot(group, a: Call, mode: str) -> bool:
    """The payload fits the header row's slot: one exchange (else two: the header, then the payload)."""
    return payload_bytes(a, mode, a.src.numel()) <= header.slot_of(group)


def fits_all_reduce(group, a: Call, mode: str) -> bool:
    """Whether an all-reduce with these (checked) arguments takes the one-exchange path."""
    return _fits(group, a, mode) and (mode == "exact" or a.codec.lossless or a.codec.dtype == a.src.dtype)


def fits_reduce_scatter(group, a: Call, mode: str) -> bool:
    """Whether a reduce-scatter with these (checked) arguments takes the one-exchange path."""
    return _fits(group, a, mode)


# Up to this many bytes in all (every rank's payload) a call gathers the payloads and reduces them
# locally (two exchanges) rather than taking the large path (three, on point-to-point transfers).
GATHER_TABLE_BYTES = 4 << 20


# The last calls' headers, kept a little past their end: gloo's thread drops its reference to a
# finished exchange's tensors under its queue lock, and if that is the last one it must take the
# GIL there, stalling the next call's enqueue behind a thread switch (measured: ms on a loaded box).
_RECENT: "collections.deque" = collections.deque(maxlen=8)


class Posted:
    """A small call whose one exchange (its call header, with the payload) is in flight.
    :meth:`finish` waits for it (bounded by the group's timeout), checks the table and writes the
    result, once, on whichever thread gets there first (the caller's ``wait()``, or the callback
    of :meth:`future`)."""

    def __init__(self, group, a: Call, payload: torch.Tensor, result: Callable[[torch.Tensor], None],
                 stats: Optional[CommStats], what: str = "a small collective",
                 undo: Optional[Callable[[], None]] = None):
        self.t0, self.what, self.undo = time.perf_counter(), what, undo
        self.header = header.CallHeader(group, a.fields, torch.device("cpu"), payload=payload)
        _RECENT.append((self.header.mine, self.header.table))  # see _RECENT (the tensors only: not the group)
        self.nbytes, self.world, self.result, self.stats = payload.numel(), a.world, result, stats
        self.lock = threading.Lock()
        self.done = False
        self.error: Optional[BaseException] = None

    def finish(self, timeout: Optional[datetime.timedelta] = None) -> None:
        """From a waiting thread: wait for the exchange (``timeout``, else the group's own), then
        check the table and write the result once; raise the call's error. Past ``timeout`` with
        the exchange still in flight: ``TimeoutError`` (wait again)."""
        if not self.done:
            try:
                self.header.work.wait(timeout) if timeout else self.header.work.wait()
            except Exception as e:  # noqa: BLE001 - the exchange's error is raised by _settle
                if not self.header.work.is_completed():
                    within = f"{timeout.total_seconds()} s" if timeout else "the group's timeout"
                    raise TimeoutError(f"flatcomm: {self.what} did not finish within {within} "
                                       f"(still in flight; the group's own timeout fails it if a peer never "
                                       f"joins)") from e
            else:
                self.settle(None, waited=True)
                return
        self.settle(None)

    def settle(self, future: Optional[torch.futures.Future], waited: bool = False) -> None:
        """Check and write the result of the completed exchange, once (``future``: the exchange's,
        from its callback, where waiting on the work itself would deadlock: gloo completes a work
        only after its future's callbacks ran; ``waited``: the work's wait() just returned)."""
        with self.lock:
            if not self.done:
                try:
                    if future is not None:
                        future.value()  # raises the exchange's error
                    elif not waited:
                        self.header.work.wait()  # completed: returns, or raises its error, at once
                    self._complete()
                except BaseException as e:  # noqa: BLE001 - every waiter raises it
                    self.error = e
                    if self.undo is not None:  # a residual the payload took, given back
                        self.undo()
                self.done = True
        if self.error is not None:
            raise self.error

    def _complete(self) -> None:
        err = self.header.error()
        if err is not None:
            raise err
        t1 = time.perf_counter()
        self.result(self.header.payloads(self.nbytes))
        if self.stats is not None:
            self.stats.calls += 1
            self.stats.wire_bytes += self.nbytes * (self.world - 1)
            self.stats.exchange_s += t1 - self.t0
            self.stats.decode_s += time.perf_counter() - t1


class PostedHandle(worker.Handle):
    """The :class:`flatcomm.comm.worker.Handle` of a posted small call (every method overridden:
    there is no worker future behind it)."""

    def __init__(self, posted: Posted, value: torch.Tensor):  # noqa: super().__init__ not called (see above)
        self._posted, self._value = posted, value
        self._future: Optional[torch.futures.Future] = None

    def wait(self, timeout: Union[None, float, datetime.timedelta] = None) -> torch.Tensor:
        """As :meth:`flatcomm.comm.worker.Handle.wait` (``timeout``: seconds, a timedelta, or None
        for the group's own)."""
        limit: Optional[datetime.timedelta] = None
        if isinstance(timeout, datetime.timedelta):
            limit = timeout if timeout.total_seconds() > 0 else None
        elif timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"flatcomm: Handle.wait timeout must be seconds > 0, a timedelta or None, "
                                 f"got {timeout!r}")
            limit = datetime.timedelta(seconds=float(timeout))
        self._posted.finish(limit)
        return self._value

    def cancel(self) -> bool:
        return False  # already posted

    def is_completed(self) -> bool:
        if not self._posted.done and self._posted.header.work.is_completed():
            try:  # its exchange is done: the result is a local step away, take it
                self._posted.finish()
            except Exception:  # noqa: BLE001 - kept for exception()
                pass
        return self._posted.done

    def is_success(self) -> bool:
        return self.is_completed() and self._posted.error is None

    def exception(self) -> Optional[BaseException]:
        return self._posted.error if self.is_completed() else None

    def result(self) -> List[torch.Tensor]:
        return [self.wait()]

    def get_future(self) -> torch.futures.Future:
        """Completed with the output once the result is written; failed (in C++, so that a C++
        waiter such as DDP's reducer rethrows it) with the call's error."""
        if self._future is None:
            def written(fut):
                self._posted.settle(fut)
                return self._value
            self._future = self._posted.header.work.get_future().then(written)
        return self._future


def _gathered(group, a: Call, payload: Callable[[], torch.Tensor], result: Callable[[torch.Tensor], None],
              stats: Optional[CommStats]) -> None:
    """A call whose payload is over the slot (on the group's worker): the header first, checked,
    then one all-gather of the payloads (equal sizes: the header agreed on them), reduced here."""
    t0 = time.perf_counter()
    h = header.CallHeader(group, a.fields, torch.device("cpu"))
    try:
        h.finish()
    except BaseException:
        p2p.drain([h.work])
        raise
    data = payload()  # after the check: a residual it takes is never lost to a failed call
    rows = torch.empty(a.world, data.numel(), dtype=torch.uint8)
    rows[a.rank].copy_(data)
    # Point-to-point, not gloo's all-gather: on 2 ranks a 1 MB swap costs 0.97 ms against 1.89.
    p2p.all_gather(group, data, list(rows), tag=1).wait()
    t1 = time.perf_counter()
    result(rows)
    if stats is not None:
        stats.calls += 1
        stats.wire_bytes += data.numel() * (a.world - 1)
        stats.exchange_s += t1 - t0
        stats.decode_s += time.perf_counter() - t1


def run(group, a: Call, slot: bool, parts: tuple, spec: CallSpec, keep: Sequence[Optional[torch.Tensor]],
        what: str, value: torch.Tensor) -> Optional[worker.Handle]:
    """Run the call: in the slot (``slot``: :func:`in_slot`), posted from the caller's thread when
    the group's worker is idle (no thread hop; the result is written by ``wait()``), else queued on
    the worker in order; over the slot, on the worker (:func:`_gathered`). ``parts``: (payload,
    result, undo) functions; ``value``: what the handle returns (the caller's output tensor)."""
    key = worker.key_of(group)
    payload, result, undo = parts
    stats = cast(Optional[CommStats], spec.stats)  # (a one-hop call's: checked by the argument layer)
    if not slot:
        return worker.run(key, lambda: _gathered(group, a, payload, result, stats), value, spec.async_op, keep,
                          what, group)

    def post() -> Posted:
        return Posted(group, a, payload(), result, stats, what, undo)

    with label("flatcomm." + what.split(" ", 1)[0]):
        posted = worker.post_if_idle(key, post, track=True) if not worker.is_on(key) else None
        if posted is None:
            return worker.run(key, lambda: post().finish(), value, spec.async_op, keep, what, group)
        if not spec.async_op:
            posted.finish()
            return None
    return PostedHandle(posted, value)


def _exact(rows: torch.Tensor, a: Call, dtype: torch.dtype, out: torch.Tensor) -> None:
    val = exact_sum(rows.view(dtype).contiguous(), a.exact_block, a.headroom)
    if a.scale != 1.0:
        val = val * a.scale
    out.copy_(val)


def all_reduce_parts(a: Call, mode: str, flat: torch.Tensor) -> tuple:
    """(payload, result, undo) of an all-reduce of ``flat`` (1-D) with the checked arguments ``a``."""
    c, n, fb = a.codec, flat.numel(), a.feedback
    saved: List[torch.Tensor] = []

    def payload() -> torch.Tensor:
        if mode == "exact":
            return flat.view(torch.uint8)
        if fb is not None:  # the server residual goes out with this payload (see the docstring)
            saved[:] = [fb.client.clone(), fb.server.clone()]
            fb.client.add_(fb.server, alpha=1.0 / a.scale)
            fb.server.zero_()
        return encode(flat, c, residual=fb.client if fb is not None else None)

    def undo() -> None:
        if fb is not None and saved:
            fb.client.copy_(saved[0])
            fb.server.copy_(saved[1])

    def result(rows: torch.Tensor) -> None:
        if mode == "exact":
            _exact(rows, a, flat.dtype, flat)
        elif flat.dtype == torch.float32 and fb is None:
            decode_sum(rows, c, n, scale=a.scale, out=flat)
        else:
            total = decode_sum(rows, c, n, scale=a.scale)
            if fb is not None and flat.dtype != torch.float32:  # what the rounding drops stays with the shard's owner
                assert a.plan is not None  # (an all-reduce's Call has its plan)
                lo, hi = a.plan.bounds[a.rank], a.plan.bounds[a.rank + 1]
                rounding_into(total[lo:hi], flat.dtype, fb.server[lo:hi])
            flat.copy_(total)

    return payload, result, undo


def all_reduce(group, a: Call, spec: CallSpec, value: torch.Tensor, slot: bool) -> Optional[worker.Handle]:
    """An all-reduce that :func:`fits_all_reduce` (``value``: the caller's tensor), in the header's
    slot or (not ``slot``: the gathered route) in an all-gather after it."""
    flat, fb = a.src, a.feedback
    keep = (flat,) if fb is None else (flat, fb.client, fb.server)
    return run(group, a, slot, all_reduce_parts(a, spec.mode, flat), spec, keep,
               f"all_reduce of {flat.numel()} values ({a.codec.name})", value)


def reduce_scatter(group, a: Call, spec: CallSpec, value: torch.Tensor) -> Optional[worker.Handle]:
    """A reduce-scatter that :func:`fits_reduce_scatter`: rank r sums every row's shard r."""
    src, out, c, m, mode = a.src, a.out, a.codec, a.out.numel(), spec.mode

    r = a.residual
    saved: List[torch.Tensor] = []

    def payload() -> torch.Tensor:
        if mode == "exact":
            return src.view(torch.uint8)
        saved[:] = [r.clone()] if r is not None else []
        return encode(src, c, residual=r)

    def undo() -> None:
        if r is not None and saved:
            r.copy_(saved[0])

    def result(rows: torch.Tensor) -> None:
        if mode == "exact":
            size = m * src.element_size()
            _exact(rows[:, a.rank * size:(a.rank + 1) * size], a, src.dtype, out)
            return
        assert c.dtype is not None  # (a cast codec)
        size = m * c.dtype.itemsize  # a cast codec's payload: the values, then zero padding
        shard = torch.zeros(a.world, c.wire_bytes(m), dtype=torch.uint8)
        shard[:, :size] = rows[:, a.rank * size:(a.rank + 1) * size]
        if out.dtype == torch.float32:
            decode_sum(shard, c, m, scale=a.scale, out=out)
        else:
            out.copy_(decode_sum(shard, c, m, scale=a.scale))

    return run(group, a, in_slot(group, a, mode), (payload, result, undo), spec, (src, out, r),
               f"reduce_scatter of {src.numel()} values ({c.name})", value)
