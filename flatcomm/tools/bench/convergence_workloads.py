"""The workloads and rows of the convergence benchmark (:mod:`flatcomm.tools.bench.convergence`),
and the training steps its DDP, FSDP2 and DiLoCo runs share: a module of their own, so that
convergence.py imports convergence_fsdp.py and convergence_diloco.py and neither imports it back.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


# ---- rows ------------------------------------------------------------------------------------------

def parse_row(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``"sign:block_size=32,start_step=50"`` -> ``("sign", {"block_size": 32, "start_step": 50})``."""
    name, _, rest = spec.partition(":")
    opts: Dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"convergence: row option {item!r} in {spec!r} is not key=value")
        try:
            opts[k] = int(v)
        except ValueError:
            try:
                opts[k] = float(v)
            except ValueError:
                opts[k] = {"true": True, "false": False}.get(v.lower(), v)
    if name == "torch" and opts:
        raise ValueError("convergence: the torch row takes no options")
    return name, opts


# ---- workloads -------------------------------------------------------------------------------------

class Workload:
    """Model, optimizer, batches and held-out loss of one workload; ``scale`` shortens or lengthens it."""

    name = ""
    optimizer = ""
    steps = 0

    def __init__(self, seed: int, scale: float):
        self.seed = seed
        self.steps = max(4, int(round(self.steps * scale)))

    # Subclasses give model(), make_optimizer(params) -> (optimizer, scheduler or None),
    # batch(step, rank) -> (x, y) and held_out() -> [(x, y), ...].

    def batches(self, step: int, rank: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of one step (more than one: gradient accumulation)."""
        return [self.batch(step, rank)]

    def before_step(self, params) -> None:
        """Between the last backward and the optimizer step (e.g. gradient clipping)."""

    def adam(self, params, lr: float, warm: int, onebit: Optional[Dict[str, Any]]):
        """AdamW (no weight decay) with the warm-up + cosine schedule; ``onebit``: OnebitAdam's options
        (flatcomm.optim) instead."""
        if onebit is not None:
            from flatcomm.optim import OnebitAdam

            opt: torch.optim.Optimizer = OnebitAdam(params, lr=lr, weight_decay=0.0, **onebit)
        else:
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(warm, self.steps))

    def loss(self, out, y) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _warmup_cosine(warm: int, total: int) -> Callable[[int], float]:
    """Linear warm-up over ``warm`` steps, then cosine decay to a tenth at ``total`` (a usual recipe:
    with a constant rate the final loss measures the gradient noise level more than progress)."""
    def f(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm))))
    return f


class LM(Workload):
    name, optimizer, steps = "lm", "AdamW", 200

    def __init__(self, seed, scale):
        super().__init__(seed, scale)
        from flatcomm.tools import demo

        self.demo = demo
        self.train, self.val, self.vocab = demo.load_text()

    def model(self):
        return self.demo.CharTransformer(self.vocab)

    def make_optimizer(self, params, onebit=None):
        return self.adam(params, self.demo.LR, 20, onebit)

    def batch(self, step, rank):
        return self.demo.batch(self.train, step, rank, stream=10 + self.seed)

    def held_out(self):
        return [self.demo.batch(self.val, k, 0, n=32, stream=1) for k in range(4)]


def _templates(seed: int, classes: int = 10, size: int = 16) -> torch.Tensor:
    """One smooth random pattern per class (a low-resolution random field upsampled), unit variance."""
    g = torch.Generator().manual_seed(424242 + seed)
    low = torch.randn(classes, 1, 5, 5, generator=g)
    t = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    return (t - t.mean(dim=(2, 3), keepdim=True)) / t.std(dim=(2, 3), keepdim=True)


def _images(templates: torch.Tensor, n: int, g: torch.Generator, noise: float = 1.5, flip: float = 0.25):
    k = templates.shape[0]
    y = torch.randint(0, k, (n,), generator=g)
    dx = torch.randint(-2, 3, (n,), generator=g).tolist()
    dy = torch.randint(-2, 3, (n,), generator=g).tolist()
    x = torch.stack([torch.roll(templates[c], (a, b), dims=(1, 2)) for c, a, b in zip(y.tolist(), dx, dy)])
    # Label noise: the held-out loss has a floor (about 1.1 nats at flip 0.25) instead of sinking
    # towards 0, where relative differences say little; without it the noise level that keeps the
    # task from being trivial made some seeds learn suddenly late and others early.
    wrong = torch.rand(n, generator=g) < flip
    y_noisy = torch.where(wrong, (y + torch.randint(1, k, (n,), generator=g)) % k, y)
    return x + noise * torch.randn(x.shape, generator=g), y_noisy


class CNN(Workload):
    name, optimizer, steps = "cnn", "AdamW", 150
    BATCH = 32

    def __init__(self, seed, scale):
        super().__init__(seed, scale)
        self.templates = _templates(seed)

    def model(self):
        nn = torch.nn
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def make_optimizer(self, params, onebit=None):
        return self.adam(params, 2e-3, 10, onebit)

    def batch(self, step, rank):
        g = torch.Generator().manual_seed(1_000_003 * (10 + self.seed) + 7919 * step + rank)
        return _images(self.templates, self.BATCH, g)

    def held_out(self):
        g = torch.Generator().manual_seed(99 + self.seed)
        return [_images(self.templates, 256, g)]


class MLPSGD(Workload):
    name, optimizer, steps = "mlp_sgd", "SGD+momentum", 200
    DIM, CLASSES, BATCH = 32, 8, 64

    def __init__(self, seed, scale):
        super().__init__(seed, scale)
        g = torch.Generator().manual_seed(777 + seed)
        self.teacher = [torch.randn(self.DIM, 64, generator=g) / math.sqrt(self.DIM),
                        torch.randn(64, self.CLASSES, generator=g) / 8.0]

    def _data(self, n, g):
        x = torch.randn(n, self.DIM, generator=g)
        return x, (torch.tanh(x @ self.teacher[0]) @ self.teacher[1]).argmax(dim=1)

    def model(self):
        nn = torch.nn
        return nn.Sequential(nn.Linear(self.DIM, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, self.CLASSES))

    def make_optimizer(self, params, onebit=None):
        assert onebit is None, "OnebitAdam rows apply to the AdamW workloads"
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(5, self.steps))

    def batch(self, step, rank):
        g = torch.Generator().manual_seed(1_000_003 * (10 + self.seed) + 7919 * step + rank)
        return self._data(self.BATCH, g)

    def held_out(self):
        return [self._data(1024, torch.Generator().manual_seed(55 + self.seed))]


class LMRecipe(LM):
    """The char-level LM of ``lm`` trained as GPT-style models are: AdamW betas (0.9, 0.95), weight
    decay 0.1 on the matrices (not on biases and norms), gradient clipping at norm 1, warm-up over
    a tenth of the steps then cosine decay, and gradient accumulation over ACCUM micro-batches."""

    name, optimizer, steps = "lm_recipe", "AdamW(0.9, 0.95), wd 0.1, clip 1, accumulation 2", 240
    ACCUM, MICRO = 2, 8  # per rank: 2 x 8 sequences a step, as many as lm's 16

    def make_optimizer(self, params, onebit=None):
        assert onebit is None, "OnebitAdam rows apply to the plain AdamW workloads"
        params = list(params)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=self.demo.LR, betas=(0.9, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(max(1, self.steps // 10), self.steps))

    def batches(self, step, rank):
        return [self.demo.batch(self.train, step * self.ACCUM + k, rank, n=self.MICRO, stream=20 + self.seed)
                for k in range(self.ACCUM)]

    def before_step(self, params) -> None:
        torch.nn.utils.clip_grad_norm_(list(params), 1.0)


class LMDiLoCo(LMRecipe):
    """``lm_recipe`` trained longer (300 steps: 6 syncs at H = 50, 3 at H = 100), for the DiLoCo rows
    (:mod:`flatcomm.tools.bench.convergence_diloco`) against DDP every step at the same tokens."""

    name, steps = "lm_diloco", 300


WORKLOAD_CLASSES = {c.name: c for c in (LM, CNN, MLPSGD, LMRecipe, LMDiLoCo)}


def record_loss(curve: List[float], loss: torch.Tensor, world: int) -> bool:
    """Append the step's loss averaged over the ranks; False once it is no longer finite."""
    lt = loss.detach().reshape(1)
    dist.all_reduce(lt)
    curve.append(lt.item() / world)
    return math.isfinite(curve[-1])


def held_out_loss(w: "Workload", model: torch.nn.Module) -> float:
    """The mean loss on the workload's held-out batches (the same data on every rank)."""
    model.eval()
    with torch.no_grad():
        return sum(float(w.loss(model(x), y)) for x, y in w.held_out()) / len(w.held_out())


def forward_backward(w: Workload, model, step: int, rank: int, pause_sync) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, the gradient sync only after the last
    (``pause_sync()``: a context without it); the mean loss."""
    parts = w.batches(step, rank)
    total = torch.zeros(())
    for k, (x, y) in enumerate(parts):
        with pause_sync() if k < len(parts) - 1 else contextlib.nullcontext():
            loss = w.loss(model(x), y) / len(parts)
            loss.backward()
        total += loss.detach()
    return total
