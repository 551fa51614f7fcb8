"""The call forms torch's ``ProcessGroup`` binds, and gloo's argument checks, for the flatcomm group.

torch binds each collective with several overloads (``pg.allreduce([t], opts)``,
``pg.allreduce([t], op=...)``, ``pg.allreduce(t, op=..., timeout=...)``, ``pg.broadcast(t, root=0)``,
``pg.barrier(timeout=...)`` ...). A Python method of a subclass shadows all of them, so each method of
:class:`flatcomm.backend.FlatcommGroup` is wrapped by :func:`torch_forms`: the canonical form (lists
and an options object, what torch's own Python and C++ callers use) runs the method; any other form
goes to torch's binding, which builds the options object and calls the method through pybind's
trampoline with the canonical form. ``reduce`` is not in the trampoline, so its short form is parsed
here (:func:`reduce_form`).

The checks are gloo's (``ProcessGroupGloo``): an empty list is refused, every tensor of a list has
the first one's dtype, device and size, ``reduce`` and ``reduce_scatter`` take one tensor. A list of
several tensors in ``allreduce`` means, for gloo, the sum over every tensor of every rank (the legacy
multi-device form); flatcomm refuses it for every op rather than give it a second meaning.
"""
from __future__ import annotations

import datetime
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["checked_list", "reduce_form", "torch_forms"]


def torch_forms(name: str, opts_at: int, opts_type: type, lists: Tuple[int, ...] = (0,)) -> Callable:
    """Wrap a ProcessGroup method whose canonical form is ``(*args[:opts_at], opts=None)``.

    Args:
        name: the method of ``dist.ProcessGroup`` whose binding takes the other forms.
        opts_at: the position of the options object in the canonical form.
        opts_type: its class (``dist.AllreduceOptions`` ...).
        lists: positions that hold a list (a Tensor there means a short form).
    """
    base = getattr(dist.ProcessGroup, name)

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, *args: Any, **kwargs: Any):
            if kwargs and len(args) == opts_at and set(kwargs) == {"opts"}:
                args, kwargs = (*args, kwargs["opts"]), {}
            if (not kwargs and (len(args) == opts_at or (len(args) == opts_at + 1 and
                                                       (args[-1] is None or isinstance(args[-1], opts_type))))
                    and all(isinstance(args[i], (list, tuple)) for i in lists if i < len(args))):
                return method(self, *args)
            return base(self, *args, **kwargs)  # builds the options; calls back with the canonical form
        return call
    return wrap


def reduce_form(args: Sequence[Any], kwargs: dict) -> Tuple[List[torch.Tensor], "dist.ReduceOptions"]:
    """``(tensors, opts)`` of any form of ``ProcessGroup.reduce``: ``(tensors, opts=None)`` or
    ``(tensor, root, op=SUM, timeout=None)`` (torch's two overloads)."""
    if args and isinstance(args[0], torch.Tensor) or "tensor" in kwargs:
        return _reduce_short(*args, **kwargs)
    return _reduce_lists(*args, **kwargs)


def _reduce_lists(tensors, opts=None):
    return list(tensors), opts if opts is not None else dist.ReduceOptions()


def _reduce_short(tensor, root, op=dist.ReduceOp.SUM, timeout: Optional[datetime.timedelta] = None):
    opts = dist.ReduceOptions()
    opts.rootRank = int(root)
    opts.reduceOp = op
    if timeout is not None:
        opts.timeout = timeout
    return [tensor], opts


def checked_list(op: str, tensors: Sequence[Any], single: bool, same_size: bool = True) -> List[torch.Tensor]:
    """``tensors`` as a list of tensors detached from autograd, after gloo's checks.

    Args:
        op: the method's name, for the messages.
        tensors: what the caller passed.
        single: exactly one tensor (``reduce``, ``reduce_scatter``, flatcomm's ``allreduce``).
        same_size: every tensor has the first one's size (not for the coalesced calls).

    Returns the tensors detached: a collective writes them in place, as gloo's does, whether or not
    they require grad (DDP's ``backward(create_graph=True)`` reduces such buckets).
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"flatcomm: {op} takes a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"flatcomm: {op} got an empty list of tensors")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flatcomm: {op}: element {i} is a {type(t).__name__}, not a Tensor")
        if t.dtype != first.dtype or t.device != first.device or t.layout != first.layout:
            if same_size:
                raise ValueError(f"flatcomm: {op}: invalid tensor type at index {i} (expected {first.dtype} on "
                                 f"{first.device}, got {t.dtype} on {t.device})")
        elif same_size and t.shape != first.shape:
            raise ValueError(f"flatcomm: {op}: invalid tensor size at index {i} (expected {tuple(first.shape)}, "
                             f"got {tuple(t.shape)})")
    if single and len(tensors) > 1:
        raise ValueError(f"flatcomm: {op} takes one tensor per rank, got {len(tensors)}: the legacy multi-device "
                         f"form (gloo sums every tensor of every rank) is not offered; reduce a list of tensors "
                         f"with allreduce_coalesced / dist.all_reduce_coalesced")
    return [t.detach() if t.requires_grad else t for t in tensors]
