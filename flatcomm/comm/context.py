"""What flatcomm keeps for one process group, in one place, dropped when the group is destroyed.

flatcomm keeps state per process group: its private copy (:mod:`flatcomm.comm.groups`), the worker
thread that runs its collectives in order (:mod:`flatcomm.comm.worker`), the header's call counter,
staging buffers, CUDA side streams, the tuner, the topology subgroups, the backend's settings. Each
lives in a slot of the group's :class:`GroupContext`, keyed weakly by the group object, so that a
group torch and the program let go of takes flatcomm's state with it.

A context closes (its slots dropped, its closers run: private copies destroyed and unregistered
from torch, worker threads joined) when

* its group is destroyed through a flatcomm hook (:func:`drop`, e.g. the ``flatcomm`` backend's
  ``shutdown``), or
* a new context is made (a flatcomm call names a new group) and the group is no longer registered
  with torch (``destroy_process_group`` of a plain gloo group, which calls no hook of ours) or was
  garbage-collected: :func:`sweep`. So a program that makes and destroys groups in a loop holds
  at most the last one's state.

Each context has a :attr:`~GroupContext.token`, an int never reused in the process (an ``id()`` of
a destroyed group may be): the worker threads are keyed by it. The default group is named None
by callers; its context is the one of ``dist.group.WORLD`` (a process without torch.distributed
initialised has one context of its own for None).
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch.distributed as dist

__all__ = ["GroupContext", "by_token", "close_all", "count", "count_with", "destroy", "drop", "existing", "of", "pair", "sweep"]

log = logging.getLogger("flatcomm")
T = TypeVar("T")

_lock = threading.RLock()
_tokens = itertools.count(1)
_of_group: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its context
_by_token: Dict[int, "GroupContext"] = {}  # every open context
_pairs: Dict[tuple, "GroupContext"] = {}  # (token, token) -> the context of a pair of groups
_no_group: Optional["GroupContext"] = None  # None before torch.distributed is initialised
_exiting = False
_later: List[Any] = []  # groups flatcomm made, to destroy at the next sweep (see destroy)
on_worker = threading.local()  # .key and .active set on flatcomm's worker threads (flatcomm.comm.worker)


def _registered(group) -> bool:
    """Whether torch lists ``group`` (``destroy_process_group`` unlists it)."""
    try:
        dist.get_process_group_ranks(group)
        return True
    except Exception:  # noqa: BLE001 - destroyed, or a group torch never listed
        return False


class GroupContext:
    """flatcomm's state for one process group (or a pair of groups: :func:`pair`).

    Args:
        group: the process group (held weakly), or None for a pair or the uninitialised default.
        name: how error messages name it.
    """

    def __init__(self, group=None, name: str = "process group"):
        self.token = next(_tokens)
        self.name = name
        self._group = weakref.ref(group, self._collected) if group is not None else None
        # Only a group torch listed at the start counts as destroyed when torch unlists it.
        self._listed = group is not None and _registered(group)
        self._slots: Dict[Any, Any] = {}
        self._closers: List[Callable[[], None]] = []
        self._drainers: List[Callable[[], None]] = []
        self._build = threading.RLock()  # held while a slot's value is made (one build per slot)
        self.closed = False
        self.waits = True  # whether closing joins the worker (not from a garbage collection)

    def _collected(self, _ref) -> None:
        # The group object is gone (torch unlisted it and the program let go). A collection runs on
        # any thread, inside whatever lock that thread holds: close without waiting for anything
        # (workers are told to stop, not joined), else leave it to the next sweep.
        if not getattr(on_worker, "active", False):
            self.close(wait=False)

    def slot(self, name: Any, make: Callable[[], T]) -> T:
        """The value of slot ``name``, made by ``make()`` on first use (once, under this context's
        lock: two threads never make it twice, which matters when ``make`` creates groups)."""
        value = self._slots.get(name)
        if value is not None:
            return value
        with self._build:
            value = self._slots.get(name)
            if value is None:
                self._check_open()
                value = self._slots[name] = make()
            return value

    def get(self, name: Any, default: Any = None) -> Any:
        return self._slots.get(name, default)

    def set(self, name: Any, value: Any) -> None:
        self._check_open()
        self._slots[name] = value

    def pop(self, name: Any) -> Any:
        return self._slots.pop(name, None)

    def has(self, name: Any) -> bool:
        return name in self._slots

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the context closes (closers run in reverse order of registration)."""
        with self._build:
            self._check_open()
            self._closers.append(fn)

    def on_drain(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the context closes with ``wait=True``, before anything is dropped: the
        group's calls in flight finish first, on every rank alike (as gloo drains its queue)."""
        with self._build:
            self._check_open()
            self._drainers.append(fn)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"flatcomm: the {self.name} was destroyed; its collectives cannot run")

    def gone(self) -> bool:
        """Whether the group was destroyed (unlisted by torch) or collected."""
        if self._group is None:
            return False
        group = self._group()
        return group is None or (self._listed and not _registered(group))

    def close(self, wait: bool = True) -> None:
        """Drop every slot and run the closers (errors are logged: a close never raises).

        Args:
            wait: join the worker threads; False also returns at once, leaving the close to the
                next :func:`sweep`, when another thread holds this context's locks.
        """
        if wait and not self.closed:
            for drain in list(self._drainers):
                try:
                    drain()
                except Exception:  # noqa: BLE001 - what could not drain fails when closed
                    log.warning("flatcomm: draining the calls of a %s failed", self.name, exc_info=True)
        # The order slot() takes them in: this context's build lock, then the module's.
        if not self._build.acquire(blocking=wait):
            return
        try:
            if self.closed or not _lock.acquire(blocking=wait):
                return
            try:
                self.closed, self.waits = True, wait
                _by_token.pop(self.token, None)
                closers, self._closers = self._closers[::-1], []
                self._slots.clear()
            finally:
                _lock.release()
        finally:
            self._build.release()
        for fn in closers:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failed clean-up must not keep the others
                log.warning("flatcomm: closing the state of a %s failed", self.name, exc_info=True)


def _default():
    """The group callers mean by None."""
    return dist.group.WORLD if dist.is_initialized() else None


def of(group) -> GroupContext:
    """The context of ``group`` (None: the default group), made on first use. Making one first
    closes the contexts of destroyed groups (:func:`sweep`)."""
    g = group if group is not None else _default()
    if isinstance(g, int):  # (torch's marker for a rank outside the group is an int)
        _not_a_member()
    global _no_group
    with _lock:
        if g is None:
            if _no_group is None or _no_group.closed:
                _no_group = GroupContext(None, "default group")
                _by_token[_no_group.token] = _no_group
            return _no_group
        ctx = _of_group.get(g)
        if ctx is not None and not ctx.closed:
            return ctx
    sweep()
    with _lock:
        ctx = _of_group.get(g)
        if ctx is None or ctx.closed:
            ctx = _of_group[g] = GroupContext(g)
            _by_token[ctx.token] = ctx
        return ctx


def _not_a_member() -> None:
    """The error for ``group=GroupMember.NON_GROUP_MEMBER``: what ``dist.new_group`` returns on the
    ranks it leaves out."""
    rank = dist.get_rank() if dist.is_initialized() else "?"
    raise ValueError(f"flatcomm: rank {rank} is not a member of the process group it passed as group= "
                     "(dist.new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out): call a "
                     "group's collectives only on its members")


def pair(first, second) -> GroupContext:
    """The context of two groups used together (a topology's tiers): closed with either."""
    a, b = of(first), of(second)
    with _lock:
        ctx = _pairs.get((a.token, b.token))
        if ctx is not None and not ctx.closed:
            return ctx
        ctx = _pairs[(a.token, b.token)] = GroupContext(None, "topology")
        _by_token[ctx.token] = ctx
    key = (a.token, b.token)

    def close_pair(closing: GroupContext) -> None:
        _pairs.pop(key, None)
        ctx.close(wait=closing.waits)

    a.on_close(lambda: close_pair(a))
    b.on_close(lambda: close_pair(b))
    return ctx


def by_token(token: int) -> GroupContext:
    """The open context with this token (a worker key); raises if its group was destroyed."""
    ctx = _by_token.get(token)
    if ctx is None:
        raise RuntimeError("flatcomm: the process group of this call was destroyed; its collectives cannot run")
    return ctx


def existing(group) -> Optional[GroupContext]:
    """The context of ``group`` if it has one (None: the default group), without making one."""
    g = group if group is not None else _default()
    with _lock:
        ctx = _no_group if g is None else _of_group.get(g)
    return ctx if ctx is not None and not ctx.closed else None


def drop(group, wait: bool = True) -> None:
    """Close the context of ``group`` now (its group is being destroyed); ``wait``: join its worker."""
    ctx = existing(group)
    if ctx is not None:
        ctx.close(wait=wait)


def destroy(group, wait: bool = True) -> None:
    """Destroy a group flatcomm made (a private copy, a topology's tier): close its context, then
    unregister it from torch (at exit, or once torch forgot it, only the context). ``wait``: join
    its worker (False when the close comes from a garbage collection: see GroupContext.close)."""
    drop(group, wait)
    if _exiting or not _registered(group):
        return
    if wait:
        dist.destroy_process_group(group)
    else:  # from a garbage collection, under any lock: torch's destroy waits for the next sweep
        with _lock:
            _later.append(group)


def sweep() -> int:
    """Close the contexts of groups destroyed or collected since; returns how many."""
    with _lock:
        dead = [c for c in _by_token.values() if c.gone()]
        later = _later[:]
        del _later[:]
    for c in dead:
        c.close()
    for g in later:
        destroy(g)
    return len(dead)


def close_all() -> None:
    """Close every context (at exit: the groups flatcomm made are then only let go of, not
    destroyed, as torch's own exit handling expects of groups it still lists)."""
    global _exiting
    _exiting = True
    with _lock:
        del _later[:]
        every = list(_by_token.values())
    for c in every:
        c.close()


def count_with(name: Any) -> int:
    """How many open contexts have slot ``name``."""
    with _lock:
        return sum(c.has(name) for c in _by_token.values())


def count() -> int:
    """How many contexts are open (tests: groups made and destroyed leave none behind)."""
    return len(_by_token)
