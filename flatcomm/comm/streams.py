"""CUDA stream discipline of :mod:`flatcomm.collectives` (nothing here runs for CPU tensors).

A collective is submitted on the caller's thread and runs on its group's worker thread. For CUDA
tensors (:func:`for_call` returns None for any other device, and the CPU path never touches this):

* submit: an event recorded on the caller's current stream marks the inputs ready;
* worker: the collective's kernels run on one side stream per (group, device) that first waits on
  that event. torch's NCCL backend issues each collective on its own stream after making it wait
  for the issuing thread's current stream (here: the side stream), and ``work.wait()`` makes the
  current stream wait for the NCCL kernel without blocking the host (``WorkNCCL::wait`` without a
  timeout = ``synchronize()``, ProcessGroupNCCL.hpp). So the worker only enqueues, never syncs;
* end: an event recorded on the side stream. Synchronous calls make the caller's current stream
  wait on it; asynchronous ones complete a CUDA-aware ``torch.futures.Future(devices=[device])``
  while the side stream is current, so the future records its event there, and a consumer's
  ``wait()`` makes *its* current stream wait on that event (callbacks added with ``then`` /
  ``add_done_callback`` run on pool streams already synchronised with it: ivalue ``Future``,
  ``markCompleted`` / ``invokeCallback`` / ``synchronizeWithCurrentStreams``).

None of this has run on a GPU yet (benchmarks/gpu_check.py ``--collectives`` is the check).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from . import context

__all__ = ["CallStreams", "for_call", "side_stream"]


def side_stream(group_key, device: torch.device) -> "torch.cuda.Stream":
    """The stream every collective of this group runs its kernels on, for this device (kept in
    the group's context: ``group_key`` is its worker key)."""
    return context.by_token(group_key).slot(("side stream", device.index),
                                           lambda: torch.cuda.Stream(device=device))


class CallStreams:
    """The streams and events of one collective call on CUDA tensors (see the module docstring).
    Created on the caller's thread at submit time."""

    def __init__(self, group_key, device: torch.device):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = side_stream(group_key, device)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.done: Optional[torch.cuda.Event] = None

    @contextlib.contextmanager
    def side(self, keep: Iterable[Optional[torch.Tensor]] = ()):
        """On the worker: run the body on the side stream, after the caller's inputs are ready.

        ``keep``: the caller's tensors the body uses. They were allocated on a caller stream, so
        without ``record_stream`` the caching allocator could hand their memory out again (on the
        caller's stream) as soon as the caller drops them, e.g. right after an ``async_op=True``
        call, while the side stream still reads or writes them. Marking them here is enough: the
        body's closure holds them until every kernel of the call is enqueued, and the allocator
        records its reuse event on the side stream when they are freed, i.e. after that. Staging
        buffers need nothing: they are allocated on the side stream itself, and every call of the
        group runs there, after waiting for its NCCL work, so their reuse through the pool (or the
        allocator) is stream-ordered."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            for t in keep:
                if t is not None:
                    t.record_stream(self.stream)
            yield
            self.done = torch.cuda.Event()
            self.done.record(self.stream)

    def join_current(self) -> None:
        """Make the calling thread's current stream wait for the call's kernels (no host sync)."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)

    def future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=[self.device])

    def complete(self, fut: torch.futures.Future, value: torch.Tensor) -> None:
        """``set_result`` with the side stream current: the future's event covers the call."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            fut.set_result(value)

    def finished(self) -> bool:
        """Whether the GPU has run the call (not only enqueued it)."""
        return self.done is None or self.done.query()


def for_call(group_key, device: torch.device) -> Optional[CallStreams]:
    """Streams for one call on ``device``: None unless it is a CUDA device."""
    return CallStreams(group_key, device) if device.type == "cuda" else None
