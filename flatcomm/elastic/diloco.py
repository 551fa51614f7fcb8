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

With an island of several ranks (``island=``) every step above runs per rank on its part
(:mod:`flatcomm.elastic.island`) with the same rank of the other islands, a replicated island
all-gathers its new master before step 3, and torchft's ``should_commit`` is the AND over the
island's ranks: an island commits all or nothing. The data stream's state (``data=``) travels
with the heal state and is hashed with the master (:mod:`flatcomm.elastic.data`).

A disagreement that no retry can fix (configurations, or masters after a sync, that differ) raises
on every member instead. docs/elastic.md has the set-up, the rules and the measurements.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from .. import collectives as C
from ..comm.header import MODES
from ..diloco import replicas
from ..diloco.state import Fragment, Workspace, outer_step
from ..ops.codecs import resolve
from . import exchange, heal
from .checks import check_manager as _check_manager, positive as _positive
from .island import Island

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
    heal_s: float = 0.0  # the heal's transfer (this rank's part, from the same rank of a donor island)
    heal_bytes: int = 0  # what that transfer carried (tensor bytes)
    healed_to: int = -1  # healed: the donor's inner step, where this replica's schedule resumes
    exchange_s: float = 0.0
    wire_bytes: int = 0
    error: Optional[str] = None  # why this replica did not commit


JOIN_ATTEMPTS = 10  # join rounds before construction gives up


_Mismatch = exchange.Mismatch


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
        island: the island's process group (its ranks train one replica with DDP, FSDP2 or a
            module replicated on them; None: an island of one process); this rank syncs its part
            (:mod:`flatcomm.elastic.island`) with the same rank of the other islands.
        data: the data stream's state keeper (:class:`~flatcomm.elastic.BatchStream`, or any object
            with ``state_dict``/``load_state_dict``, the same on every island at a sync): saved with
            every committed sync and loaded by a healing island (:mod:`flatcomm.elastic.data`).
        state_device: where master and momentum live for CUDA parameters: ``"host"`` (default,
            pinned) or ``"device"``; the residuals and the exchange are on the host (gloo) either way.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, manager, sync_every: int,
                 codec: Any = "int4", mode: str = "ordered", outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, error_feedback: bool = True, verify_every: int = 1,
                 resume: Optional[Dict[str, Any]] = None, island=None, data: Any = None,
                 state_device: str = "host") -> None:
        self.island = island if isinstance(island, Island) else Island(island)
        self._quorum = _check_manager(manager, self.island)
        self.manager = manager
        if data is not None and not (callable(getattr(data, "state_dict", None))
                                     and callable(getattr(data, "load_state_dict", None))):
            raise TypeError(f"flatcomm.elastic: data must have state_dict() and load_state_dict(), "
                            f"got {type(data).__name__}")
        self.data = data
        if state_device not in ("host", "device"):
            raise ValueError(f"flatcomm.elastic: state_device must be 'host' or 'device', got {state_device!r}")
        self._state_device = state_device
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
        pieces = self.island.part([(n, p) for n, p in model.named_parameters() if p.requires_grad])
        numel = sum(x.stop - x.start for x in pieces)
        cpu = torch.device("cpu")  # the quorum's groups are gloo: the exchange runs from host buffers
        probe = pieces[0].param
        on_gpu = probe.device.type != "cpu"
        state = (probe.device if self._state_device == "device" else cpu) if on_gpu else None
        frag = Fragment(0, pieces, plan.residual_shapes(numel), torch.float32, state_device=state, residual_device=cpu)
        if frag.device.type not in ("cpu", "cuda"):
            raise ValueError(f"flatcomm.elastic: the parameters must be on the CPU or a CUDA device, got {frag.device}")
        return plan, frag

    def _fingerprint(self) -> int:
        # verify_every too: whether a round compares hashes is a collective every member must agree on
        f, p = self.fragment, self.plan
        desc = repr((self.sync_every, str(p.codec), p.codec.keep if p.codec.chunked else 0, p.mode, p.feedback,
                     self.lr, self.momentum_factor, self.nesterov, f.names, f.sizes, self.verify_every,
                     self.island.size, self.island.kind, self.data is not None))
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
        before = self.manager.state_dict()  # torchft's step, put back if this round heals and fails
        self.manager.start_quorum(allow_heal=True)
        r.quorum_s, r.healed = time.perf_counter() - t0, self._healed
        if r.healed:
            r.healed_to = self.step  # the donor's: the sync this round is
            transport = getattr(self.manager, "_checkpoint_transport", None)  # torchft 0.2: no getter
            r.heal_s, r.heal_bytes = getattr(transport, "last_recv", (0.0, 0))
        result, t1 = None, time.perf_counter()
        # A replica whose heal failed still takes part (saying so): the others then skip this round
        # at once instead of waiting out the timeout for it.
        try:
            result = self._exchange(r, ok=self.manager.errored() is None)
        except _Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: torchft skips the commit
            self._report(e)
        if self.island.gathers:  # every rank of the island, whatever its exchange did: none waits
            result = self._gather(result)
        r.exchange_s = time.perf_counter() - t1
        r.committed = bool(self.manager.should_commit())
        if r.committed and result is not None:
            self._commit(*result)
            return self._done(r)
        if r.healed:
            # A heal that did not commit (another rank of the island, or its donor, failed): this
            # rank goes back to its step before the heal, so that the whole island is behind at
            # its next round and every rank heals again: never some ranks healed and some not.
            self.manager.load_state_dict(before)
        if self.manager.errored() is not None:
            why = self.manager.errored().original_exception
            r.error = f"{type(why).__name__}: {(str(why).splitlines() or [''])[0][:300]}"
        return self._done(r)

    def _done(self, r: Round) -> Round:
        self.rounds.append(r)
        return r

    def _exchange(self, r: Round, ok: bool):
        """(new master, new momentum, residuals, layout, applied, the island's whole master or None)
        of this round; changes nothing. ``ok``: this replica joined the round well (False: its heal
        or group set-up failed)."""
        group = self._quorum.current()
        layout = (group.rank(), group.size())
        contributes = self._trained and not self._healed
        r.quorum = group.size()
        r.contributors = exchange.agree(group, contributes, ok, self.fingerprint, self.step)
        f, stats = self.fragment, C.CommStats()
        residuals = f.residual_copies(self._work)
        master, momentum = f.master, f.momentum
        if r.contributors:
            total = self._host_delta(contributes)
            exchange.fold(self.plan, residuals, self._layout, layout)
            # a new tensor in exact mode with a lossy codec (the exact sum of the gathered payloads)
            total = exchange.sum_over(self.plan, group, total, residuals, stats).div_(r.contributors)
            total = total.to(f.state_device, non_blocking=True)
            master, momentum = outer_step(f.master, f.momentum, total, self.lr, self.momentum_factor, self.nesterov,
                                          self._work.take("master", f.numel, f.state_device),
                                          self._work.take("momentum", f.numel, f.state_device))
            if not bool(torch.isfinite(master.sum())):
                raise _Mismatch(f"flatcomm.elastic: the outer step after inner step {self.step} is not finite "
                                f"(a replica's weights diverged); nothing was committed")
        r.wire_bytes = stats.wire_bytes
        # torchft's step is the same on every member now (a replica behind has healed to it).
        if self.verify_every and (self.manager.current_step() + 1) % self.verify_every == 0:
            exchange.verify(group, [master.cpu(), self._data_tensor()], self.step)
        return master, momentum, residuals, layout, r.contributors > 0, None

    def _report(self, e: Exception) -> None:
        if self.manager.errored() is None:
            self.manager.report_error(e)

    def _gather(self, result):
        """The round's result with the island's whole new master in it (None: this rank's or the
        island's gather failed, reported: torchft's should_commit is then False on every rank of
        the island). A rank whose exchange failed gathers its old master: the others are not kept
        waiting for it, and the island commits nothing anyway."""
        try:
            whole = self.island.gather(self.fragment.master if result is None else result[0], self._quorum.op_timeout)
        except Exception as e:  # noqa: BLE001 - a rank of the island died: the launcher takes the island out
            self._report(e)
            return None
        return None if result is None else (*result[:5], whole)

    def _host_delta(self, contributes: bool) -> torch.Tensor:
        """This part's pseudo-gradient (zeros unless ``contributes``) in a host buffer: the quorum's
        gloo group sums it there (for CUDA parameters, computed on the device, then copied)."""
        f = self.fragment
        host = self._work.take("delta", f.numel, torch.device("cpu"), pin=f.device.type == "cuda")
        if not contributes:
            return host.zero_()
        if f.device.type == "cpu":
            return f.pseudo_gradient(host)
        return host.copy_(f.pseudo_gradient(self._work.take("delta_device", f.numel, f.device)))

    def _commit(self, master, momentum, residuals: List[torch.Tensor], layout, applied: bool,
                whole: Optional[torch.Tensor]) -> None:
        f = self.fragment
        f.commit(master, momentum, residuals if self.plan.feedback else None)
        if whole is not None:
            self.island.write_all(whole)
        else:
            f.set_weights(f.master, 0.0)
        self._layout = layout
        self._trained = False
        self.syncs += int(applied)

    # ---- the data position --------------------------------------------------------------------------

    def _data_snapshot(self) -> Optional[Dict[str, Any]]:
        return None if self.data is None else heal.copy_state(self.data.state_dict())

    def _data_tensor(self) -> torch.Tensor:
        """The data position as bytes (hashed with the master in the round's check: every island is
        at the same inner step, so at the same place of the global stream)."""
        return heal.state_bytes(self._data_snapshot())

    # ---- healing ------------------------------------------------------------------------------------

    def _heal_state(self) -> Dict[str, Any]:
        f = self.fragment
        # the data position goes with the step: both are where this replica's current sync is
        return heal.state(f.master, f.momentum, self.step, self.syncs, self.fingerprint, self._data_snapshot(),
                          self.island.describe()[:2])

    def _load_heal(self, sd: Dict[str, Any]) -> None:
        """This rank's part of the donor island's committed state (the other ranks of the island
        load theirs at the same time); the weights of the other parts arrive with the round's
        island gather. The inner optimizer's state stays this island's own."""
        f = self.fragment
        heal.check(sd, self.fingerprint, f.numel, self.island.describe()[:2])
        if self.data is not None and sd.get("data") is not None:
            self.data.load_state_dict(heal.copy_state(sd["data"]))  # checked by the stream: first
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
        heal.check_checkpoint(sd, self.fingerprint, f.numel, [r.numel() for r in f.residuals],
                              self.island.describe()[:2])
        if self.data is not None and sd.get("data") is not None:
            self.data.load_state_dict(heal.copy_state(sd["data"]))
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

    def shutdown(self) -> bool:
        """Leave: :meth:`close`, wait (the manager's timeout at most) until every rank of the island
        is here, then shut the manager down. Island rank 0's manager answers the island's
        ``should_commit``: a rank 0 that left first could cut another rank's last answer. Returns
        whether the whole island got here."""
        self.close()
        together = self.island.barrier(self._quorum.op_timeout)
        self.manager.shutdown(wait=False)
        return together
