"""The :class:`DiLoCo` outer loop: a post-step hook on the inner optimizer that syncs fragments.

After inner step ``t`` (see :mod:`flatcomm.diloco.schedule` for which fragment and when) the hook
starts a fragment's outer all-reduce of its pseudo-gradient (:mod:`flatcomm.diloco.sync`) and,
``fragment_sync_delay`` steps later (at once without delay), applies it: torch SGD's (Nesterov)
update on the fp32 master (:mod:`flatcomm.diloco.state`), then the parameters are set from the
master (mixed with the local weights by ``fragment_update_alpha``). Every ``verify_every`` syncs
the replicas' masters are compared by hash (:mod:`flatcomm.diloco.replicas`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional, cast

import torch

from .._snapshot import Snapshot
from ..comm.labels import label
from ..comm.topology import Topology
from . import auto, checkpoint, replicas, sync
from .config import Config, configure
from .options import Options
from .state import Workspace, local_tensor, outer_step

__all__ = ["Config", "DiLoCo", "FragmentStats", "Options"]


@dataclasses.dataclass
class FragmentStats:
    """One fragment's outer syncs: how many, the bytes this rank put on the wire, the time the
    training loop waited for them (``wait_s``) and from launch to applied (``sync_s``)."""
    syncs: int = 0
    wire_bytes: int = 0
    wait_s: float = 0.0
    sync_s: float = 0.0

    @property
    def bytes_per_sync(self) -> int:
        """Bytes this rank sent per sync of this fragment (each sends the same; 0 before the first)."""
        return round(self.wire_bytes / self.syncs) if self.syncs else 0


class DiLoCo:
    """DiLoCo / Streaming DiLoCo outer sync for ``model`` trained by ``inner_optimizer``.

    Every replica (a rank, or a DDP / FSDP2 group whose same-rank members form ``group``) takes
    ``sync_every`` inner steps alone between two syncs of each fragment; the fragment's averaged
    pseudo-gradient (compressed with ``codec`` and error feedback) drives an fp32 outer SGD with
    Nesterov momentum. Construction is a collective of the outer group: a configuration error on
    any replica raises on every replica, and so do replicas that start from different weights.
    A ``DistributedDataParallel`` over ``model`` whose process group spans several replicas is
    refused (its all-reduce would run at every inner step) unless ``allow_ddp=True`` (for a DDP
    whose comm hook keeps the local gradient, as the framework adapters register).

    Args:
        model: the module the replicas train (its parameters that require a gradient are synced).
        inner_optimizer: the optimizer of the inner steps; DiLoCo hooks its ``step()``.
        sync_every: inner steps between two syncs of a fragment (H).
        codec: the pseudo-gradient's codec on the wire (default ``"int4"``); ``"auto"`` (or a
            :class:`flatcomm.diloco.auto.Auto`) picks, at the first sync, the densest codec whose
            sync fits the measured link and inner step (:mod:`flatcomm.diloco.auto`).
        mode: ``"ordered"`` (the two-stage sum, in rank order), ``"exact"`` (bits independent of the
            replicas' order; a lossy codec's payloads are all-gathered) or None (default): ``"exact"``
            for a chunked sparse codec on a flat group of up to 4 replicas, else ``"ordered"``
            (:func:`flatcomm.diloco.sync.default_mode`, as the frontier measured).
        outer_lr: the outer SGD's learning rate (default: 0.7, and 2.0 for a chunked sparse codec).
        outer_momentum: its momentum in [0, 1) (default: 0.9, and 0 for a chunked sparse codec).
        nesterov: Nesterov momentum (default True).
        fragments: how many fragments (Streaming DiLoCo) or a list of parameter-name lists.
        fragment_sync_delay: inner steps between a fragment's send and its apply (overlap).
        fragment_update_alpha: the local weights' share when a fragment is applied (0: the master).
        group: the outer group, one rank per replica (default: the world).
        error_feedback: keep the codec's residuals (default True).
        residual_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` residuals.
        verify_every: compare the replicas' masters every this many syncs (0: never).
        topology: a :class:`flatcomm.Topology` for a two-level outer sync (instead of ``group``).
        allow_ddp: accept a DDP over ``model`` that spans replicas (its hook must keep gradients local).
        error_decay: the residual's decay per sync in [0, 1] (default: 1, kept whole; 0.95 for a
            chunked sparse codec). Left at None, the three take the codec's recipe
            (:func:`flatcomm.diloco.auto.default_recipe`: SparseLoCo's for ``sparse``, ``sparse4``
            and ``sparse1``, as the frontier ran them; DiLoCo's for the others).
        manager: refused (a torchft Manager belongs to :class:`flatcomm.elastic.ElasticDiLoCo`, whose
            replicas may die, rejoin and heal); the error says so.

    Example::

        >>> model = torch.nn.Linear(16, 16)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> outer = flatcomm.diloco.DiLoCo(model, opt, sync_every=100, codec="int4")
        >>> for x in batches:  # every replica alone; a sync after every 100 steps
        ...     opt.zero_grad(); model(x).sum().backward(); opt.step()
        >>> outer.stats.wire_bytes, outer.stats["syncs"]
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 codec="int4", mode: Optional[str] = None, outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None,
                 nesterov: bool = True, fragments: Any = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, group=None, error_feedback: bool = True,
                 residual_dtype: torch.dtype = torch.float32, verify_every: int = 0,
                 topology: Optional[Topology] = None, allow_ddp: bool = False,
                 error_decay: Optional[float] = None, manager: Any = None) -> None:
        if manager is not None:  # a torchft Manager: the replicas change between syncs
            raise ValueError(
                "flatcomm.diloco: DiLoCo runs on a fixed process group and takes no torchft manager; for replicas "
                "that die, restart and heal use flatcomm.elastic.ElasticDiLoCo(model, opt, manager=manager, "
                "sync_every=...) (docs/elastic.md). The framework adapters and flatcomm.rank_states work with DiLoCo only")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"flatcomm.diloco: inner_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(inner_optimizer).__name__}")
        self.group = topology.group if isinstance(topology, Topology) else group
        first = next((p for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = local_tensor(first).device if first is not None else torch.device("cpu")
        if self.device.type != "cuda":
            self.device = torch.device("cpu")
        options = Options(sync_every, codec, mode, outer_lr, outer_momentum, nesterov, fragments,
                          fragment_sync_delay, fragment_update_alpha, group, error_feedback, residual_dtype,
                          verify_every, topology, allow_ddp, error_decay)
        self.config: Config = replicas.agree(
            self.group, self.device, lambda: configure(model, options),
            Config.fingerprint, "the DiLoCo configuration")
        self.fragments = self.config.fragments
        replicas.verify(self.group, self.device, [f.master for f in self.fragments],
                        "the initial weights (seed every replica alike, or load one checkpoint everywhere)")
        self.step = 0  # inner steps taken
        self.syncs = 0  # outer syncs applied (all fragments)
        self.pending: Optional[sync.Pending] = None
        # inner step of the last finish(): every weight was its master then (saved by checkpoints)
        self.finished_at = 0
        self._work = Workspace()
        self.fragment_stats = [FragmentStats() for _ in self.fragments]
        # codec="auto": its choice (None until the first sync), the recipe it runs in place of the
        # configured one (a sparse codec's, or None) and the clock of the steps before it
        self.auto_choice: Optional[auto.Choice] = None
        self.recipe: Optional[auto.Recipe] = None
        self._clock = auto.StepClock()
        replicas.announce()  # where this replica runs: a failed sync names the replicas that exited
        self._hook = inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_inner_step())

    # ---- the outer loop -----------------------------------------------------------------------------

    def after_inner_step(self) -> None:
        """Count one inner step; start and apply the fragments' syncs due now (the hook calls it)."""
        self.step += 1
        self._clock.tick()
        sch = self.config.schedule
        if self.pending is not None and sch.applies(self.step) == self.pending.fragment:
            self._apply()
        i = sch.starts(self.step)
        if i is not None:
            self._launch(i)
            if sch.delay == 0:
                self._apply()

    def _launch(self, i: int) -> None:
        f, w, plan = self.fragments[i], self._work, self.config.plan
        if plan.auto is not None and self.auto_choice is None:
            self._choose_codec()
        with label("flatcomm.diloco.sync_start"):  # the pseudo-gradient and its all-reduce launched
            delta = f.pseudo_gradient(w.take("delta", f.numel, f.device))
            self.pending = sync.launch(plan, i, self.step, delta, f.residual_copies(w) if plan.feedback else [])

    def _choose_codec(self) -> None:
        """``codec="auto"``: measure (the replicas agree on the numbers), choose, record."""
        plan, sch = self.config.plan, self.config.schedule
        knobs = cast(auto.Auto, plan.auto)  # (called only for codec="auto")
        with label("flatcomm.diloco.auto"):
            step_s, latency_s, bytes_per_s = auto.measure(self.group, self.device, plan.world, self._clock.step_s(),
                                                          knobs)
        self.take_choice(auto.choose(
            numel=max(f.numel for f in self.fragments), fragments=len(self.fragments), world=plan.world,
            gathered=plan.gathers, sync_every=sch.sync_every, delay=sch.delay, step_s=step_s,
            latency_s=latency_s, bytes_per_s=bytes_per_s, auto=knobs))

    def take_choice(self, choice: Optional[auto.Choice]) -> None:
        """Sync as ``codec="auto"``'s ``choice`` says from the next sync on (None: not chosen yet)."""
        plan = self.config.plan
        self.auto_choice, self.recipe = choice, auto.recipe_of(plan.auto, choice)
        plan.set_codec(choice.to_codec() if choice is not None else auto.PLACEHOLDER,
                       self.recipe.error_decay if self.recipe is not None else None)

    def finish(self) -> None:
        """Bring every replica to the same weights now, for saving or evaluating the model (a
        collective of the outer group: call it on every replica at the same inner step).

        A sync in flight is applied now (not ``fragment_sync_delay`` steps later; the fragment's
        inner steps since it started are dropped, as when it is applied on schedule); every fragment
        with inner steps since its last sync syncs now (one outer step each, in fragment order, as
        if its sync were due); then every parameter is set to its fragment's fp32 master (rounded
        to its dtype; ``fragment_update_alpha`` is not applied), the same bits on every replica.
        Calling it again at the same inner step does nothing. Training may continue afterwards:
        the schedule goes on from this inner step (the next scheduled syncs start from the new
        masters); the extra outer steps count in :attr:`syncs`."""
        fresh = set()
        if self.pending is not None:  # the inner steps since it started are dropped, as on schedule
            fresh.add(self.pending.fragment)
            self._apply(alpha=0.0)
        if self.finished_at == self.step:
            return
        for i, f in enumerate(self.fragments):
            if i not in fresh and self._last_applied(i) < self.step:
                self._launch(i)
                self._apply(alpha=0.0)
            else:
                f.set_weights(f.master, 0.0)
        self.finished_at = self.step

    def _last_applied(self, i: int) -> int:
        """The inner step after which fragment ``i``'s weights were last set from its master."""
        sch = self.config.schedule
        t = self.step
        while t > self.finished_at and sch.applies(t) != i:
            t -= 1
        return t

    def _apply(self, alpha: Optional[float] = None) -> None:
        with label("flatcomm.diloco.outer_step"):  # wait for the all-reduce, then the outer SGD step
            self._outer_step(alpha)

    def _outer_step(self, alpha: Optional[float]) -> None:
        p, cfg = self.pending, self.config
        assert p is not None  # (called only with a sync pending)
        f, st = self.fragments[p.fragment], self.fragment_stats[p.fragment]
        try:
            delta = self._wait(p).to(f.state_device)
            pin = f.master.is_pinned()
            lr, mu = (self.recipe.outer_lr, self.recipe.outer_momentum) if self.recipe else (cfg.lr, cfg.momentum)
            master, momentum = outer_step(f.master, f.momentum, delta, lr, mu, cfg.nesterov,
                                          self._work.take("master", f.numel, f.state_device, pin),
                                          self._work.take("momentum", f.numel, f.state_device, pin))
            # A sum is non-finite when any value is (or the weights near 3e38): one pass, no mask.
            if not bool(torch.isfinite(master.sum())):
                raise FloatingPointError(
                    f"flatcomm.diloco: fragment {p.fragment}'s outer step at inner step {self.step} is not finite "
                    f"(a replica's weights diverged); master, momentum and residuals are left as before")
        finally:
            self.pending = None
            st.wait_s += p.waited_s
        f.commit(master, momentum, p.residuals if cfg.plan.feedback else None)
        f.set_weights(f.master, cfg.alpha if alpha is None else alpha)
        self.syncs += 1
        st.syncs += 1
        st.wire_bytes += p.stats.wire_bytes
        st.sync_s += time.perf_counter() - p.launched
        if cfg.verify_every and self.syncs % cfg.verify_every == 0:
            self.verify()

    def _wait(self, p: sync.Pending) -> torch.Tensor:
        """``p``'s result; a failure of the collective names the sync and the replicas that exited."""
        try:
            return p.wait(self.config.plan.world)
        except (RuntimeError, TimeoutError) as e:  # gloo's / NCCL's / a timeout: say what it was
            gone, saving = replicas.exited(self.group), replicas.saves_ahead(self.group)
            who = (f"replica(s) {saving} entered a checkpoint save (flatcomm.rank_states) that this replica never "
                   f"called: a framework's save must be called on every rank (Accelerate: save_state on every "
                   f"rank, not under `if accelerator.is_main_process`)" if saving else
                   f"replica(s) {gone} of the outer group exited" if gone else
                   f"a replica of the outer group ({self.config.plan.world} replicas) stopped, left or did not "
                   f"reach this sync within the group's timeout")
            raise RuntimeError(
                f"flatcomm.diloco: the outer sync of fragment {p.fragment} started after inner step {p.started} "
                f"(outer sync {self.syncs + 1}) failed: {who}. Master, momentum, residuals and weights are as "
                f"before it; restart every replica from the last checkpoint. ({type(e).__name__}: {e})") from e

    def drain(self) -> None:
        """Wait for a fragment's all-reduce in flight; its result stays held, applied on schedule."""
        if self.pending is not None and not self.pending.finished:
            try:
                self._wait(self.pending)
            except BaseException:
                self.pending = None  # that sync failed: nothing of it will be applied
                raise

    def verify(self) -> int:
        """Compare the replicas' fp32 masters now (a collective); returns the 64-bit hash."""
        with label("flatcomm.diloco.verify"):
            return replicas.verify(self.group, self.device, [f.master for f in self.fragments],
                                   f"the fp32 master after {self.syncs} outer syncs")

    def close(self) -> None:
        """Remove the hook from the inner optimizer (a sync in flight is waited for first)."""
        self.drain()
        self._hook.remove()

    # ---- stats and checkpoints ----------------------------------------------------------------------

    @property
    def stats(self) -> Snapshot:
        """A read-only :class:`flatcomm.stats.Snapshot` (``source="diloco"``): ``calls`` the
        fragments' outer all-reduces, ``wire_bytes`` this rank sent, ``exchange_s`` the time the
        training loop waited for them; keys ``syncs``, ``inner_steps``, ``wire_bytes``, ``wait_s``
        and per fragment ``fragments``."""
        fs = self.fragment_stats
        wire, wait = sum(s.wire_bytes for s in fs), sum(s.wait_s for s in fs)
        detail = {"syncs": self.syncs, "inner_steps": self.step, "wire_bytes": wire, "wait_s": wait,
                  "auto": self.auto_choice.as_dict() if self.auto_choice is not None else None,
                  "fragments": [dataclasses.asdict(s) | {"bytes_per_sync": s.bytes_per_sync, "numel": f.numel}
                                for s, f in zip(fs, self.fragments)]}
        return Snapshot("diloco", calls=sum(s.syncs for s in fs), wire_bytes=wire, exchange_s=wait, detail=detail)

    def state_dict(self) -> Dict[str, Any]:
        """Everything to resume bit for bit (a sync in flight is drained into it); see
        :mod:`flatcomm.diloco.checkpoint`."""
        return checkpoint.state_dict(self)

    def check_state_dict(self, sd: Dict[str, Any], replica: Optional[int] = None) -> None:
        """Raise as :meth:`load_state_dict` would for ``sd`` on this replica (or as replica
        ``replica``'s own state); changes nothing."""
        checkpoint.check_state_dict(self, sd, replica)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Load on every replica or on none (a collective of the outer group)."""
        checkpoint.load_state_dict(self, sd)
