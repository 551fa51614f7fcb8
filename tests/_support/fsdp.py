"""A small FSDP model with an uneven side branch, its wrapping, batches, loss, gradients and a
training loop (run on the ranks)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn


class _Tiny(nn.Module):
    """A small transformer language model plus an uneven Linear(7, 13) side branch."""

    def __init__(self, vocab: int = 32, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True) for _ in range(2))
        self.side = nn.Linear(7, 13)
        self.side2 = nn.Linear(13, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok, feat):
        h = self.emb(tok) + self.side2(torch.relu(self.side(feat))).unsqueeze(1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _wrap(model: _Tiny, mp=None, reshard=True):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model.side, **kw)  # uneven: 13 rows over 2 or 4 ranks, 7 columns
    fully_shard(model, **kw)
    return model


def _batch(rank: int, step: int, vocab: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, vocab, (4, 8), generator=g)
    feat = torch.randn(4, 7, generator=g)
    target = (tok * 7 + 3) % vocab  # a learnable token map
    return tok, feat, target


def _loss(model, rank, step):
    tok, feat, target = _batch(rank, step)
    out = model(tok, feat)
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _grads(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.to_local().detach().float().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _maxrel(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if b[k].numel() == 0:
            continue
        den = max(b[k].abs().max().item(), 1e-6)
        worst = max(worst, (a[k] - b[k]).abs().max().item() / den)
    return worst


def _train(model, steps, rank, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = _loss(model, rank, s)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses
