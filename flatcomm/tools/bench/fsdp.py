"""FSDP2 step time of a small transformer: FSDP's default reduce-scatter vs flatcomm codecs.

Every configuration trains the same model (same init, same data) for ``--warmup`` + ``--steps``
steps on N local gloo ranks (loopback); the step time is the median over steps of the slowest
rank's time (forward + backward + Adam). Wire bytes per step are what one rank put on the wire for
the reduce-scatters (flatcomm's CommStats.wire_bytes / steps; for the default, gloo's nominal
(n-1)/n x the fp32 reduce-scatter input). ``comm ms`` is the time per step (rank 0) inside the
reduce-scatter calls, timed around the call for both (it includes waiting for the slower rank to
reach the same reduce-scatter); ``codec ms`` is flatcomm's own encode + exchange + decode time
(CommStats), without its per-call consistency all-gather and thread hand-off.
The configurations take turns step by step (round robin) so machine noise hits all alike. The last
column is the loss after the run (mean over ranks): same init and data for every configuration.

    python -m flatcomm.tools.bench.fsdp                       # 2 ranks, default, fp32, int8, int4, sign
    python -m flatcomm.tools.bench.fsdp --codecs default,int8 --steps 20 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from flatcomm.tools import spawn


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, ff: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, max(1, d // 64), ff, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tok):
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _batch(rank: int, step: int, cfg: dict):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return tok, (tok * 7 + 3) % cfg["vocab"]


class _Run:
    """One configuration: its model, optimizer, backend and per-step times."""

    def __init__(self, rank: int, world: int, codec: str, cfg: dict):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        import flatcomm.fsdp as F

        self.codec, self.rank, self.world, self.cfg = codec, rank, world, cfg
        torch.manual_seed(0)
        self.model = Transformer(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["ff"])
        for layer in self.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        # FSDP pads every parameter's dim 0 to a multiple of the world size
        self.padded_numel = sum(-(-p.shape[0] // world) * world * (p.numel() // max(1, p.shape[0]))
                                for p in self.model.parameters())
        self.call_s = 0.0
        run = self
        if codec == "default":

            class Timed(DefaultReduceScatter):  # FSDP's own comm, timed (synchronous on CPU)
                def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                    t0 = time.perf_counter()
                    work = super().__call__(output_tensor, input_tensor, group, op, async_op)
                    if work is not None:
                        work.wait()
                    run.call_s += time.perf_counter() - t0

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(Timed())
            self.rs = None
        else:
            from flatcomm.autotune import Tuner

            # auto may pick any codec the fixed rows try (error budget: the least precise, sign)
            self.rs = F.apply(self.model, codec, tuner=Tuner("sign") if codec == "auto" else None)
            rs = self.rs

            class TimedFlat:  # the same call, timed the same way as the default
                def allocate(self, size, *, dtype, device):
                    return rs.allocate(size, dtype=dtype, device=device)

                def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                    t0 = time.perf_counter()
                    rs(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                       async_op=async_op)
                    run.call_s += time.perf_counter() - t0

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(TimedFlat())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.times: List[float] = []
        self.loss = torch.zeros(())

    def step(self, s: int) -> None:
        if s == self.cfg["warmup"]:
            self.call_s = 0.0
            if self.rs is not None:
                self.rs.counters = type(self.rs.counters)()
        tok, target = _batch(self.rank, s, self.cfg)
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad()
        out = self.model(tok)
        self.loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        self.loss.backward()
        self.opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if s >= self.cfg["warmup"]:
            self.times.append(float(dt))

    def row(self) -> Dict:
        world, steps = self.world, self.cfg["steps"]
        final = self.loss.detach().clone()
        dist.all_reduce(final)
        if self.rs is None:
            wire = self.padded_numel * 4 * (world - 1) / world
            inner_s = None
        else:
            st = self.rs.stats
            wire = st.wire_bytes / steps
            inner_s = st.encode_s + st.exchange_s + st.decode_s
        chosen = None
        if self.rs is not None and self.codec == "auto":
            chosen = sorted({d.codec for d in self.rs.tuner.decisions.values()})
        return {"codec": self.codec, "chosen": chosen, "world": world, "step_ms": 1e3 * statistics.median(self.times),
                "step_ms_min": 1e3 * min(self.times), "wire_bytes_per_step": int(wire),
                "comm_ms": 1e3 * self.call_s / steps,
                "codec_ms": None if inner_s is None else 1e3 * inner_s / steps, "final_loss": final.item() / world,
                "params": sum(p.numel() for p in self.model.parameters())}


def _rank_main(rank: int, world: int, cfg: dict) -> Optional[list]:
    # All configurations live side by side and take turns step by step, so a slow phase of a
    # shared machine hits all of them alike.
    runs = [_Run(rank, world, codec, cfg) for codec in cfg["codecs"]]
    for s in range(cfg["warmup"] + cfg["steps"]):
        for r in runs:
            r.step(s)
    rows = [r.row() for r in runs]
    return rows if rank == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--codecs", default="default,fp32,int8,int4,sign,auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    cfg = {"codecs": [c.strip() for c in args.codecs.split(",") if c.strip()], "steps": args.steps,
           "warmup": args.warmup, "d_model": args.d_model, "layers": args.layers, "ff": args.ff,
           "vocab": args.vocab, "seq": args.seq, "batch": args.batch}
    t0 = time.perf_counter()
    rows = spawn.run(args.world, _rank_main, cfg, timeout_s=1800, threads=args.threads)[0]
    base = next((r for r in rows if r["codec"] == "default"), None)
    print(f"FSDP2, {args.world} ranks gloo, {rows[0]['params'] / 1e6:.2f}M params, "
          f"batch {args.batch}x{args.seq}, median of {args.steps} steps (slowest rank)")
    hdr = f"{'reduce-scatter':>15} {'step ms':>9} {'vs default':>10} {'wire KB/step':>13} {'wire ratio':>10} {'comm ms':>8} {'codec ms':>8} {'loss':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rel = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
        wr = f"{r['wire_bytes_per_step'] / base['wire_bytes_per_step']:.3f}" if base else "-"
        cm = f"{r['comm_ms']:.1f}"
        kd = f"{r['codec_ms']:.1f}" if r["codec_ms"] is not None else "-"
        name = "torch default" if r["codec"] == "default" else f"flatcomm {r['codec']}"
        chose = f"  chose {','.join(r['chosen'])}" if r.get("chosen") else ""
        print(f"{name:>15} {r['step_ms']:>9.1f} {rel:>10} {r['wire_bytes_per_step'] / 1024:>13.1f} "
              f"{wr:>10} {cm:>8} {kd:>8} {r['final_loss']:>8.4f}{chose}")
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "world": args.world, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
