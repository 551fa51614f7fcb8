"""A small DDP model trained a few steps, and a bitwise comparison of nested states (the
rank_states and state round-trip tests, run on the ranks)."""
from __future__ import annotations

import torch

__all__ = ["ddp_trained", "fresh_ddp", "fsdp_model", "fsdp_trained", "model", "same"]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 19), torch.nn.Tanh(), torch.nn.Linear(19, 3))


def ddp_trained(rank, codec="int8", steps=3):
    import flatcomm.ddp

    ddp = torch.nn.parallel.DistributedDataParallel(model())
    state = flatcomm.ddp.register(ddp, codec)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ddp(torch.randn(5, 7, generator=g)).square().mean().backward()
    state.wait()
    return ddp, state


def fresh_ddp(codec="int8"):
    import flatcomm.ddp

    return flatcomm.ddp.register(torch.nn.parallel.DistributedDataParallel(model()), codec)


def same(a, b) -> bool:
    """Equal dicts/lists/tensors, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def fsdp_model():
    """model() under FSDP2: its first layer and the whole as two FSDP modules."""
    from torch.distributed.fsdp import fully_shard

    m = model()
    fully_shard(m[0])
    fully_shard(m)
    return m


def fsdp_trained(rank, steps=2):
    """An FSDP2 model with an int8 flatcomm.fsdp state, trained ``steps`` steps: (model, state)."""
    import flatcomm.fsdp

    m = fsdp_model()
    rs = flatcomm.fsdp.apply(m, "int8")
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        m(torch.randn(5, 7, generator=g)).square().mean().backward()
    return m, rs
