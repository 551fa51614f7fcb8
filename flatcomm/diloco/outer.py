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
import hashlib
import math
import numbers
import time
from typing import Any, Dict, List, Optional

import torch

from ..comm.header import MODES
from ..comm.topology import Topology
from ..ops.codecs import resolve
from . import checkpoint, replicas, sync
from .schedule import Schedule, split
from .state import Fragment, Workspace, local_tensor, outer_step

__all__ = ["Config", "DiLoCo", "FragmentStats"]


@dataclasses.dataclass
class FragmentStats:
    """One fragment's outer syncs: how many, the bytes this rank put on the wire, the time the
    training loop waited for them (``wait_s``) and from launch to applied (``sync_s``)."""
    syncs: int = 0
    wire_bytes: int = 0
    wait_s: float = 0.0
    sync_s: float = 0.0

    @property
    def bytes_per_sync(self) -> float:
        return self.wire_bytes / self.syncs if self.syncs else 0.0


@dataclasses.dataclass(frozen=True)
class Config:
    """The checked options and the fragments' layout (every replica must have the same)."""
    schedule: Schedule
    plan: sync.Plan
    fragments: List[Fragment]
    lr: float
    momentum: float
    nesterov: bool
    alpha: float
    verify_every: int

    def fingerprint(self) -> int:
        p = self.plan
        local = p.topology.local_size if p.two_level else 0
        desc = repr((self.schedule, p.codec, p.mode, p.feedback, p.world, local, self.lr, self.momentum,
                     self.nesterov, self.alpha, self.verify_every,
                     [(f.names, f.sizes, str(f.residual_dtype)) for f in self.fragments]))
        # Options added later enter only when set, so earlier checkpoints keep their fingerprint.
        if p.codec.chunked:
            desc += f" keep={p.codec.keep}"
        if p.error_decay != 1.0:
            desc += f" error_decay={p.error_decay!r}"
        return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little")


def _number(v: Any, what: str, lo: float, hi: float, hi_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or float(v) < lo \
            or float(v) > hi or (hi_open and float(v) == hi):
        raise ValueError(f"flatcomm.diloco: {what} must be a finite number in [{lo}, {hi}{')' if hi_open else ']'}, "
                         f"got {v!r}")
    return float(v)


def _configure(model, sync_every, codec, mode, outer_lr, outer_momentum, nesterov, fragments, delay, alpha,
               group, error_feedback, residual_dtype, verify_every, topology, error_decay=1.0) -> Config:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flatcomm.diloco: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"flatcomm.diloco: mode must be one of {MODES}, got {mode!r}")
    if isinstance(codec, str) and codec == "auto":
        raise ValueError("flatcomm.diloco: codec='auto' is not supported for the outer sync; name a codec "
                         "(int4 with error feedback is the default)")
    c = resolve(codec)
    for what, v in (("nesterov", nesterov), ("error_feedback", error_feedback)):
        if not isinstance(v, bool):
            raise TypeError(f"flatcomm.diloco: {what} must be True or False, got {v!r}")
    if residual_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"flatcomm.diloco: residual_dtype must be torch.float32 or torch.bfloat16, "
                         f"got {residual_dtype}")
    if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
        raise ValueError(f"flatcomm.diloco: verify_every must be an int >= 0, got {verify_every!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"flatcomm.diloco: topology must be a flatcomm.Topology, got {type(topology).__name__}")
    if topology is not None and group is not None:
        raise ValueError("flatcomm.diloco: pass either group= or topology= (the topology has its own group)")
    schedule = Schedule(sync_every, len(fragments) if isinstance(fragments, (list, tuple)) else fragments, delay)
    lr = _number(outer_lr, "outer_lr", 0.0, math.inf)
    mu = _number(outer_momentum, "outer_momentum", 0.0, 1.0, hi_open=True)
    a = _number(alpha, "fragment_update_alpha", 0.0, 1.0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = sync.Plan(c, mode, group, topology, error_feedback, _number(error_decay, "error_decay", 0.0, 1.0))
    if plan.gathered and plan.two_level:
        raise ValueError("flatcomm.diloco: mode='exact' with a lossy codec runs flat (an all-gather of the "
                         "encoded payloads); drop topology= or use codec='fp32'")
    frags = []
    for i, part in enumerate(split(named, fragments)):
        bad = [x.name for x in part if local_tensor(x.param).dtype not in (torch.float32, torch.bfloat16, torch.float16)]
        if bad:
            raise TypeError(f"flatcomm.diloco: parameter {bad[0]!r} is not a floating-point tensor")
        numel = sum(x.stop - x.start for x in part)
        frags.append(Fragment(i, part, plan.residual_shapes(numel), residual_dtype))
    return Config(schedule, plan, frags, lr, mu, nesterov, a, verify_every)


class DiLoCo:
    """DiLoCo / Streaming DiLoCo outer sync for ``model`` trained by ``inner_optimizer``.

    Every replica (a rank, or a DDP / FSDP2 group whose same-rank members form ``group``) takes
    ``sync_every`` inner steps alone between two syncs of each fragment; the fragment's averaged
    pseudo-gradient (compressed with ``codec`` and error feedback) drives an fp32 outer SGD with
    Nesterov momentum. Construction is a collective of the outer group: a configuration error on
    any replica raises on every replica, and so do replicas that start from different weights.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 codec="int4", mode: str = "ordered", outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: Any = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, group=None, error_feedback: bool = True,
                 residual_dtype: torch.dtype = torch.float32, verify_every: int = 0,
                 topology: Optional[Topology] = None, error_decay: float = 1.0) -> None:
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"flatcomm.diloco: inner_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(inner_optimizer).__name__}")
        self.group = topology.group if isinstance(topology, Topology) else group
        first = next((p for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = local_tensor(first).device if first is not None else torch.device("cpu")
        if self.device.type != "cuda":
            self.device = torch.device("cpu")
        self.config: Config = replicas.agree(
            self.group, self.device, lambda: _configure(
                model, sync_every, codec, mode, outer_lr, outer_momentum, nesterov, fragments, fragment_sync_delay,
                fragment_update_alpha, group, error_feedback, residual_dtype, verify_every, topology, error_decay),
            Config.fingerprint, "the DiLoCo configuration")
        self.fragments = self.config.fragments
        replicas.verify(self.group, self.device, [f.master for f in self.fragments],
                        "the initial weights (seed every replica alike, or load one checkpoint everywhere)")
        self.step = 0  # inner steps taken
        self.syncs = 0  # outer syncs applied (all fragments)
        self.pending: Optional[sync.Pending] = None
        self._work = Workspace()
        self.fragment_stats = [FragmentStats() for _ in self.fragments]
        self._hook = inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_inner_step())

    # ---- the outer loop -----------------------------------------------------------------------------

    def after_inner_step(self) -> None:
        """Count one inner step; start and apply the fragments' syncs due now (the hook calls it)."""
        self.step += 1
        sch = self.config.schedule
        if self.pending is not None and sch.applies(self.step) == self.pending.fragment:
            self._apply()
        i = sch.starts(self.step)
        if i is not None:
            f, w = self.fragments[i], self._work
            delta = f.pseudo_gradient(w.take("delta", f.numel, f.device))
            self.pending = sync.launch(self.config.plan, i, self.step, delta, f.residual_copies(w))
            if sch.delay == 0:
                self._apply()

    def _apply(self) -> None:
        p, cfg = self.pending, self.config
        assert p is not None  # (called only with a sync pending)
        f, st = self.fragments[p.fragment], self.fragment_stats[p.fragment]
        try:
            delta = p.wait(cfg.plan.world).to(f.state_device)
            pin = f.master.is_pinned()
            master, momentum = outer_step(f.master, f.momentum, delta, cfg.lr, cfg.momentum, cfg.nesterov,
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
        f.set_weights(f.master, cfg.alpha)
        self.syncs += 1
        st.syncs += 1
        st.wire_bytes += p.stats.wire_bytes
        st.sync_s += time.perf_counter() - p.launched
        if cfg.verify_every and self.syncs % cfg.verify_every == 0:
            self.verify()

    def drain(self) -> None:
        """Wait for a fragment's all-reduce in flight; its result stays held, applied on schedule."""
        if self.pending is not None and not self.pending.finished:
            try:
                self.pending.wait(self.config.plan.world)
            except BaseException:
                self.pending = None  # that sync failed: nothing of it will be applied
                raise

    def verify(self) -> int:
        """Compare the replicas' fp32 masters now (a collective); returns the 64-bit hash."""
        return replicas.verify(self.group, self.device, [f.master for f in self.fragments],
                               f"the fp32 master after {self.syncs} outer syncs")

    def close(self) -> None:
        """Remove the hook from the inner optimizer (a sync in flight is waited for first)."""
        self.drain()
        self._hook.remove()

    # ---- stats and checkpoints ----------------------------------------------------------------------

    @property
    def stats(self) -> Dict[str, Any]:
        fs = self.fragment_stats
        return {"syncs": self.syncs, "inner_steps": self.step, "wire_bytes": sum(s.wire_bytes for s in fs),
                "wait_s": sum(s.wait_s for s in fs), "fragments": [dataclasses.asdict(s) | {
                    "bytes_per_sync": s.bytes_per_sync, "numel": f.numel} for s, f in zip(fs, self.fragments)]}

    def state_dict(self) -> Dict[str, Any]:
        """Everything to resume bit for bit (a sync in flight is drained into it); see
        :mod:`flatcomm.diloco.checkpoint`."""
        return checkpoint.state_dict(self)

    def check_state_dict(self, sd: Dict[str, Any]) -> None:
        """Raise as :meth:`load_state_dict` would for ``sd`` on this replica; changes nothing."""
        checkpoint.check_state_dict(self, sd)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Load on every replica or on none (a collective of the outer group)."""
        checkpoint.load_state_dict(self, sd)
