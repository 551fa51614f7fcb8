"""A small DDP model, its data per step and rank, and the float64 checks of the DDP tests (run on
the ranks)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.l1 = torch.nn.Linear(32, 64)
        self.l2 = torch.nn.Linear(64, 64)
        self.l3 = torch.nn.Linear(64, 64)
        self.l4 = torch.nn.Linear(64, 8)
        self.unused = torch.nn.Linear(16, 16) if unused else None

    def forward(self, x):
        x = torch.relu(self.l1(x))
        x = torch.relu(self.l2(x))
        x = torch.relu(self.l3(x))
        return self.l4(x)


def _data(step: int, rank: int, n: int = 16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 32, generator=g), torch.randn(n, 8, generator=g)


def _local_grads(model: torch.nn.Module, x, y):
    """The local gradient of a plain copy (what DDP's bucket holds before communication)."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in ref.named_parameters()}


def _gather64(t: torch.Tensor, world: int) -> torch.Tensor:
    """[world, *t.shape] float64 of every rank's tensor (default group)."""
    t64 = t.detach().to(torch.float64).contiguous()
    out = [torch.empty_like(t64) for _ in range(world)]
    dist.all_gather(out, t64)
    return torch.stack(out)


def _ef_steps(rank, world, ddp, state, steps, step0=0):
    """Run steps; return (sum of averaged decoded grads, sum of true float64 averages) per name."""
    dec = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in ddp.module.named_parameters()}
    true = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in ddp.module.named_parameters()}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(step0, step0 + steps):
        x, y = _data(step, rank)
        local = _local_grads(ddp.module, x, y)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        for n, p in ddp.module.named_parameters():
            dec[n] += p.grad.double()
            true[n] += _gather64(local[n], world).mean(0)
        opt.step()
    return dec, true


def _check_conserved(dec, true, t0, t1, what):
    """sum(decoded) + T_end == sum(true) + T_start, up to fp32 rounding of the steps."""
    for n in dec:
        lhs = dec[n] + t1.get(n, torch.zeros(()).double()).double()
        rhs = true[n] + t0.get(n, torch.zeros(()).double()).double()
        scale = true[n].abs().max().item() + 1e-12
        err = (lhs - rhs).abs().max().item() / scale
        assert err < 2e-5, f"{what}: {n}: residual not conserved, relative error {err:.3g}"
