"""1-bit-Adam-style optimizer: lossless Adam while the variance forms, then compressed momentum.

Tang et al. 2021 ("1-bit Adam: communication efficient large-scale training with Adam's convergence
speed"; DeepSpeed's ``OnebitAdam``) observed that Adam's second moment settles after a warm-up, and
that compressing the *momentum* of a frozen-variance Adam with error feedback converges like Adam,
while compressing the gradients that feed Adam's variance does not (docs/benchmarks.md, Convergence).

:class:`OnebitAdam` (AdamW's math: decoupled weight decay, bias corrections) runs in two phases:

* **warm-up** (the first ``warmup_steps`` steps): plain AdamW on the gradients DDP averaged in fp32;
  its update is the same as ``torch.optim.AdamW``'s, bit for bit (same operations in the same order).
* **compressed** (every step after): the variance ``exp_avg_sq`` stays frozen; each rank updates
  the momentum from its *local* gradient, ``m_r = beta1 * m + (1 - beta1) * g_r``, and the momenta
  of a parameter group are averaged by one flatcomm all-reduce of a flat fp32 tensor with ``codec``
  (sign by default) and a persistent :class:`flatcomm.ErrorFeedback` per group (client and server
  residuals: what a step did not send is sent later). Because ``m`` is identical on every rank, the
  average is ``beta1 * m + (1 - beta1) * mean(g)`` plus the codec's error. Every rank then holds the
  same bits of ``m`` (flatcomm's all-reduce ends identical everywhere), and the update is
  ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^T) + eps)`` with ``T = warmup_steps``
  (the variance's bias correction frozen with it), so the weights stay identical on every rank.

**Variance floor.** A coordinate that had no gradient during the warm-up (a dead ReLU unit, a token
not yet seen: 3-6% of some tensors after 20 steps in the convergence workloads) froze with ``v = 0``;
a later gradient there would be divided by ``eps`` alone, and the run diverges (even with fp32
momentum). At the freeze every parameter's ``v`` is raised to at least ``variance_floor`` times its
mean over that parameter (over its group for a parameter that had no gradient at all), so such
coordinates take a typical step.

``space="update"`` sends ``m_r / d`` instead, with ``d = sqrt(v) / sqrt(1 - beta2^T) + eps`` the
frozen (identical on every rank) divisor: the same average, but the codec's error, which a
blockwise codec spreads at the block's magnitude, then falls on Adam's update rather than on the
momentum, where a coordinate with a small variance would multiply it by ``1 / d``. The residuals
live in that space (fixed while the variance is frozen); ``m`` is recovered as ``u * d``.

**Usage.** The DDP model must average gradients during the warm-up and must NOT reduce them once
the compressed phase starts: :func:`register` installs :func:`hook`, which is torch's default
all-reduce hook during the warm-up and returns the local gradient untouched afterwards::

    ddp = DistributedDataParallel(model)
    opt = flatcomm.optim.OnebitAdam(ddp.parameters(), lr=1e-3, warmup_steps=100)
    flatcomm.optim.register(ddp, opt)     # (without it: right results, but fp32 gradients sent too)
    for x, y in data:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()     # warm-up: averaged gradients; then: local ones
        opt.step()                        # compressed phase: one all-reduce of the momentum per group

Every rank must call ``step()`` with the same parameter groups (the all-reduce is a collective). A
parameter without a gradient counts as a zero gradient in the compressed phase (every rank sends
the same layout); in the warm-up it is skipped, as torch does. Parameters must be fp32 and dense.
Checkpoints: :meth:`OnebitAdam.state_dict` holds the moments, the step count and each group's
residuals (loaded at the same world size, codec and group sizes only: residuals follow the shards).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives as C
from ._snapshot import Snapshot
from ._training.checks import register_ddp_hook
from .ops.codecs import Codec, resolve

__all__ = ["OnebitAdam", "hook", "register"]

STATE_KEY = "flatcomm_onebit"  # the extra entry of OnebitAdam.state_dict()


def _check_number(name: str, v: Any, lo: float, hi: float, hi_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo \
            or (v >= hi if hi_open else v > hi):
        raise ValueError(f"flatcomm.optim: {name} must be a finite number in [{lo}, {hi}{')' if hi_open else ']'}, got {v!r}")
    return float(v)


class OnebitAdam(torch.optim.Optimizer):
    """AdamW with fp32 warm-up, then error-feedback-compressed momentum and frozen variance.

    Args:
        params: parameters or parameter groups (fp32, dense), the same on every rank.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        warmup_steps: steps of plain AdamW (>= 1: the variance is frozen from them).
        codec: the momentum's codec: ``"sign"`` (default), ``"int4"``, ``"int8"``, ... or a
            :class:`flatcomm.Codec` (``"auto"`` is not accepted: every step must use one codec).
        block_size: the codec's block size (default: the codec's own).
        error_feedback: keep the residuals (off only to measure what they are worth).
        group: process group of the all-reduce (default: the world; flatcomm uses its private copy).
        chunks: pipeline chunks per all-reduce (default: automatic).
        space: ``"momentum"`` (default, the paper's) or ``"update"``: what the codec compresses (see
            the module docstring).
        variance_floor: at the freeze, each parameter's ``exp_avg_sq`` is raised to at least this
            fraction of its mean (0 keeps it as it is; see the module docstring).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, warmup_steps: int = 100, codec: Any = "sign",
                 block_size: Optional[int] = None, error_feedback: bool = True, group=None,
                 chunks: Optional[int] = None, space: str = "momentum", variance_floor: float = 0.01):
        _check_number("lr", lr, 0.0, math.inf, hi_open=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"flatcomm.optim: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            _check_number(f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
        _check_number("eps", eps, 0.0, math.inf, hi_open=True)
        _check_number("weight_decay", weight_decay, 0.0, math.inf, hi_open=True)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"flatcomm.optim: warmup_steps must be an int >= 1 (the frozen variance is "
                             f"built in them), got {warmup_steps!r}")
        if isinstance(codec, str) and codec == "auto":
            raise ValueError("flatcomm.optim: codec='auto' is not supported; name a codec (sign, int4, int8, ...)")
        if not isinstance(codec, (str, Codec)):
            raise TypeError(f"flatcomm.optim: codec must be a codec name or a flatcomm.Codec, got {codec!r}")
        self.codec: Codec = resolve(codec, block_size)
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"flatcomm.optim: chunks must be an int >= 1 or None, got {chunks!r}")
        if space not in ("momentum", "update"):
            raise ValueError(f"flatcomm.optim: space must be 'momentum' or 'update', got {space!r}")
        self.space, self.variance_floor = space, _check_number("variance_floor", variance_floor, 0.0, 1.0)
        defaults = dict(lr=lr, betas=tuple(float(b) for b in betas), eps=float(eps),
                        weight_decay=float(weight_decay))
        super().__init__(params, defaults)
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                if p.dtype != torch.float32 or p.is_sparse:
                    raise TypeError(f"flatcomm.optim: parameter {pi} of group {gi} is {p.dtype}"
                                    f"{' sparse' if p.is_sparse else ''}; OnebitAdam needs dense fp32 parameters")
        self.warmup_steps = warmup_steps
        self.error_feedback = bool(error_feedback) and not self.codec.lossless
        self.chunks, self._group_arg, self._comm_group = chunks, group, None
        self._ddp_group: Any = None  # register(): DDP's group, where the warm-up averages gradients
        self.steps_done = 0
        self._residuals: List[Optional[C.ErrorFeedback]] = []
        self.last_wire_bytes = 0  # bytes this rank sent in the last compressed step's all-reduces
        self._stats = C.CommStats()  # all the compressed steps' all-reduces (read: .stats)

    @property
    def compressing(self) -> bool:
        """True after the warm-up: the next step sends compressed momentum (the DDP hook leaves grads local)."""
        return self.steps_done >= self.warmup_steps

    @property
    def stats(self) -> Snapshot:
        """This rank's compressed-phase all-reduces so far (a :class:`flatcomm.stats.Snapshot`)."""
        return Snapshot.of("optim", self._stats, {"last_wire_bytes": self.last_wire_bytes})

    def _group(self):
        if self._comm_group is None:
            self._comm_group = C.private_group(self._group_arg)
        return self._comm_group

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compressing:
            self._compressed_step()
        else:
            self._warmup_step()
        self.steps_done += 1
        return loss

    def _state_of(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _warmup_step(self) -> None:
        # torch.optim.AdamW's single-tensor path (what it runs on CPU), operation for operation.
        for g in self.param_groups:
            lr, (b1, b2), eps, wd = float(g["lr"]), g["betas"], g["eps"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("flatcomm.optim: OnebitAdam does not take sparse gradients")
                st = self._state_of(p)
                st["step"] += 1
                t = st["step"].item()
                if wd != 0:
                    p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                bc1 = 1 - b1 ** t
                bc2 = 1 - b2 ** t
                denom = (st["exp_avg_sq"].sqrt() / bc2 ** 0.5).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-(lr / bc1))

    def _residual(self, gi: int, n: int, device) -> Optional[C.ErrorFeedback]:
        if not self.error_feedback:
            return None
        while len(self._residuals) <= gi:
            self._residuals.append(None)
        r = self._residuals[gi]
        if r is None or r.client.numel() != n:
            if r is not None:
                raise ValueError(f"flatcomm.optim: parameter group {gi} changed size ({r.client.numel()} -> {n} "
                                 "values) in the compressed phase; its residual no longer fits")
            r = self._residuals[gi] = C.ErrorFeedback.zeros(n, device)
        return r

    def _freeze(self) -> None:
        """The first compressed step: floor each parameter's variance (the same on every rank)."""
        if self.variance_floor == 0:
            return
        for g in self.param_groups:
            vs = [self._state_of(p)["exp_avg_sq"] for p in g["params"]]
            n = sum(v.numel() for v in vs)
            # a parameter without any gradient in the warm-up takes its group's mean
            group_mean = sum(float(v.double().sum()) for v in vs) / n if n else 0.0
            for v in vs:
                if v.numel():
                    mean = float(v.mean())
                    v.clamp_(min=self.variance_floor * (mean if mean > 0 else group_mean))

    def _compressed_step(self) -> None:
        if self.steps_done == self.warmup_steps:
            self._freeze()
        group = self._group()
        sent_before = self._stats.wire_bytes
        for gi, g in enumerate(self.param_groups):
            params = g["params"]
            if not params:
                continue
            lr, (b1, b2), eps, wd = float(g["lr"]), g["betas"], g["eps"], g["weight_decay"]
            states = [self._state_of(p) for p in params]
            for p, st in zip(params, states):
                if p.grad is not None and p.grad.is_sparse:
                    raise TypeError("flatcomm.optim: OnebitAdam does not take sparse gradients")
                st["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                # the local momentum; a missing gradient is a zero one (the same layout on every rank)
                if p.grad is not None:
                    st["exp_avg"].lerp_(p.grad, 1 - b1)
                else:
                    st["exp_avg"].mul_(b1)
            bc2_sqrt = (1 - b2 ** self.warmup_steps) ** 0.5  # the variance froze after warmup_steps
            denoms = [(st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps) for st in states]
            if self.space == "update":
                flat = torch.cat([(st["exp_avg"] / d).reshape(-1) for st, d in zip(states, denoms)])
            else:
                flat = torch.cat([st["exp_avg"].reshape(-1) for st in states])
            C.all_reduce(flat, codec=self.codec, op="avg", mode="ordered", group=group,
                         residual=self._residual(gi, flat.numel(), flat.device), chunks=self.chunks,
                         stats=self._stats)
            o = 0
            for p, st, d in zip(params, states, denoms):
                m = st["exp_avg"]
                part = flat[o:o + m.numel()].view_as(m)
                o += m.numel()
                bc1 = 1 - b1 ** st["step"].item()
                if self.space == "update":
                    torch.mul(part, d, out=m)
                    p.add_(part, alpha=-(lr / bc1))
                else:
                    m.copy_(part)
                    p.addcdiv_(m, d, value=-(lr / bc1))
        self.last_wire_bytes = self._stats.wire_bytes - sent_before

    # ---- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        world = dist.get_world_size(self._group_arg) if dist.is_initialized() else 1
        sd[STATE_KEY] = {
            "steps_done": self.steps_done, "warmup_steps": self.warmup_steps, "codec": self.codec.name,
            "block_size": self.codec.block_size, "world_size": world, "space": self.space,
            "variance_floor": self.variance_floor,
            "residuals": [None if r is None else {"client": r.client.clone(), "server": r.server.clone()}
                          for r in self._residuals],
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Transactional: flatcomm's entry and torch's per-parameter state are checked in full
        (types, sizes, finite values, counters) before anything is installed, so a load that
        raises leaves the optimizer exactly as it was."""
        if not isinstance(state_dict, dict) or STATE_KEY not in state_dict:
            raise ValueError(f"flatcomm.optim: not an OnebitAdam state_dict (no {STATE_KEY!r} entry)")
        sd = dict(state_dict)
        extra = sd.pop(STATE_KEY)
        if not isinstance(extra, dict):
            raise TypeError(f"flatcomm.optim: state_dict[{STATE_KEY!r}] must be a dict, got {type(extra).__name__}")
        steps_done, restored = self._read_extra(extra)
        self._check_torch_state(sd)
        super().load_state_dict(sd)  # torch checks the groups before it replaces anything
        self.steps_done = steps_done
        self._residuals = restored

    def _read_extra(self, extra: Dict[str, Any]) -> Tuple[int, List[Optional[C.ErrorFeedback]]]:
        for field in ("steps_done", "warmup_steps", "codec", "block_size", "world_size", "residuals"):
            if field not in extra:
                raise ValueError(f"flatcomm.optim: state_dict[{STATE_KEY!r}] lacks {field!r}")
        for field in ("steps_done", "warmup_steps", "block_size", "world_size"):
            v = extra[field]
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if field == "steps_done" else 1):
                raise ValueError(f"flatcomm.optim: checkpoint {field!r} must be an int >= "
                                 f"{0 if field == 'steps_done' else 1}, got {v!r}")
        if "variance_floor" in extra:
            _check_number("checkpoint variance_floor", extra["variance_floor"], 0.0, 1.0)
        if (extra["codec"], extra["block_size"]) != (self.codec.name, self.codec.block_size):
            raise ValueError(f"flatcomm.optim: checkpoint codec {extra['codec']} (block {extra['block_size']}) "
                             f"!= this optimizer's {self.codec.name} (block {self.codec.block_size})")
        if extra.get("space", "momentum") != self.space:
            raise ValueError(f"flatcomm.optim: checkpoint space {extra.get('space')!r} != {self.space!r}: the "
                             "residuals are in that space")
        if extra["warmup_steps"] != self.warmup_steps:
            raise ValueError(f"flatcomm.optim: checkpoint warmup_steps {extra['warmup_steps']} != "
                             f"{self.warmup_steps}: the frozen variance's bias correction depends on it")
        world = dist.get_world_size(self._group_arg) if dist.is_initialized() else 1
        residuals = extra["residuals"]
        if not isinstance(residuals, list):
            raise TypeError(f"flatcomm.optim: checkpoint residuals must be a list, got {type(residuals).__name__}")
        if any(r is not None for r in residuals) and extra["world_size"] != world:
            raise ValueError(f"flatcomm.optim: checkpoint residuals were saved at world size "
                             f"{extra['world_size']}, this run has {world}: the server residuals belong "
                             "to that shard layout")
        if len(residuals) > len(self.param_groups):
            raise ValueError(f"flatcomm.optim: checkpoint has residuals of {len(residuals)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        restored: List[Optional[C.ErrorFeedback]] = []
        for gi, r in enumerate(residuals):
            if r is None:
                restored.append(None)
                continue
            if not isinstance(r, dict):
                raise TypeError(f"flatcomm.optim: residuals of group {gi} must be a dict (client, server), got {r!r}")
            n = sum(p.numel() for p in self.param_groups[gi]["params"])
            dev = self.param_groups[gi]["params"][0].device
            parts = []
            for k in ("client", "server"):
                t = r.get(k)
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != n:
                    got = (t.dtype, t.numel()) if isinstance(t, torch.Tensor) else t
                    raise ValueError(f"flatcomm.optim: residual {k!r} of group {gi} must be an fp32 tensor of "
                                     f"{n} values, got {got}")
                if not torch.isfinite(t).all():
                    raise ValueError(f"flatcomm.optim: residual {k!r} of group {gi} is not finite")
                parts.append(t.detach().to(dev).clone().reshape(-1))
            restored.append(C.ErrorFeedback(*parts))
        return int(extra["steps_done"]), restored

    def _check_torch_state(self, sd: Dict[str, Any]) -> None:
        """torch's part: per parameter a step and two moments of the parameter's shape, finite
        (torch would install moments of any shape, and the next step would fail or go NaN)."""
        groups = sd.get("param_groups")
        state = sd.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise TypeError("flatcomm.optim: a state_dict has 'state' (a dict) and 'param_groups' (a list)")
        if len(groups) != len(self.param_groups) or any(
                not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(mine["params"])
                for g, mine in zip(groups, self.param_groups)):
            raise ValueError("flatcomm.optim: the checkpoint's parameter groups do not match this optimizer's")
        shape_of = {pid: p.shape for g, mine in zip(groups, self.param_groups) for pid, p in zip(g["params"], mine["params"])}
        for pid, st in state.items():
            if pid not in shape_of:
                raise ValueError(f"flatcomm.optim: checkpoint state for parameter {pid!r}, which no group lists")
            if not isinstance(st, dict):
                raise TypeError(f"flatcomm.optim: checkpoint state of parameter {pid} must be a dict")
            for k in ("exp_avg", "exp_avg_sq"):
                t = st.get(k)
                if not isinstance(t, torch.Tensor) or t.shape != shape_of[pid] or not t.is_floating_point() \
                        or not torch.isfinite(t).all():
                    raise ValueError(f"flatcomm.optim: checkpoint {k!r} of parameter {pid} must be a finite float "
                                     f"tensor of shape {tuple(shape_of[pid])}")
            step = st.get("step")
            if not isinstance(step, torch.Tensor) or step.numel() != 1 or not torch.isfinite(step).all() or step < 0:
                raise ValueError(f"flatcomm.optim: checkpoint 'step' of parameter {pid} must be one number >= 0")


def hook(opt: OnebitAdam, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook for :class:`OnebitAdam`: torch's default all-reduce (average) during the
    warm-up; afterwards the bucket's local gradient, untouched (the optimizer sends the momentum)."""
    if not opt.compressing:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        pg: Any = opt._ddp_group or dist.group.WORLD
        return default_hooks.allreduce_hook(pg, bucket)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


hook.__annotations__ = {"opt": OnebitAdam, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: OnebitAdam) -> None:
    """Register :func:`hook` on ``ddp_model`` for ``optimizer`` (see the module docstring)."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"flatcomm.optim.register needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not isinstance(optimizer, OnebitAdam):
        raise TypeError(f"flatcomm.optim.register needs a flatcomm.optim.OnebitAdam, got {type(optimizer).__name__}")
    register_ddp_hook(ddp_model, optimizer, hook, "flatcomm.optim.register")
    optimizer._ddp_group = ddp_model.process_group
