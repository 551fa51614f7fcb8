"""Checkpoints written by an older flatcomm load in this one and come back unchanged.

``tests/data/state_v2/`` holds flatcomm state dicts written on 2 gloo ranks by main at 34ae499
(before the residual store was shared between DDP and FSDP): DDP per-rank (int8; auto with a
backoff), FSDP2 (int8) and FSDP1 (FULL_SHARD int4 with a warm-up count, NO_SHARD int8). Each rank
loads its own and saves again: every tensor and field must be equal, then one more step runs.
Regenerate (only when the format changes on purpose) with ``python tests/test_state_compat.py``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from flatcomm.tools import spawn

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "state_v2")
sys.path.insert(0, HERE)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(23, 13)
        self.norm = nn.LayerNorm(13)
        self.fc = nn.Linear(13, 29)
        self.out = nn.Linear(29, 7, bias=False)

    def forward(self, idx):
        return self.out(torch.relu(self.fc(self.norm(self.embed(idx)))))


def _ddp_steps(ddp, state, steps, step0=0):
    for step in range(step0, step0 + steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        idx, y = torch.randint(0, 23, (9,), generator=g), torch.randn(9, 7, generator=g)
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(idx), y).backward()
        state.wait()


def _ddp(kind):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp
    from flatcomm.autotune import Tuner
    from flatcomm._training.adapt import Backoff

    ddp = DDP(_Net(), bucket_cap_mb=0.002)
    if kind == "ddp_int8":
        return ddp, fddp.register(ddp, "int8")
    return ddp, fddp.register(ddp, "auto", mode="ordered", tuner=Tuner("int8", pinned={"-": "sign"}),
                              backoff=Backoff(every=2))


def _fsdp2():
    from _support.fsdp import _Tiny, _wrap

    from flatcomm.fsdp import apply

    torch.manual_seed(0)
    model = _wrap(_Tiny())
    return model, apply(model, "int8")


def _fsdp1(strategy, codec, start_step=0):
    from _support.fsdp import _Tiny
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatcomm.fsdp import FSDP1State, fsdp1_hook

    torch.manual_seed(0)
    model = FSDP(_Tiny(), sharding_strategy=getattr(ShardingStrategy, strategy),
                 auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
                 device_id=torch.device("cpu"), use_orig_params=True)
    state = FSDP1State(codec, model=model, start_step=start_step)
    model.register_comm_hook(state, fsdp1_hook)
    return model, state


def _fsdp_steps(model, steps, step0=0):
    from _support.fsdp import _loss

    for s in range(step0, step0 + steps):
        model.zero_grad()
        _loss(model, dist.get_rank(), s).backward()


def _cases():
    def fsdp_steps(model, state, n, step0=0):
        _fsdp_steps(model, n, step0)

    return {
        "ddp_int8": (lambda: _ddp("ddp_int8"), _ddp_steps, 3),
        "ddp_auto": (lambda: _ddp("ddp_auto"), _ddp_steps, 4),
        "fsdp2_int8": (_fsdp2, fsdp_steps, 3),
        "fsdp1_full_int4": (lambda: _fsdp1("FULL_SHARD", "int4", 1), fsdp_steps, 3),
        "fsdp1_noshard_int8": (lambda: _fsdp1("NO_SHARD", "int8"), fsdp_steps, 3),
    }


def _write(rank, world, out_dir):
    for name, (make, steps, n) in _cases().items():
        model, state = make()
        steps(model, state, n)
        torch.save(state.state_dict(), os.path.join(out_dir, f"{name}.rank{rank}.pt"))


def _diff(a, b, path="") -> list:
    """Where two state dicts differ (values compared exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b) and sorted(map(str, a)) != sorted(map(str, b)):
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [f"{path}: tensors differ"]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _check(rank, world):
    out = {}
    for name, (make, steps, n) in _cases().items():
        saved = torch.load(os.path.join(DATA, f"{name}.rank{rank}.pt"), weights_only=True)
        model, state = make()
        state.load_state_dict(saved)
        out[name] = _diff(state.state_dict(), saved)
        steps(model, state, 1, n)  # and it trains on from there
        out[name + "_finite"] = all(bool(torch.isfinite(v).all()) for v in _tensors(state.state_dict()))
    return out


def _tensors(sd):
    if isinstance(sd, torch.Tensor):
        yield sd
    elif isinstance(sd, dict):
        for v in sd.values():
            yield from _tensors(v)


def test_old_checkpoints_load_and_save_back_unchanged():
    for r in spawn.run(2, _check, timeout_s=240):
        for name in _cases():
            assert r[name] == [], (name, r[name][:5])
            assert r[name + "_finite"], name


if __name__ == "__main__":
    os.makedirs(DATA, exist_ok=True)
    spawn.run(2, _write, DATA, timeout_s=240)
    print("wrote", sorted(os.listdir(DATA)))
