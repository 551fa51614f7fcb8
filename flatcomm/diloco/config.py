"""The checked configuration of a :class:`flatcomm.diloco.DiLoCo`: the same on every replica, and
what a checkpoint must match (:meth:`Config.fingerprint`, :meth:`Config.options`)."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Dict, List

import torch

from ..comm.header import MODES
from ..comm.topology import Topology
from ..ops.codecs import resolve
from . import auto, sync
from .options import Options, check_no_ddp
from .schedule import Schedule, number, split
from .state import Fragment, local_tensor

__all__ = ["Config", "configure"]


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

    def fingerprint(self, with_verify: bool = True) -> int:
        """64-bit hash of the configuration; ``with_verify=False``: of what a checkpoint must match
        (``verify_every`` is a check, not state: it may change at a resume)."""
        p = self.plan
        local = p.topology.local_size if p.two_level else 0
        desc = repr((self.schedule, p.auto if p.auto is not None else p.codec, p.config_mode, _feedback(p), p.world, local, self.lr, self.momentum,
                     self.nesterov, self.alpha) + ((self.verify_every,) if with_verify else ()) +
                    ([(f.names, f.sizes, str(f.residual_dtype)) for f in self.fragments],))
        # Options added later enter only when set, so earlier checkpoints keep their fingerprint.
        if p.codec.chunked and p.auto is None:
            desc += f" keep={p.codec.keep}"
        if p.error_decay != 1.0:
            desc += f" error_decay={p.error_decay!r}"
        return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little")

    def options(self) -> Dict[str, str]:
        """The options a checkpoint must match, as text (a load names those that differ)."""
        p, sch = self.plan, self.schedule
        layout = repr([(f.names, f.sizes) for f in self.fragments]).encode()
        return {"sync_every": str(sch.sync_every), "fragments": str(sch.fragments),
                "fragment_sync_delay": str(sch.delay), "codec": "auto" if p.auto is not None else str(p.codec),
                "mode": p.config_mode,
                "error_feedback": str(_feedback(p)), "replicas": str(p.world),
                "topology local_size": str(p.topology.local_size if p.two_level else 0), "outer_lr": repr(self.lr),
                "outer_momentum": repr(self.momentum), "nesterov": str(self.nesterov),
                "fragment_update_alpha": repr(self.alpha),
                "residual_dtype": str(self.fragments[0].residual_dtype) if self.fragments else "",
                "model layout": hashlib.blake2b(layout, digest_size=8).hexdigest(),
                "codec keep": str(p.codec.keep) if p.codec.chunked and p.auto is None else "-",
                "error_decay": repr(p.error_decay)}


def _feedback(p: sync.Plan) -> bool:
    """Error feedback as configured (with codec="auto", as asked: the choice does not change it)."""
    return p.error_feedback if p.auto is not None else p.feedback


def configure(model: torch.nn.Module, o: Options) -> Config:
    """The checked configuration of ``model`` under options ``o`` (the same on every replica)."""
    sync_every, codec, mode, group, topology = o.sync_every, o.codec, o.mode, o.group, o.topology
    nesterov, error_feedback, residual_dtype, verify_every = o.nesterov, o.error_feedback, o.residual_dtype, o.verify_every
    fragments, delay, alpha, allow_ddp = o.fragments, o.fragment_sync_delay, o.fragment_update_alpha, o.allow_ddp
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flatcomm.diloco: model must be a torch.nn.Module, got {type(model).__name__}")
    check_no_ddp(model, topology.group if isinstance(topology, Topology) else group, allow_ddp)
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise ValueError(f"flatcomm.diloco: mode must be None (by codec and replicas) or one of {MODES}, got {mode!r}")
    knobs = auto.Auto() if isinstance(codec, str) and codec == "auto" else codec if isinstance(codec, auto.Auto) \
        else None
    if knobs is not None:
        knobs.check()
    if knobs is not None and topology is not None:
        raise ValueError("flatcomm.diloco: codec='auto' runs a flat outer sync; drop topology= or name a codec")
    c = auto.PLACEHOLDER if knobs is not None else resolve(codec)
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
    recipe = auto.default_recipe(c)  # what an option left at None takes (codec="auto": DiLoCo's)
    lr = number(recipe.outer_lr if o.outer_lr is None else o.outer_lr, "outer_lr", 0.0, math.inf)
    mu = number(recipe.outer_momentum if o.outer_momentum is None else o.outer_momentum, "outer_momentum",
                0.0, 1.0, hi_open=True)
    decay = number(recipe.error_decay if o.error_decay is None else o.error_decay, "error_decay", 0.0, 1.0)
    a = number(alpha, "fragment_update_alpha", 0.0, 1.0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = sync.Plan(c, mode, group, topology, error_feedback, decay)
    plan.auto = knobs
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
