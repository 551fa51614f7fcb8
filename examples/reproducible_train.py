"""Train a small transformer so that 1, 2 or 4 ranks end with the same weights, bit for bit.

    torchrun --nproc-per-node 1 examples/reproducible_train.py     # weights-sha256: <hex>
    torchrun --nproc-per-node 2 examples/reproducible_train.py     # the same <hex>
    torchrun --nproc-per-node 4 examples/reproducible_train.py     # the same <hex>
    torchrun --nproc-per-node 2 examples/reproducible_train.py --plain-ddp   # differs with W

A byte-level language model on the text of pydoc_data.topics (ships with Python). Every step takes
a fixed global batch of ``--batch`` sequences, split into ``--micro-batches`` micro-batches; rank r
runs micro-batches r, r + W, ...; flatcomm.reproducible accumulates their gradients exactly and
reduces them across ranks as integers, so the update depends on the global batch only.
``--plain-ddp`` runs ordinary DistributedDataParallel instead: each rank computes the mean loss of
its batch / W sequences in one pass and DDP averages the fp32 gradients, whose rounding depends on W.
Runs on CPU with gloo; also without torchrun (a single process).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from flatcomm import reproducible


def corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class TinyLM(nn.Module):
    def __init__(self, ctx: int, dim: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def global_batch(data: torch.Tensor, step: int, batch: int, ctx: int):
    """The step's global batch: the same on every rank, whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(ctx + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--plain-ddp", action="store_true", help="ordinary DDP (fp32 all-reduce) for contrast")
    ap.add_argument("--digests", action="store_true", help="print every step's gradient digest (rank 0)")
    args = ap.parse_args()

    reproducible.configure()  # deterministic kernels, one intra-op thread on every rank
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if args.batch % args.micro_batches:
        raise SystemExit(f"--batch ({args.batch}) must be a multiple of --micro-batches ({args.micro_batches})")
    mb = args.batch // args.micro_batches

    data = corpus()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(args.ctx, dropout=args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    if args.plain_ddp:
        if args.batch % world:
            raise SystemExit(f"--batch ({args.batch}) must be a multiple of the world size ({world})")
        share = args.batch // world
        net = nn.parallel.DistributedDataParallel(model) if distributed else model
        for step in range(args.steps):
            x, y = global_batch(data, step, args.batch, args.ctx)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(hash((step, rank)) & 0xFFFFFFFF)
            loss = lm_loss(net, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
            loss.backward()
            opt.step()
    else:
        acc = reproducible.ExactGradAccumulator(model, micro_batches=args.micro_batches)
        replays = 0
        for step in range(args.steps):
            x, y = global_batch(data, step, args.batch, args.ctx)
            for i in acc.micro_batches():
                lm_loss(model, x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]).backward()
            replays += acc.stats.replays
            if acc.stats.applied:
                opt.step()
            if args.digests and rank == 0:
                print(f"step {step:3d} grad-sha256: {acc.stats.digest}", flush=True)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        with torch.no_grad():  # a held-out-ish check that it learns: loss on a fixed batch
            model.eval()
            x, y = global_batch(data, 10**6, 16, args.ctx)
            val = lm_loss(model, x, y).item()
        mode = "plain-ddp" if args.plain_ddp else "reproducible"
        extra = "" if args.plain_ddp else f", {replays} replayed steps"
        print(f"# {mode}, world {world}, {args.steps} steps in {elapsed:.2f}s, loss {val:.4f} "
              f"(uniform {math.log(256):.4f}){extra}", file=sys.stderr, flush=True)
        print(f"weights-sha256: {weights_sha256(model)}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
