"""``torch.profiler`` labels on flatcomm's phases, and nothing while no profiler runs.

A user's ``torch.profiler`` trace shows each phase of a flatcomm call as a named range:

* ``flatcomm.all_reduce`` / ``flatcomm.reduce_scatter`` / ``flatcomm.all_gather`` /
  ``flatcomm.hierarchical`` (a two-level call): a collective (on the caller's thread, around the submit and, when
  synchronous, the wait; and on the worker thread, around the body);
* ``flatcomm.comm.verify``: the call header's exchange and check; ``flatcomm.comm.encode``,
  ``flatcomm.comm.exchange`` (also each tier's exchange of a two-level call),
  ``flatcomm.comm.decode_sum``: the phases of the body; ``flatcomm.comm.p2p_all_reduce``: the
  exchanges and sum of a lossless fp32 all-reduce on CPU, one native op;
* ``flatcomm.ddp.hook``, ``flatcomm.fsdp.reduce_scatter``, ``flatcomm.diloco.sync_start`` /
  ``flatcomm.diloco.outer_step`` / ``flatcomm.diloco.verify``: the layers above.

The bodies run on flatcomm's worker threads, which torch's profiler records only with
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``; the
caller-thread labels show in every trace. A label costs one bool test while no profiler runs
(``record_function`` itself costs a dispatcher call even then).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.autograd.profiler as _profiler

__all__ = ["label"]

_NOTHING = contextlib.nullcontext()


def label(name: str) -> ContextManager:
    """A ``torch.profiler.record_function(name)`` range while a profiler runs, else a no-op.

    Args:
        name: the range's name, ``flatcomm.<layer>.<phase>``.
    """
    if _profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NOTHING
