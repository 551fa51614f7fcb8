"""Deterministic and compressed collectives over torch.distributed (gloo on CPU, NCCL on GPU).

Reduce-scatter is one hop: every rank encodes the piece of its input destined to each peer, one
``all_to_all_single`` moves the payloads, and one fused kernel decodes them and accumulates in fp32
in ascending *source rank* order, so every rank and every run computes the same bits whatever the
backend's algorithm or the arrival order. All-reduce is that reduce-scatter plus an all-gather; with
a lossy codec the reduced shard is re-encoded with a second, per-shard residual (server-side error
feedback) and every rank, the owner included, uses the decoded shard, so all ranks hold equal bits.

``mode="exact"`` agrees per-block exponents with a MAX all-reduce, sends the values themselves, and
the receiving rank turns every row into int64 fixed point on those exponents and sums integers
(associative): the result does not depend on the order or grouping of contributions, so permuting
which rank holds which input gives the same bits. (The conversion happens at the receiver so that
the wire carries 4 bytes per fp32 value, not the 8 of the integers; same integers, same bits.)

Large inputs are split into chunks: the exchange of chunk j+1 is in flight while chunk j is decoded.

**Groups and headers.** Each call runs on flatcomm's private copy of the named group
(:mod:`flatcomm._groups`: the caller's own collectives never interleave with flatcomm's; the
parent's timeout) and first all-gathers a fixed-size header per rank (:mod:`flatcomm._header`): the
call's fields, its number on the group and, for a rank whose arguments were rejected, the reason.
Every rank checks the same table before any payload moves, so mismatches raise on every rank (also
with ``validate=False``, kept for compatibility) and argument errors keep the group in step.

**CUDA streams** (:mod:`flatcomm._streams`; untested on a GPU so far). With CUDA tensors a call
records an event on the caller's current stream at submission; the group's worker runs the
collective's kernels on a side stream per (group, device) that waits on that event, and NCCL
issues each exchange on its own stream after waiting for the side stream, so the worker only
enqueues: no host synchronisation (the call header, below, travels on the group's CPU backend; on an
NCCL-only group it is read back from the GPU, so it runs there only with ``validate=True``, which
the DDP hook passes once per bucket layout). A synchronous call returns once
the work is enqueued, with the caller's current stream made to wait for it; ``Handle.wait()`` does
the same; ``Handle.get_future()`` is a CUDA-aware ``torch.futures.Future`` whose ``wait()`` makes the
consumer's current stream wait (DDP's reducer does that). ``CommStats`` times are host times, i.e.
of enqueueing the work on CUDA (``exchange_s`` is then about 0). CPU tensors take none of this.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import math
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _groups, _header, _streams
from .codecs import BLOCKWISE, CODECS, Codec, CodecLike, resolve
from .codecs import decode as _decode
from .codecs import decode_sum as _decode_sum
from .codecs import encode as _encode
from .sums import DEFAULT_EXACT_BLOCK, DEFAULT_HEADROOM, exact_exponents, from_exact, to_exact

__all__ = [
    "CommStats", "ErrorFeedback", "Handle", "MODES", "OpLike", "all_gather", "all_reduce", "private_group",
    "reduce_scatter", "shard_bounds"
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OpLike = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]
MODES = ("ordered", "exact")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The automatic chunk count aims at about CHUNK_TARGET_BYTES of payload per shard and chunk, and
# pipelines (at least 2 chunks) from MIN_PIPELINE_BYTES on. Measured on 2 ranks, 24M values with
# error feedback: on a 1 Gbit/s link chunking halves the all-reduce (int8 426 -> 223 ms at 16
# chunks, int4 236 -> 114, sign 96 -> 55 at 2), on loopback 2-4 chunks are best and 12 cost ~8%.
CHUNK_TARGET_BYTES = 1 << 20
MIN_PIPELINE_BYTES = 512 << 10
MAX_AUTO_CHUNKS = 16
GATHER_PIECE_BYTES = 8 << 20
# Tests only: exchange through torch.distributed even with one rank (normally a local copy), so a
# one-GPU machine runs the NCCL calls and their stream hand-offs (benchmarks/gpu_check.py).
_EXCHANGE_ALONE = False


def all_reduce(
    tensor: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    op: OpLike = "avg",
    mode: str = "ordered",
    group=None,
    async_op: bool = False,
    residual: Optional[ErrorFeedback] = None,
    chunks: Optional[int] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    exact_block: int = DEFAULT_EXACT_BLOCK,
    headroom: int = DEFAULT_HEADROOM,
    tuner=None,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """All-reduce ``tensor`` in place: reduce-scatter, then all-gather of the reduced shards.

    Every rank ends with the same bits. ``residual`` (an :class:`ErrorFeedback` of the tensor's
    numel) makes a lossy codec lose nothing over time: client and server residuals carry what a
    step did not send into the next. ``codec="auto"``: ``tuner`` (default one per group) picks the
    codec and chunks per numel, the same on every rank (``Handle.decision``); a residual works
    with any choice (an fp32 choice adds the client residual once and zeroes it).
    ``topology`` (a :class:`flatcomm.Topology`): reduce inside the node with ``intra_codec``,
    exchange ``codec`` across nodes (``residual``: that tier's, see :mod:`flatcomm.hierarchical`).
    A plain Tensor as ``residual`` raises ``TypeError``: an all-reduce has two residuals.
    """
    _two_stage_residual(residual, topology)
    decision = None
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            decision = _tiered_auto(codec, mode, tuner, tensor, topology, residual)
            if decision is None or decision.path == "hierarchical":
                if decision is not None:  # and its pipeline segments (unless the caller gave some)
                    codec, intra_codec, chunks = decision.codec, decision.intra_codec, chunks or decision.chunks
                return _with_decision(_two_level.all_reduce(
                    tensor, topology, codec=codec, intra_codec=intra_codec, op=op, mode=mode,
                    async_op=async_op, residual=residual, chunks=chunks, stats=stats, validate=validate,
                    exact_block=exact_block, headroom=headroom, tuner=tuner), decision)
            codec = decision.codec  # the flat path was predicted faster on this topology
    group = private_group(group)
    try:
        if decision is None:
            codec, chunks, decision = _resolve_auto(codec, chunks, tuner, tensor.numel(), group, tensor.device,
                                                    mode, "all_reduce")
        c, world, rank, scale = _setup(group, codec, mode, op)
        flat = _flat(tensor, "tensor")
        c = _alone(c, world, flat.dtype)
        n = flat.numel()
        if residual is not None:
            _check_residual(residual.client, n, flat, "residual.client")
            _check_residual(residual.server, n, flat, "residual.server")
        align = _align_of(c, mode, exact_block)
        nchunks = chunks or _default_chunks(max(1, n // world), c, world, mode, flat.dtype)
        plan = _plan(shard_bounds(n, world, align), nchunks, align, rank)
        fields = _signature(3, n, c, mode, scale, flat.dtype, nchunks, _exact_fields(mode, exact_block, headroom))
    except (ValueError, TypeError) as e:
        _fail_in_step(group, 3, e)
        raise

    def body():
        pipe = _Pipeline(group, stats, fields, flat.device, validate)
        if stats is not None:
            stats.calls += 1
        if mode == "exact":
            _exact_all_reduce(pipe, flat, plan, nchunks, scale, exact_block, headroom)
        else:
            _ordered_all_reduce(pipe, flat, plan, nchunks, c, scale, residual)
        pipe.release()

    keep = (flat,) if residual is None else (flat, residual.client, residual.server)
    return _with_decision(_run(body, tensor, group, async_op, keep, f"all_reduce of {n} values ({c.name})"),
                          decision)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    op: OpLike = "avg",
    mode: str = "ordered",
    group=None,
    async_op: bool = False,
    residual: Union[None, torch.Tensor, ErrorFeedback] = None,
    chunks: Optional[int] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    exact_block: int = DEFAULT_EXACT_BLOCK,
    headroom: int = DEFAULT_HEADROOM,
    tuner=None,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """Reduce ``input`` (world x ``output.numel()`` values) across ranks; rank r gets shard r.

    ``residual`` (fp32, input's numel) turns on error feedback for a lossy ``codec``.
    ``codec="auto"``: ``tuner`` (a :class:`flatcomm.autotune.Tuner`, default one per group) picks
    the codec and chunks per input size, the same on every rank (``Handle.decision``).
    ``topology`` (a :class:`flatcomm.Topology`): two levels, see :mod:`flatcomm.hierarchical`.
    ``residual`` may also be an :class:`ErrorFeedback` (its ``client`` is used).
    """
    residual = _one_stage_residual(residual, "reduce_scatter's")
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            return _two_level.reduce_scatter(
                output, input, topology, codec=codec, intra_codec=intra_codec, op=op, mode=mode,
                async_op=async_op, residual=residual, chunks=chunks, stats=stats, validate=validate,
                exact_block=exact_block, headroom=headroom, tuner=tuner)
    group = private_group(group)
    try:
        codec, chunks, decision = _resolve_auto(codec, chunks, tuner, input.numel(), group, input.device,
                                                mode, "reduce_scatter")
        c, world, rank, scale = _setup(group, codec, mode, op)
        src, out = _flat(input, "input"), _flat(output, "output")
        c = _alone(c, world, src.dtype)
        if src.numel() != world * out.numel():
            raise ValueError(f"flatcomm: reduce_scatter input has {src.numel()} values; it must be "
                             f"world size ({world}) x output ({out.numel()})")
        if out.device != src.device:
            raise ValueError(f"flatcomm: output is on {out.device} but input on {src.device}")
        _check_residual(residual, src.numel(), src, "residual")
        align = _align_of(c, mode, exact_block)
        nchunks = chunks or _default_chunks(out.numel(), c, world, mode, src.dtype, "reduce_scatter")
        bounds = [r * out.numel() for r in range(world + 1)]
        plan = _plan(bounds, nchunks, align, rank)
        fields = _signature(1, src.numel(), c, mode, scale, src.dtype, nchunks,
                            _exact_fields(mode, exact_block, headroom))
    except (ValueError, TypeError) as e:
        _fail_in_step(group, 1, e)
        raise

    def body():
        pipe = _Pipeline(group, stats, fields, src.device, validate)
        if stats is not None:
            stats.calls += 1
        if mode == "exact":
            _exact_reduce_scatter(pipe, src, out, plan, nchunks, scale, exact_block, headroom)
        else:
            _ordered_reduce_scatter(pipe, src, out, plan, nchunks, c, scale, residual)
        pipe.release()

    return _with_decision(_run(body, output, group, async_op, (src, out, residual),
                               f"reduce_scatter of {src.numel()} values ({c.name})"), decision)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    codec: CodecLike = "fp32",
    group=None,
    async_op: bool = False,
    residual: Union[None, torch.Tensor, ErrorFeedback] = None,
    stats: Optional[CommStats] = None,
    validate: bool = True,
    topology=None,
    intra_codec: CodecLike = "fp32",
) -> Optional[Handle]:
    """Gather every rank's ``input`` into ``output`` (world x input numel), in rank order.

    With a lossy ``codec`` each rank's input is sent encoded (``residual`` keeps what was not
    sent) and every rank, the sender included, receives the decoded values.
    ``topology`` (a :class:`flatcomm.Topology`): two levels, see :mod:`flatcomm.hierarchical`.
    ``residual`` may also be an :class:`ErrorFeedback` (its ``client`` is used).
    """
    residual = _one_stage_residual(residual, "all_gather's")
    if topology is not None:
        group = _topology_group(topology, group)
        if not topology.flat:
            return _two_level.all_gather(output, input, topology, codec=codec, intra_codec=intra_codec,
                                           async_op=async_op, residual=residual, stats=stats,
                                           validate=validate)
    group = private_group(group)
    try:
        c = resolve(codec)
        world = dist.get_world_size(group)
        src, out = _flat(input, "input"), _flat(output, "output")
        n = src.numel()
        if out.numel() != world * n:
            raise ValueError(f"flatcomm: all_gather output has {out.numel()} values; it must be "
                             f"world size ({world}) x input ({n})")
        _check_residual(residual, n, src, "residual")
        fields = _signature(2, n, c, "ordered", 1.0, src.dtype, 1)
    except (ValueError, TypeError) as e:
        _fail_in_step(group, 2, e)
        raise

    def body():
        pipe = _Pipeline(group, stats, fields, src.device, validate)
        if stats is not None:
            stats.calls += 1
        payload = pipe.empty(c.wire_bytes(n), torch.uint8, src.device)
        if residual is not None:  # as in _encode_pieces
            pipe.checked()
        pipe.timed("encode_s", lambda: _encode(src, c, residual=residual, out=payload))
        work, recv = pipe.all_gather(payload, world)
        pipe.wait(work)
        rows = recv.view(world, -1)

        def dec():
            for d in range(world):
                _decode(rows[d], c, n, out=out[d * n:(d + 1) * n])

        pipe.timed("decode_s", dec)
        pipe.release()

    return _run(body, output, group, async_op, (src, out, residual), f"all_gather of {n} values ({c.name})")


@dataclasses.dataclass
class ErrorFeedback:
    """Residuals for a lossy all-reduce of one flat tensor of ``numel`` values.

    ``client`` holds what this rank's first-stage encoding did not send; ``server`` (full size too,
    each rank uses the range of the shard it reduces) what the re-encoding of its reduced shard did
    not send. Both are fp32. Nothing is dropped: it is sent on a later step.
    """

    client: torch.Tensor
    server: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, device: Optional[torch.device] = None) -> "ErrorFeedback":
        return cls(torch.zeros(numel, device=device), torch.zeros(numel, device=device))


@dataclasses.dataclass
class CommStats:
    """Counters a collective adds to (pass one in, read it after). The times are host seconds:
    with CUDA tensors, of enqueueing the work (the GPU runs it later; ``exchange_s`` is ~0)."""

    calls: int = 0
    wire_bytes: int = 0  # bytes this rank put on the wire
    encode_s: float = 0.0
    exchange_s: float = 0.0  # time spent waiting for the network
    decode_s: float = 0.0

    def add(self, other: "CommStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Handle:
    """Result of ``async_op=True``: ``wait()`` blocks (and re-raises errors), ``get_future()``
    gives a ``torch.futures.Future`` completed with the output tensor (CUDA-aware for CUDA
    tensors: see the module docstring). ``decision``: what ``codec="auto"`` chose (a
    :class:`flatcomm.autotune.Decision`), else None."""

    decision = None

    def __init__(self, future: "concurrent.futures.Future", value: torch.Tensor,
                 streams: Optional[_streams.CallStreams] = None, what: str = "collective", group=None):
        self._cf = future
        self._what = what  # for the timeout message
        self._group = group
        self._value = value
        self._streams = streams  # CUDA only: the future is CUDA-aware (see the module docstring)
        self._torch_future: torch.futures.Future = (
            torch.futures.Future() if streams is None else streams.future())
        future.add_done_callback(self._complete)

    def _complete(self, cf: "concurrent.futures.Future") -> None:
        exc = cf.exception()
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
        except concurrent.futures.TimeoutError:
            if self._cf.done():  # the collective itself raised a TimeoutError: keep it
                raise
            t = _groups.group_timeout(self._group)
            raise TimeoutError(
                f"flatcomm: {self._what} did not finish within {timeout} s (still in flight; "
                f"the group's own timeout{f' of {t}' if t is not None else ''} fails it if a peer never joins)"
            ) from None
        if self._streams is not None:
            self._streams.join_current()
        return self._value

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


def shard_bounds(numel: int, world: int, align: int = 1) -> List[int]:
    """Boundaries of ``world`` contiguous shards of ``numel`` values, starting on multiples of
    ``align`` (so codec blocks and exact-mode blocks line up with the global tensor)."""
    units = math.ceil(numel / align) if numel else 0
    per, extra = divmod(units, world)
    bounds = [0]
    for r in range(world):
        bounds.append(min(numel, bounds[-1] + (per + (1 if r < extra else 0)) * align))
    return bounds


# One worker thread per process group runs every collective, synchronous ones included, in
# submission order, so every rank issues its collectives (consistency check and chunk exchanges)
# in the same order: a check issued from the caller's thread while an earlier asynchronous
# collective is still exchanging chunks on the worker could pair with a different collective on a
# peer (gloo matches collectives by issue order) and hang. Nothing blocks inside a future callback.
_executors: dict = {}
_executors_lock = threading.Lock()
_worker = _groups.on_worker  # .key: the group key of the worker thread we are on, if any
private_group = _groups.private_group
group_timeout = _groups.group_timeout


def _group_key(group):
    return id(group) if group is not None else None


def _executor(group) -> concurrent.futures.ThreadPoolExecutor:
    key = _group_key(group)
    with _executors_lock:
        ex = _executors.get(key)
        if ex is None:
            ex = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="flatcomm", initializer=_mark_worker, initargs=(key,))
            _executors[key] = ex
        return ex


def _mark_worker(key) -> None:
    _worker.key = key
    _worker.active = True


def _on_worker(fn: Callable[[], None], streams: Optional[_streams.CallStreams],
               keep: Sequence[Optional[torch.Tensor]] = ()) -> Callable[[], None]:
    """fn, run on the side stream when ``streams`` (CUDA) is given."""
    if streams is None:
        return fn

    def on_side():
        with streams.side(keep):
            fn()

    return on_side


def _submit(group, device: torch.device, fn: Callable[[], None]) -> "concurrent.futures.Future":
    """Queue ``fn`` (no collective) on the group's worker, on the side stream for CUDA tensors
    (the DDP hook's norms, which read the bucket before the all-reduce rewrites it)."""
    return _executor(group).submit(_on_worker(fn, _streams.for_call(_group_key(group), device)))


def _run(fn: Callable[[], None], value: torch.Tensor, group, async_op: bool,
         keep: Sequence[Optional[torch.Tensor]] = (), what: str = "collective") -> Optional[Handle]:
    """Run a collective's body on the group's worker. ``keep``: the caller's tensors it uses
    (CUDA: protected from reuse by the caching allocator while the side stream runs)."""
    grad = torch.is_grad_enabled()  # grad mode is thread-local: keep the caller's
    streams = _streams.for_call(_group_key(group), value.device)  # None unless CUDA
    inner = _on_worker(fn, streams, keep)

    def body():
        with torch.set_grad_enabled(grad):
            inner()

    if not async_op and getattr(_worker, "key", object()) == _group_key(group):
        body()  # already on this group's worker (called from a callback): run in order, inline
        if streams is not None:
            streams.join_current()
        return None
    future = _executor(group).submit(body)
    if not async_op:
        future.result()
        if streams is not None:  # the work is enqueued: order the caller's stream after it
            streams.join_current()
        return None
    return Handle(future, value, streams, what, group)


# ---- argument handling ---------------------------------------------------------------------------


def _reduce_scale(op: OpLike, world: int) -> float:
    if isinstance(op, str):
        name = op.lower()
    elif op == dist.ReduceOp.SUM:  # == (not a dict lookup): ReduceOp objects hash differently
        name = "sum"
    elif op == dist.ReduceOp.AVG:
        name = "avg"
    else:
        name = str(op)
    if name == "sum":
        return 1.0
    if name == "avg":
        return 1.0 / world
    raise ValueError(f"flatcomm: op must be 'avg' or 'sum', got {op!r}")


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype not in _DTYPES:
        raise TypeError(f"flatcomm: {what} must be float32, bfloat16 or float16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"flatcomm: {what} must be contiguous")
    return t.view(-1)


def _one_stage_residual(residual: Union[None, torch.Tensor, "ErrorFeedback"], what: str) -> Optional[torch.Tensor]:
    """The residual of a one-stage collective (reduce-scatter, all-gather): a Tensor, or an
    :class:`ErrorFeedback` whose ``client`` is used (its ``server`` has no role there)."""
    if residual is None or isinstance(residual, torch.Tensor):
        return residual
    if isinstance(residual, ErrorFeedback):
        return residual.client
    raise TypeError(f"flatcomm: {what} residual must be an fp32 Tensor or a flatcomm.ErrorFeedback, "
                    f"got {type(residual).__name__}")


def _two_stage_residual(residual: Any, topology) -> None:
    """all_reduce's residual has two parts (client and server): a plain Tensor cannot hold both."""
    if residual is None or isinstance(residual, ErrorFeedback):
        return
    if isinstance(residual, torch.Tensor):
        raise TypeError("flatcomm: all_reduce's residual is a flatcomm.ErrorFeedback (client and server "
                        "residuals, both fp32 of the tensor's numel), not a Tensor: pass "
                        "flatcomm.ErrorFeedback.zeros(tensor.numel(), tensor.device) and keep it across steps")
    if topology is None or type(residual).__name__ != "TieredFeedback":
        raise TypeError(f"flatcomm: all_reduce's residual must be a flatcomm.ErrorFeedback"
                        f"{' (or a TieredFeedback with a topology)' if topology is not None else ''}, "
                        f"got {type(residual).__name__}")


def _check_residual(r: Optional[torch.Tensor], numel: int, ref: torch.Tensor, what: str) -> None:
    if r is None:
        return
    if r.dtype != torch.float32 or not r.is_contiguous() or r.numel() != numel:
        raise ValueError(
            f"flatcomm: {what} must be a contiguous float32 tensor of {numel} values, "
            f"got {r.dtype} with {r.numel()} values"
        )
    if r.device != ref.device:
        raise ValueError(f"flatcomm: {what} is on {r.device} but the data is on {ref.device}")


def _shown(name: str, v: int):
    """A signature field's value as a user wrote it (names, not numbers) for error messages."""
    try:
        if name == "collective":
            return _header.KINDS[v]
        if name == "codec":
            return CODECS[v]
        if name == "mode":
            return MODES[v]
        if name == "dtype":
            return str(_DTYPES[v])
    except (IndexError, KeyError):
        return v
    if name == "topk ratio":
        return v / 1e6
    if name == "op scale":
        return v / 1e9
    return v


def _has_cpu_backend(group) -> bool:
    try:
        (group if group is not None else dist.group.WORLD)._get_backend(  # type: ignore[union-attr]
            torch.device("cpu"))  # no group: WORLD, which exists once torch.distributed is initialised
        return True
    except Exception:  # noqa: BLE001 - e.g. an NCCL-only group
        return False


def _exchange_table(group, mine: torch.Tensor, device: torch.device, async_op: bool):
    world = dist.get_world_size(group)
    allv = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    work = _all_gather_single(allv, mine.to(device), group=group, async_op=async_op)
    return work, allv.view(world, -1)


def _check_consistent(group, fields: Sequence[Tuple[str, int]], device: torch.device) -> None:
    """One tiny all-gather of ``fields`` so that mismatched calls fail on every rank with a clear
    message instead of hanging or exchanging garbage (used where no call header runs, e.g. by
    :mod:`flatcomm.reproducible`)."""
    world = dist.get_world_size(group)
    if world == 1 and not _EXCHANGE_ALONE:
        return
    _, table = _exchange_table(group, _header.row(0, False, fields, len(fields)), device, False)
    problems = _header.check(table, fields, _shown)
    if problems:
        raise ValueError("flatcomm: " + "; ".join(problems))


# Every call on a group first all-gathers one fixed-size header per rank (see flatcomm/_header.py):
# its fields, in this order (a failed call sends only the first and zeros).
_FIELDS = ("collective", "numel", "codec", "block_size", "topk ratio", "mode", "op scale", "dtype",
           "chunks", "exact_block", "headroom")
_calls: dict = {}  # group key -> number of the next call on that group (advanced on its worker, in order)


class _CallHeader:
    """The header exchange of one call, started at once and checked before the first payload
    byte moves (:meth:`_Pipeline.checked`)."""

    def __init__(self, group, fields: Sequence[Tuple[str, int]], device: torch.device,
                 reason: Optional[str] = None):
        key = _group_key(group)
        self.call = _calls.get(key, 0)
        _calls[key] = self.call + 1
        self.group, self.fields = group, list(fields)
        mine = _header.row(self.call, reason is not None, fields, len(_FIELDS), reason or "")
        self.work, self.table = _exchange_table(group, mine, device, True)

    def finish(self) -> None:
        self.work.wait()
        names = [(n, 0) for n in _FIELDS]
        problems = _header.check(self.table, names, _shown)
        if not problems:
            return
        if problems[0].startswith("ranks are out of step"):
            # Every rank saw the same table: resume numbering together, so that the next calls
            # (if the ranks' programs agree again) are in step.
            _calls[_group_key(self.group)] = max(_header.call_numbers(self.table.cpu())) + 1
            raise RuntimeError("flatcomm: " + problems[0])
        raise ValueError("flatcomm: " + "; ".join(problems))


def _header_device(group, device: torch.device, validate: bool) -> Optional[torch.device]:
    """Where the header travels: on the CPU when the group has a CPU backend (no host sync for
    CUDA data); on an NCCL-only group on the data's device, which reads it back on the host, so
    only with ``validate=True`` there."""
    if device.type == "cpu" or _has_cpu_backend(group):
        return torch.device("cpu")
    return device if validate else None


def _fail_in_step(group, kind: int, err: BaseException) -> None:
    """A rank whose arguments were rejected still takes part in the call's header exchange (status
    failed, the reason), so its peers raise "rank r failed: ..." instead of waiting, and every
    rank's next call pairs with the peers' next call. Not waited for: the caller raises at once."""
    try:
        if dist.get_world_size(group) == 1 and not _EXCHANGE_ALONE:
            return
        device = torch.device("cpu") if _has_cpu_backend(group) else torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no usable group: nothing to keep in step
        return
    reason = f"{type(err).__name__}: {str(err).removeprefix('flatcomm: ')}"

    def body():
        _CallHeader(group, [("collective", kind)], device, reason).finish()

    if getattr(_worker, "key", object()) == _group_key(group):
        try:
            body()
        except Exception:  # noqa: BLE001 - the caller's own error is the one to report
            pass
        return
    _executor(group).submit(body)


def _signature(kind: int, numel: int, codec: Codec, mode: str, scale: float, dtype: torch.dtype,
               chunks: int, extra: Sequence[Tuple[str, int]] = ()) -> List[Tuple[str, int]]:
    return [
        ("collective", kind),
        ("numel", numel),
        ("codec", CODECS.index(codec.name)),
        ("block_size", codec.block_size),
        ("topk ratio", int(round(codec.ratio * 1e6))),
        ("mode", MODES.index(mode)),
        ("op scale", int(round(scale * 1e9))),
        ("dtype", _DTYPES.index(dtype)),
        ("chunks", chunks),
    ] + list(extra)


def _exact_fields(mode: str, block: int, headroom: int) -> List[Tuple[str, int]]:
    # Ranks that disagree on the exact-mode grid would exchange exponent lists of different sizes.
    # Always the same number of fields: the check itself must move equal sizes on every rank.
    exact = mode == "exact"
    return [("exact_block", block if exact else 0), ("headroom", headroom if exact else 0)]


# ---- layout: shards across ranks, chunks within shards ------------------------------------------


def _auto_chunks(numel: int, codec: Codec, world: int, mode: str) -> int:
    wire = 4 * numel if mode == "exact" else codec.wire_bytes(numel)  # exact: the fp32 values
    if wire < MIN_PIPELINE_BYTES:
        return 1
    return int(min(MAX_AUTO_CHUNKS, max(2, round(wire / CHUNK_TARGET_BYTES))))


_RAW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sends_raw(codec: Codec, dtype: torch.dtype, mode: str) -> bool:
    """The payload of ``codec`` is the input's own bytes (fp32 codec on fp32 data, ...)."""
    return mode == "ordered" and _RAW_DTYPES.get(codec.name) == dtype


def _default_chunks(numel: int, codec: Codec, world: int, mode: str, dtype: torch.dtype,
                    kind: str = "all_reduce") -> int:
    # A reduce-scatter of raw payloads sends the caller's tensor itself (no staging copy), which
    # needs one chunk: a chunk's pieces for all destinations must be one contiguous range. Measured
    # (2 ranks, 100 MB fp32): loopback 66 ms in one chunk vs 102 ms in 16 (gloo's own: 150 ms); on
    # a 1 Gbit/s link 16 chunks win (465 vs 899 ms): pass chunks= or codec="auto" there. For the
    # all-reduce, chunks win on both (loopback 168 vs 249 ms), the gather being the slow half.
    if kind == "reduce_scatter" and _sends_raw(codec, dtype, mode):
        return 1
    return _auto_chunks(numel, codec, world, mode)


def _zero_copy(codec: Codec, dtype: torch.dtype, plan: "_Plan", chunks: int, residual) -> bool:
    """Send and receive without staging: one chunk, raw payload, no error feedback (a residual
    would change what is sent), and every piece a whole payload (16-byte multiple), so the
    received rows are valid payload rows for the fused decode-sum."""
    if chunks != 1 or residual is not None or not _sends_raw(codec, dtype, "ordered"):
        return False
    return all((plan.bounds[d + 1] - plan.bounds[d]) * dtype.itemsize % 16 == 0 for d in range(plan.world))


def _align_of(codec: Codec, mode: str, exact_block: int) -> int:
    if mode == "exact":
        return exact_block
    return codec.block_size if codec.name in BLOCKWISE else 32


@dataclasses.dataclass
class _Plan:
    world: int
    rank: int
    bounds: List[int]          # shard boundaries (world + 1)
    chunk_bounds: List[List[int]]  # per shard, chunk boundaries relative to the shard start

    def piece(self, shard: int, chunk: int) -> Tuple[int, int]:
        base = self.bounds[shard]
        cb = self.chunk_bounds[shard]
        return base + cb[chunk], base + cb[chunk + 1]


def _plan(bounds: List[int], chunks: int, align: int, rank: int) -> _Plan:
    world = len(bounds) - 1
    cbs = [shard_bounds(bounds[d + 1] - bounds[d], chunks, align) for d in range(world)]
    return _Plan(world, rank, bounds, cbs)


# ---- the pipelined core --------------------------------------------------------------------------


class _BufferPool:
    """Staging buffers reused across calls of one group. Fresh large allocations are page-faulted
    on first touch, which on CPU costs as much as the copy itself; collectives of a group run one
    at a time on its worker thread, so a buffer taken by a call is free again when the call ends.
    CUDA: the call's kernels may still be queued then, but every call of the group runs on the
    same side stream (after waiting for its NCCL work), so a later user of the buffer is ordered
    after them (see flatcomm/_streams.py)."""

    MAX_BYTES = 1 << 31

    def __init__(self):
        self.free: dict = {}
        self.bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, str(device))
        stack = self.free.get(key)
        if stack:
            t = stack.pop()
            self.bytes -= t.numel() * t.element_size()
            return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.bytes + size > self.MAX_BYTES:
            self.free.clear()
            self.bytes = 0
        self.free.setdefault((t.numel(), t.dtype, str(t.device)), []).append(t)
        self.bytes += size


_pools: dict = {}


class _Pipeline:
    """Runs one collective chunk by chunk: while chunk j is exchanged, j-1 is decoded."""

    def __init__(self, group, stats: Optional[CommStats], fields: Sequence[Tuple[str, int]],
                 device: torch.device, validate: bool = True):
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.pool = _pools.setdefault(id(group) if group is not None else None, _BufferPool())
        self.taken: List[torch.Tensor] = []
        self.header: Optional[_CallHeader] = None
        if dist.get_world_size(group) > 1 or _EXCHANGE_ALONE:
            where = _header_device(group, device, validate)
            if where is not None:
                self.header = _CallHeader(group, fields, where)

    def checked(self) -> None:
        """Wait for the call's header exchange and check it: before any payload byte is sent."""
        if self.header is not None:
            h, self.header = self.header, None
            self.timed("exchange_s", h.finish)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = self.pool.take(numel, dtype, device)
        self.taken.append(t)
        return t

    def release(self) -> None:
        """Return this call's buffers to the pool (the call's collectives have all completed)."""
        self.checked()  # a call that exchanged nothing (zero values) still checks its header
        for t in self.taken:
            self.pool.give(t)
        self.taken = []

    def timed(self, field: str, fn: Callable[[], object]):
        t0 = time.perf_counter()
        out = fn()
        setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - t0)
        return out

    def wait(self, work) -> None:
        if work is not None:
            self.timed("exchange_s", work.wait)

    def all_to_all(self, send: torch.Tensor, send_sizes: List[int], recv_row: int, world: int):
        self.checked()
        recv = self.empty(world * recv_row, send.dtype, send.device)
        self.stats.wire_bytes += (send.numel() - send_sizes[dist.get_rank(self.group)]) * send.element_size()
        if world == 1 and not _EXCHANGE_ALONE:
            recv.copy_(send)
            return None, recv
        work = dist.all_to_all_single(recv, send, [recv_row] * world, send_sizes, group=self.group,
                                      async_op=True)
        return work, recv

    def all_gather(self, send: torch.Tensor, world: int):
        self.checked()
        recv = self.empty(world * send.numel(), send.dtype, send.device)
        self.stats.wire_bytes += send.numel() * send.element_size() * (world - 1)
        if world == 1 and not _EXCHANGE_ALONE:
            recv.copy_(send)
            return None, recv
        return _all_gather_single(recv, send, group=self.group, async_op=True), recv

    def run(self, chunks: int, send: Callable, reduce: Callable, finish: Optional[Callable]) -> None:
        """send(j) -> state; reduce(j, state) -> state2; finish(j, state2). Stages overlap.

        CUDA: send(j + 1) enqueues the exchange of chunk j + 1 on NCCL's stream before reduce(j)
        makes the side stream wait for exchange j and enqueues its decode, so the GPU runs the
        exchange of j + 1 (NCCL stream) while it decodes j (side stream), with no host wait."""
        sent = {0: send(0)} if chunks else {}
        reduced = {}
        for j in range(chunks):
            if j + 1 < chunks:
                sent[j + 1] = send(j + 1)
            reduced[j] = reduce(j, sent.pop(j))
            if finish is not None and j >= 1:
                finish(j - 1, reduced.pop(j - 1))
        if finish is not None and chunks:
            finish(chunks - 1, reduced.pop(chunks - 1))


def _encode_pieces(pipe: _Pipeline, src: torch.Tensor, plan: _Plan, j: int, codec: Codec,
                   residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    if residual is not None:  # encoding updates the residual: never for a call that then fails its check
        pipe.checked()
    sizes = [codec.wire_bytes(b - a) for a, b in (plan.piece(d, j) for d in range(plan.world))]
    buf = pipe.empty(sum(sizes), torch.uint8, src.device)

    def enc():
        off = 0
        for d in range(plan.world):
            a, b = plan.piece(d, j)
            r = residual[a:b] if residual is not None else None
            _encode(src[a:b], codec, residual=r, out=buf[off:off + sizes[d]])
            off += sizes[d]

    pipe.timed("encode_s", enc)
    return buf, sizes


def _write(dst: torch.Tensor, value: torch.Tensor) -> None:
    if dst.data_ptr() != value.data_ptr():
        dst.copy_(value)


def _decode_sum_to(pipe: _Pipeline, recv: torch.Tensor, world: int, codec: Codec, n: int,
                   scale: float, dst: torch.Tensor) -> None:
    def dec():
        if dst.dtype == torch.float32:
            _decode_sum(recv.view(world, -1), codec, n, scale=scale, out=dst)
        else:
            dst.copy_(_decode_sum(recv.view(world, -1), codec, n, scale=scale))

    pipe.timed("decode_s", dec)


def _ordered_reduce_scatter(pipe: _Pipeline, src: torch.Tensor, out: torch.Tensor, plan: _Plan,
                            chunks: int, codec: Codec, scale: float,
                            residual: Optional[torch.Tensor]) -> None:
    me = plan.rank
    base = plan.bounds[me]
    if _zero_copy(codec, src.dtype, plan, chunks, residual):
        _raw_reduce(pipe, src, plan, codec, scale, out)
        return

    def send(j):
        buf, sizes = _encode_pieces(pipe, src, plan, j, codec, residual)
        a, b = plan.piece(me, j)
        return pipe.all_to_all(buf, sizes, codec.wire_bytes(b - a), plan.world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = plan.piece(me, j)
        _decode_sum_to(pipe, recv, plan.world, codec, b - a, scale, out[a - base:b - base])

    pipe.run(chunks, send, reduce, None)


def _raw_reduce(pipe: _Pipeline, src: torch.Tensor, plan: _Plan, codec: Codec, scale: float,
                dst: torch.Tensor) -> None:
    """Zero-copy one-hop reduce: ``src`` itself is the all-to-all's send buffer (its shards are
    the raw payloads, in destination order) and the received rows are summed in source-rank
    order into ``dst`` (this rank's shard)."""
    sizes = [plan.bounds[d + 1] - plan.bounds[d] for d in range(plan.world)]
    mine = sizes[plan.rank]
    work, recv = pipe.all_to_all(src, sizes, mine, plan.world)
    pipe.wait(work)
    _decode_sum_to(pipe, recv.view(torch.uint8).view(plan.world, -1), plan.world, codec, mine, scale, dst)


def _exact_exponents(pipe: _Pipeline, src: torch.Tensor, plan: _Plan, block: int) -> List[torch.Tensor]:
    """Per shard, per-block exponents agreed by every rank (MAX all-reduce)."""
    parts = [exact_exponents(src[plan.bounds[d]:plan.bounds[d + 1]], block) for d in range(plan.world)]
    sizes = [p.numel() for p in parts]
    allp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
    pipe.checked()
    if (plan.world > 1 or _EXCHANGE_ALONE) and allp.numel():
        pipe.timed("exchange_s", lambda: dist.all_reduce(allp, dist.ReduceOp.MAX, group=pipe.group))
    return list(torch.split(allp, sizes))


def _exact_reduce_scatter(pipe: _Pipeline, src: torch.Tensor, out: torch.Tensor, plan: _Plan,
                          chunks: int, scale: float, block: int, headroom: int) -> None:
    if plan.world > (1 << headroom):
        raise ValueError(f"flatcomm: exact mode with headroom {headroom} supports up to "
                         f"{1 << headroom} ranks, got {plan.world}")
    me = plan.rank
    base = plan.bounds[me]
    exps = _exact_exponents(pipe, src, plan, block)

    def chunk_exps(d, j):
        cb = plan.chunk_bounds[d]
        return exps[d][cb[j] // block: math.ceil(cb[j + 1] / block)]

    def send(j):
        def stage():
            pieces = [src[slice(*plan.piece(d, j))] for d in range(plan.world)]
            return torch.cat(pieces), [p.numel() for p in pieces]

        buf, sizes = pipe.timed("encode_s", stage)
        a, b = plan.piece(me, j)
        return pipe.all_to_all(buf, sizes, b - a, plan.world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = plan.piece(me, j)

        def dec():
            # Every sender's values on the agreed exponents, as integers (the integers the sender
            # would have made: same values, same exponents); integer addition is associative, so
            # any order gives the same sum.
            e = chunk_exps(me, j).contiguous()
            rows = recv.view(plan.world, b - a)
            acc = to_exact(rows[0], e, block, headroom)
            for r in range(1, plan.world):
                acc += to_exact(rows[r], e, block, headroom)
            val = from_exact(acc, e, block, headroom)
            if scale != 1.0:
                val = val * scale
            _write(out[a - base:b - base], val)

        pipe.timed("decode_s", dec)

    pipe.run(chunks, send, reduce, None)


# ---- public API -----------------------------------------------------------------------------------


def _topology_group(topology, group):
    """The group a flat topology runs on (the caller's ``group`` must not contradict it)."""
    def same(a, b):
        return (a if a is not None else dist.group.WORLD) is (b if b is not None else dist.group.WORLD)

    if group is not None and not same(group, topology.group):
        raise ValueError("flatcomm: pass either group= or topology= (the topology has its own group)")
    return topology.group


def _setup(group, codec: CodecLike, mode: str, op: OpLike):
    if mode not in MODES:
        raise ValueError(f"flatcomm: mode must be one of {MODES}, got {mode!r}")
    c = resolve(codec)
    if mode == "exact" and c.name != "fp32":
        raise ValueError("flatcomm: mode='exact' sums exact fixed point of the values; use codec='fp32' with it")
    world = dist.get_world_size(group)
    return c, world, dist.get_rank(group), _reduce_scale(op, world)


# codec="auto" without a tuner uses the group's default Tuner from flatcomm.autotune, a layer above
# this module (it times these collectives); autotune registers its tuner_for here when imported.
_default_tuner_for: Optional[Callable[[object], Any]] = None
# topology= runs flatcomm.hierarchical (built on this module); it registers itself here when imported.
_two_level: Any = None


def _alone(c: Codec, world: int, dtype: torch.dtype) -> Codec:
    """With one rank nothing moves, so nothing is compressed: the lossless codec of the data's
    own dtype, and the result is exact (a residual is added once and zeroed)."""
    if world != 1 or _EXCHANGE_ALONE or c.lossless:
        return c
    return resolve({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))


def _resolve_auto(codec: CodecLike, chunks: Optional[int], tuner, numel: int, group, device,
                  mode: str, kind: str):
    """``codec="auto"``: (codec, chunks, decision) from the tuner (default: one per group), the
    same on every rank; other codecs pass through with decision None."""
    if not (isinstance(codec, str) and codec == "auto"):
        return codec, chunks, None
    if mode != "ordered":
        raise ValueError("flatcomm: codec='auto' needs mode='ordered'")
    if tuner is None and _default_tuner_for is None:
        raise RuntimeError("flatcomm: codec='auto' needs flatcomm.autotune imported (`import flatcomm` does it)")
    t = tuner if tuner is not None else _default_tuner_for(group)  # type: ignore[misc]  # checked above
    d = t.choose(numel, group=group, device=device, kind=kind)
    return d.codec, chunks, d  # d.chunks is what the collective's default picks for d.codec


def _tiered_auto(codec: CodecLike, mode: str, tuner, tensor: torch.Tensor, topology, residual):
    """``codec="auto"`` with a hierarchical topology: the tuner of the topology's group picks the
    path and a codec per tier (a Decision), or None for a named codec. A ``residual`` is laid out
    for the hierarchical path (the inter tier's shard), so with one only that path competes."""
    if not (isinstance(codec, str) and codec == "auto"):
        return None
    if mode != "ordered":
        raise ValueError("flatcomm: codec='auto' needs mode='ordered'")
    if tuner is None and _default_tuner_for is None:
        raise RuntimeError("flatcomm: codec='auto' needs flatcomm.autotune imported (`import flatcomm` does it)")
    t = tuner if tuner is not None else _default_tuner_for(topology.group)  # type: ignore[misc]  # checked above
    paths = ("hierarchical",) if residual is not None else None
    return t.choose(tensor.numel(), group=topology.group, device=tensor.device, topology=topology, paths=paths)


def _with_decision(handle: Optional[Handle], decision) -> Optional[Handle]:
    if handle is not None:
        handle.decision = decision
    return handle


def _ordered_all_reduce(pipe: _Pipeline, flat: torch.Tensor, plan: _Plan, chunks: int, c: Codec,
                        scale: float, residual: Optional[ErrorFeedback]) -> None:
    me, world = plan.rank, plan.world
    client = residual.client if residual is not None else None
    server = residual.server if residual is not None and not c.lossless else None
    if residual is not None and c.lossless:
        # Nothing re-encodes the reduced shard, so a server residual left by an earlier lossy call
        # (codec="auto" switching to fp32, one rank) would never be sent: fold it into the client
        # residual (the next step adds scale * client), which this encode sends and zeroes.
        residual.client.add_(residual.server, alpha=1.0 / scale)
        residual.server.zero_()
    if _zero_copy(c, flat.dtype, plan, chunks, client):
        _raw_all_reduce(pipe, flat, plan, c, scale)
        return

    def send(j):
        buf, sizes = _encode_pieces(pipe, flat, plan, j, c, client)
        a, b = plan.piece(me, j)
        return pipe.all_to_all(buf, sizes, c.wire_bytes(b - a), world)

    def reduce(j, state):
        work, recv = state
        pipe.wait(work)
        a, b = plan.piece(me, j)
        rows = recv.view(world, -1)
        # Every rank sends a payload as large as the largest shard's for this chunk (padding),
        # because all_gather_into_tensor moves equal sizes.
        width = max(c.wire_bytes(y - x) for x, y in (plan.piece(d, j) for d in range(world)))
        send_buf = pipe.empty(width, torch.uint8, flat.device)  # padding past nbytes is never read
        nbytes = c.wire_bytes(b - a)
        r = server[a:b] if server is not None else None

        def dec():
            if c.name == "topk":  # topk re-selects on the whole reduced shard
                total = _decode_sum(rows, c, b - a, scale=scale)
                _encode(total, c, residual=r, out=send_buf[:nbytes])
            else:
                _decode_sum(rows, c, b - a, scale=scale, reencode=c, residual=r, out=send_buf[:nbytes])

        pipe.timed("decode_s", dec)
        return pipe.all_gather(send_buf, world)

    def finish(j, state):
        work, recv = state
        pipe.wait(work)
        rows = recv.view(world, -1)

        def dec():
            for d in range(world):
                a, b = plan.piece(d, j)
                if b > a:
                    _decode(rows[d, :c.wire_bytes(b - a)], c, b - a, out=flat[a:b])

        pipe.timed("decode_s", dec)

    pipe.run(chunks, send, reduce, finish)


def _raw_all_reduce(pipe: _Pipeline, flat: torch.Tensor, plan: _Plan, c: Codec, scale: float) -> None:
    """Lossless all-reduce without staging copies: the one-hop reduce reads ``flat`` directly,
    sums into the all-gather's send buffer, and the gather lands in ``flat`` (only the pieces past
    a shorter shard's end go through scratch)."""
    me, world = plan.rank, plan.world
    sizes = [plan.bounds[d + 1] - plan.bounds[d] for d in range(world)]
    width = max(sizes)
    send_buf = pipe.empty(width, flat.dtype, flat.device)  # padding past this shard is never read
    _raw_reduce(pipe, flat, plan, c, scale, send_buf[:sizes[me]])
    # The all-to-all has completed, so flat may be overwritten: gather straight into it, in pieces
    # (gloo's all-gather slows down 2-3x once one call moves more than ~32 MB).
    pipe.stats.wire_bytes += width * flat.element_size() * (world - 1)
    step = max(1, GATHER_PIECE_BYTES // (world * flat.element_size()))
    for off in range(0, width, step):
        m = min(step, width - off)
        outs, tails = [], []
        for d in range(world):
            a = plan.bounds[d] + off
            keep = max(0, min(m, sizes[d] - off))
            if keep == m:
                outs.append(flat[a:a + m])
            else:  # this rank's shard ends inside the piece: land in scratch, keep its prefix
                scratch = pipe.empty(m, flat.dtype, flat.device)
                outs.append(scratch)
                tails.append((flat[a:a + keep], scratch[:keep]))
        if world == 1 and not _EXCHANGE_ALONE:
            outs[0].copy_(send_buf[off:off + m])
        else:
            pipe.wait(dist.all_gather(outs, send_buf[off:off + m], group=pipe.group, async_op=True))
        for dst, src in tails:
            dst.copy_(src)


def _exact_all_reduce(pipe: _Pipeline, flat: torch.Tensor, plan: _Plan, chunks: int, scale: float,
                      block: int, headroom: int) -> None:
    me, world = plan.rank, plan.world
    # The reduced shards are already final and identical everywhere: reduce straight into the
    # all-gather's send buffer (padded to the widest shard; padding is never read) and gather fp32.
    width = max(plan.bounds[d + 1] - plan.bounds[d] for d in range(world))
    send_buf = pipe.empty(width, torch.float32, flat.device)
    shard = send_buf[:plan.bounds[me + 1] - plan.bounds[me]]
    _exact_reduce_scatter(pipe, flat, shard, plan, chunks, scale, block, headroom)
    work, recv = pipe.all_gather(send_buf, world)
    pipe.wait(work)
    rows = recv.view(world, width)
    for d in range(world):
        a, b = plan.bounds[d], plan.bounds[d + 1]
        flat[a:b].copy_(rows[d, :b - a])
