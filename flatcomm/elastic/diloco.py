"""DiLoCo whose replicas come and go: every outer sync is one torchft quorum.

A sync (every ``sync_every`` inner steps, from the inner optimizer's post-step hook) is one round:

1. ``manager.start_quorum()``: the lighthouse forms the quorum of the replicas alive now; a replica
   behind the others (a restarted one, or one whose last sync did not commit) heals from a peer's
   *last committed* outer state (:mod:`flatcomm.elastic.heal`) and contributes nothing this round;
2. on the quorum's group (:class:`~flatcomm.elastic.QuorumGroup`): one small all-gather (who
   contributes, the configuration's fingerprint), the sum of the pseudo-gradients with the codec
   and error feedback (:mod:`flatcomm.elastic.exchange`) divided by the contributors, the outer SGD
   step on the fp32 master into new tensors, and the new master's hash compared across the quorum;
3. ``manager.should_commit()``: only then are master, momentum and residuals replaced and the
   parameters set from the master. A failure of step 2 (a peer died mid-transfer, a timeout) is
   reported to torchft, so nothing is committed on this replica; the inner steps since the last
   committed sync stay in the weights and go into the next sync's pseudo-gradient.

A disagreement that no retry can fix (configurations, or masters after a sync, that differ) raises
on every member instead. docs/elastic.md has the set-up, the rules and the measurements.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import numbers
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from .. import collectives as C
from ..comm.header import MODES
from ..diloco import replicas
from ..diloco.schedule import split
from ..diloco.state import Fragment, Workspace, outer_step
from ..ops.codecs import resolve
from . import exchange, heal
from .group import QuorumGroup

__all__ = ["ElasticDiLoCo", "Round"]


@dataclasses.dataclass
class Round:
    """One sync round as this replica saw it."""
    step: int  # the inner step it ran after
    committed: bool
    quorum: int = 0  # replicas in the quorum
    contributors: int = 0  # replicas whose pseudo-gradient was summed
    healed: bool = False  # this replica healed in this round's quorum
    quorum_s: float = 0.0  # start_quorum(), healing included
    exchange_s: float = 0.0
    wire_bytes: int = 0
    error: Optional[str] = None  # why this replica did not commit


JOIN_ATTEMPTS = 10  # join rounds before construction gives up


class _Mismatch(RuntimeError):
    """A disagreement between replicas that no retry fixes: raised, never reported to torchft."""


def _positive(v: Any, what: str, integer: bool = False) -> Any:
    ok = not isinstance(v, bool) and isinstance(v, numbers.Integral if integer else numbers.Real)
    if not ok or not math.isfinite(float(v)) or v < (1 if integer else 0):
        raise ValueError(f"flatcomm.elastic: {what} must be {'an int >= 1' if integer else 'a finite number >= 0'}, "
                         f"got {v!r}")
    return int(v) if integer else float(v)


def _check_manager(manager) -> QuorumGroup:
    pg = getattr(manager, "_pg", None)  # torchft 0.2 has no public getter for it
    if not isinstance(pg, QuorumGroup):
        raise TypeError(f"flatcomm.elastic: the manager's process group must be a flatcomm.elastic.QuorumGroup "
                        f"(torchft.Manager(pg=QuorumGroup(timeout=...), ...), or flatcomm.elastic.make_manager), "
                        f"got {type(pg).__name__}")
    if getattr(manager, "_use_async_quorum", True):
        raise ValueError("flatcomm.elastic: the manager must be made with use_async_quorum=False: a replica "
                         "heals before its sync's exchange, not during it")
    return pg


class ElasticDiLoCo:
    """DiLoCo outer sync of ``model`` over the replicas of a torchft ``manager``'s quorum.

    Construction joins: rounds that apply no outer step of their own, until one commits (a fresh
    replica with the others at step 0 checks that every replica starts from the same weights; a
    restarted one heals, again if its donor died meanwhile). Then
    every ``sync_every`` inner steps of ``inner_optimizer`` run one round (:meth:`sync`).

    Args:
        model: the replica's module (its parameters that require grad are synced).
        inner_optimizer: the optimizer whose ``step()`` counts inner steps (hooked).
        manager: a ``torchft.Manager`` with ``pg=QuorumGroup(...)``, ``use_async_quorum=False``.
        sync_every: inner steps between two syncs (H).
        codec: the pseudo-gradient's codec (``"int4"``, ``"sparse"``, ``"fp32"``, ...).
        mode: ``"ordered"`` or ``"exact"`` (the sum independent of the replicas' order).
        outer_lr, outer_momentum, nesterov: torch SGD's, applied to the fp32 master.
        error_feedback: keep what the codec did not send for the next sync.
        verify_every: compare the masters' hashes every this many rounds before committing (0: never).
        resume: a :meth:`state_dict` of this replica to start from (checked; torchft's step too).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, manager, sync_every: int,
                 codec: Any = "int4", mode: str = "ordered", outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, error_feedback: bool = True, verify_every: int = 1,
                 resume: Optional[Dict[str, Any]] = None) -> None:
        self._pg = _check_manager(manager)
        self.manager = manager
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"flatcomm.elastic: inner_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(inner_optimizer).__name__}")
        self.plan, self.fragment = self._configure(model, codec, mode, error_feedback)
        self.sync_every = _positive(sync_every, "sync_every", integer=True)
        self.lr = _positive(outer_lr, "outer_lr")
        self.momentum_factor = _positive(outer_momentum, "outer_momentum")
        if self.momentum_factor >= 1.0 or not isinstance(nesterov, bool):
            raise ValueError(f"flatcomm.elastic: outer_momentum must be < 1 and nesterov a bool, "
                             f"got {outer_momentum!r}, {nesterov!r}")
        self.nesterov = nesterov
        self.verify_every = 0 if verify_every == 0 else _positive(verify_every, "verify_every", integer=True)
        self.fingerprint = self._fingerprint()
        self.step = 0  # inner steps (the schedule position: healed from the donor)
        self.syncs = 0  # outer steps applied
        self.rounds: Deque[Round] = collections.deque(maxlen=10_000)
        self._trained = False  # inner steps since the master was last set into the weights
        self._healed = False
        self._layout: Optional[exchange.Layout] = None  # of the last committed exchange
        self._work = Workspace()
        if resume is not None:
            self._resume(resume)
        manager.register_state_dict_fn(heal.KEY, self._load_heal, self._heal_state)
        self._join()
        self._hook = inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_inner_step())

    def _configure(self, model, codec, mode, error_feedback) -> Tuple[exchange.Plan, Fragment]:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"flatcomm.elastic: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"flatcomm.elastic: mode must be one of {MODES}, got {mode!r}")
        if codec == "auto" or not isinstance(error_feedback, bool):
            raise ValueError(f"flatcomm.elastic: name a codec (not 'auto') and pass error_feedback as a bool, "
                             f"got {codec!r}, {error_feedback!r}")
        plan = exchange.Plan(resolve(codec), mode, error_feedback)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        pieces = split(named, 1)[0]
        frag = Fragment(0, pieces, plan.residual_shapes(sum(x.stop - x.start for x in pieces)), torch.float32)
        if frag.device.type != "cpu":
            raise ValueError(f"flatcomm.elastic: the parameters must be on the CPU (gloo quorum groups), "
                             f"got {frag.device}")
        return plan, frag

    def _fingerprint(self) -> int:
        # verify_every too: whether a round compares hashes is a collective every member must agree on
        f, p = self.fragment, self.plan
        desc = repr((self.sync_every, str(p.codec), p.codec.keep if p.codec.chunked else 0, p.mode, p.feedback,
                     self.lr, self.momentum_factor, self.nesterov, f.names, f.sizes, self.verify_every))
        return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=6).digest(), "little")

    # ---- the rounds ---------------------------------------------------------------------------------

    def _join(self, attempts: int = JOIN_ATTEMPTS) -> None:
        """Rounds until one commits: training starts from the quorum's master, never from weights a
        failed heal left (each round is bounded by the manager's timeouts)."""
        for _ in range(attempts):
            if self.sync().committed:
                return
        raise RuntimeError(f"flatcomm.elastic: could not join the replicas in {attempts} rounds; the last one "
                           f"failed with: {self.rounds[-1].error}")

    def after_inner_step(self) -> None:
        """Count one inner step; run a sync round every ``sync_every`` (the hook calls it)."""
        self.step += 1
        self._trained = True
        if self.step % self.sync_every == 0:
            self.sync()

    def sync(self) -> Round:
        """One round now: quorum (and healing), exchange, commit if torchft agrees. Returns it."""
        r = Round(self.step, committed=False)
        self._healed = False
        t0 = time.perf_counter()
        self.manager.start_quorum(allow_heal=True)
        r.quorum_s, r.healed = time.perf_counter() - t0, self._healed
        result, t1 = None, time.perf_counter()
        # A replica whose heal failed still takes part (saying so): the others then skip this round
        # at once instead of waiting out the timeout for it.
        try:
            result = self._exchange(r, ok=self.manager.errored() is None)
        except _Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: torchft skips the commit
            if self.manager.errored() is None:
                self.manager.report_error(e)
        r.exchange_s = time.perf_counter() - t1
        r.committed = bool(self.manager.should_commit())
        if r.committed and result is not None:
            self._commit(*result)
        elif self.manager.errored() is not None:
            why = self.manager.errored().original_exception
            r.error = f"{type(why).__name__}: {(str(why).splitlines() or [''])[0][:300]}"
        self.rounds.append(r)
        return r

    def _exchange(self, r: Round, ok: bool):
        """(new master, new momentum, residuals, layout, applied) of this round; changes nothing.
        ``ok``: this replica joined the round well (False: its heal or group set-up failed)."""
        group = self._pg.current()
        layout = (group.rank(), group.size())
        contributes = self._trained and not self._healed
        r.quorum = group.size()
        r.contributors = self._agree(group, contributes, ok)
        f, stats = self.fragment, C.CommStats()
        residuals = f.residual_copies(self._work)
        master, momentum = f.master, f.momentum
        if r.contributors:
            delta = f.pseudo_gradient(self._work.take("delta", f.numel, f.device))
            if not contributes:
                delta.zero_()
            exchange.fold(self.plan, residuals, self._layout, layout)
            total = exchange.sum_over(self.plan, group, delta, residuals, stats).div_(r.contributors)
            master, momentum = outer_step(f.master, f.momentum, total, self.lr, self.momentum_factor, self.nesterov,
                                          self._work.take("master", f.numel, f.device),
                                          self._work.take("momentum", f.numel, f.device))
            if not bool(torch.isfinite(master.sum())):
                raise _Mismatch(f"flatcomm.elastic: the outer step after inner step {self.step} is not finite "
                                f"(a replica's weights diverged); nothing was committed")
        r.wire_bytes = stats.wire_bytes
        # torchft's step is the same on every member now (a replica behind has healed to it).
        if self.verify_every and (self.manager.current_step() + 1) % self.verify_every == 0:
            self._verify(group, master)
        return master, momentum, residuals, layout, r.contributors > 0

    def _agree(self, group, contributes: bool, ok: bool) -> int:
        """The number of contributors; raises on every member if a member could not join this
        round (a transient failure) or if the configurations differ (:class:`_Mismatch`)."""
        parts = [float(contributes), float(ok)] + [float((self.fingerprint >> (16 * i)) & 0xFFFF) for i in range(3)]
        rows = torch.empty(group.size() * 5, dtype=torch.float32)
        C.all_gather(rows, torch.tensor(parts), codec="fp32", group=group)
        table = rows.view(-1, 5).to(torch.int64).tolist()
        try:
            replicas.differing([sum(v << (16 * i) for i, v in enumerate(row[2:])) for row in table],
                               "the elastic DiLoCo configuration")
        except RuntimeError as e:
            raise _Mismatch(str(e)) from None
        failed = [i for i, row in enumerate(table) if not row[1]]
        if failed:
            raise RuntimeError(f"flatcomm.elastic: replica(s) {failed} of the quorum could not join the sync after "
                               f"inner step {self.step} (healing or the group's set-up failed): nothing is committed")
        return sum(row[0] for row in table)

    def _verify(self, group, master: torch.Tensor) -> None:
        try:
            replicas.verify(group, torch.device("cpu"), [master], f"the fp32 master after inner step {self.step}")
        except RuntimeError as e:
            if "disagree" in str(e):
                raise _Mismatch(str(e)) from None
            raise

    def _commit(self, master, momentum, residuals: List[torch.Tensor], layout, applied: bool) -> None:
        f = self.fragment
        f.commit(master, momentum, residuals if self.plan.feedback else None)
        f.set_weights(f.master, 0.0)
        self._layout = layout
        self._trained = False
        self.syncs += int(applied)

    # ---- healing ------------------------------------------------------------------------------------

    def _heal_state(self) -> Dict[str, Any]:
        return heal.state(self.fragment.master, self.fragment.momentum, self.step, self.syncs, self.fingerprint)

    def _load_heal(self, sd: Dict[str, Any]) -> None:
        f = self.fragment
        heal.check(sd, self.fingerprint, f.numel)
        f.master.copy_(sd["master"])
        f.momentum.copy_(sd["momentum"])
        for res in f.residuals:
            res.zero_()
        f.set_weights(f.master, 0.0)
        self.step, self.syncs = sd["step"], sd["syncs"]
        self._layout, self._trained, self._healed = None, False, True

    # ---- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This replica's committed state: master, momentum, residuals, step, syncs, torchft's step
        (not the weights: save the model and the inner optimizer beside it). Pass it as ``resume=``."""
        return heal.checkpoint(self._heal_state(), self.fragment.residuals, self._layout, self.manager.state_dict())

    def _resume(self, sd: Dict[str, Any]) -> None:
        f = self.fragment
        heal.check_checkpoint(sd, self.fingerprint, f.numel, [r.numel() for r in f.residuals])
        self.manager.load_state_dict(sd["torchft"])
        f.commit(sd["master"], sd["momentum"], sd["residuals"])
        f.set_weights(f.master, 0.0)
        self.step, self.syncs = sd["step"], sd["syncs"]
        self._layout = None if sd["layout"] is None else (sd["layout"][0], sd["layout"][1])

    # ---- the rest -----------------------------------------------------------------------------------

    def master_hash(self) -> int:
        """64-bit hash of this replica's fp32 master (equal on every replica after a committed sync)."""
        return replicas.master_hash([self.fragment.master])

    @property
    def stats(self) -> Dict[str, Any]:
        rs = list(self.rounds)
        return {"inner_steps": self.step, "syncs": self.syncs, "rounds": len(rs),
                "committed": sum(r.committed for r in rs), "heals": sum(r.healed for r in rs),
                "wire_bytes": sum(r.wire_bytes for r in rs), "quorum_s": sum(r.quorum_s for r in rs),
                "exchange_s": sum(r.exchange_s for r in rs)}

    def close(self) -> None:
        """Remove the hook from the inner optimizer."""
        self._hook.remove()
