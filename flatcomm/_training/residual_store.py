"""Error-feedback residuals owned by parameters, stored as one flat buffer per collective.

Shared by :mod:`flatcomm.ddp` (one slot per DDP bucket: client and server residual) and
:mod:`flatcomm.fsdp` (one slot per reduce-scatter parameter group: this rank's residual of every
rank's chunk). Encoding is one pass over one tensor, so each collective's residual is one flat
buffer; but the set of parameters a collective holds changes: DDP rebuilds its buckets after the
first iteration, FSDP2 leaves parameters without a gradient out of a group, a ``keep_fp32``
exception splits a group in two, a checkpoint brings residuals for groups not formed yet. So a
residual belongs to its parameter, and a :class:`Store` knows where each one lives.

A slot is the owner's object with a ``layout``: ``(parameter id, offset, numel)`` in buffer order.
When a new group appears, :meth:`Store.place` fills the new slot parameter by parameter: from where
the parameter's residual lives now (the owner's ``move`` says how: DDP folds the server residual
into the client one, FSDP copies per-rank rows), else from a residual loaded from a checkpoint and
not placed yet (``pending``, by parameter name), else it stays zero. A slot no parameter refers to
any more is freed. :meth:`Store.forget` drops a slot whose residuals were just sent losslessly
(the codec switched to fp32: nothing is left to keep).
"""
from __future__ import annotations

from typing import Callable, Dict, Generic, Hashable, Iterable, List, Optional, Protocol, Tuple, TypeVar

import torch

__all__ = ["Store"]

Layout = List[Tuple[Hashable, int, int]]  # (parameter id, offset, numel) in buffer order


class _Slot(Protocol):
    layout: Layout


S = TypeVar("S", bound=_Slot)
# move(old slot, its offset, its numel, new offset, new numel): copy one parameter's residual over
Move = Callable[[S, int, int, int, int], None]
# load(loaded tensor, name, new offset, new numel): place one loaded residual
Load = Callable[[torch.Tensor, str, int, int], None]


class Store(Generic[S]):
    """Slots keyed by their group (a tuple of parameter ids), addressable per parameter."""

    def __init__(self) -> None:
        self.slots: Dict[Tuple[Hashable, ...], S] = {}
        self._where: Dict[Hashable, Tuple[Tuple[Hashable, ...], int, int]] = {}
        self._refs: Dict[Tuple[Hashable, ...], int] = {}
        # Residuals loaded from a checkpoint that no slot holds yet, by parameter name.
        self.pending: Dict[str, torch.Tensor] = {}

    def get(self, key: Tuple[Hashable, ...]) -> Optional[S]:
        return self.slots.get(key)

    def locate(self, pid: Hashable) -> Optional[Tuple[S, int, int]]:
        """(slot, offset, numel) of a parameter's residual, or None if no slot holds it."""
        loc = self._where.get(pid)
        if loc is None:
            return None
        key, off, n = loc
        return self.slots[key], off, n

    def placed(self, pid: Hashable) -> bool:
        return pid in self._where

    def ids(self) -> List[Hashable]:
        """Every parameter a slot holds."""
        return list(self._where)

    def holds(self, pids: Iterable[Hashable], names: Iterable[Optional[str]] = ()) -> bool:
        """Whether any of these parameters has a residual: in a slot, or loaded (by name)."""
        if any(p in self._where for p in pids):
            return True
        return bool(self.pending) and any(n is not None and n in self.pending for n in names)

    def place(self, key: Tuple[Hashable, ...], slot: S, move: Move, load: Load,
              name_of: Callable[[Hashable], Optional[str]] = lambda pid: None) -> S:
        """Make ``slot`` the home of its layout's parameters, filling it from their old homes
        (``move``) or from ``pending`` (``load``); returns it. Old slots left empty are freed."""
        emptied = []
        for pid, off, n in slot.layout:
            old = self._where.get(pid)
            if old is not None:
                okey, ooff, on = old
                move(self.slots[okey], ooff, on, off, n)
                self._refs[okey] -= 1
                if self._refs[okey] == 0:
                    emptied.append(okey)
            elif self.pending:
                name = name_of(pid)
                if name is not None and name in self.pending:
                    load(self.pending.pop(name), name, off, n)
            self._where[pid] = (key, off, n)
        for okey in emptied:
            del self.slots[okey], self._refs[okey]
        self.slots[key] = slot
        self._refs[key] = len(slot.layout)
        return slot

    def forget(self, key: Tuple[Hashable, ...]) -> S:
        """Drop a slot and its parameters' residuals (just sent losslessly)."""
        slot = self.slots.pop(key)
        del self._refs[key]
        for pid, _, _ in slot.layout:
            if self._where.get(pid, (None,))[0] == key:
                del self._where[pid]
        return slot

    def clear(self, pending: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Forget every slot; ``pending``: the residuals just loaded (by name)."""
        self.slots.clear()
        self._where.clear()
        self._refs.clear()
        self.pending = dict(pending or {})

    def adopt(self, key: Tuple[Hashable, ...], slot: S) -> None:
        """Register a slot restored as saved (a checkpoint's bucket): its parameters had no home."""
        twice = [pid for pid, _, _ in slot.layout if pid in self._where]
        if twice:
            raise ValueError(f"flatcomm: parameter {twice[0]!r} is in two saved buckets")
        for pid, off, n in slot.layout:
            self._where[pid] = (key, off, n)
        self.slots[key] = slot
        self._refs[key] = len(slot.layout)
