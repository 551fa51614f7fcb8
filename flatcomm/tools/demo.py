"""Training demo: a small character-level transformer on 2 CPU ranks (gloo), one run per hook.

    python -m flatcomm.demo [--steps N] [--out out/demo_loss.png]

Every run starts from the same weights (``torch.manual_seed``) and sees the same batches (sampled
per rank and step from a seeded generator); only DDP's gradient communication differs: torch's
default all-reduce hook, flatcomm ``fp32`` (ordered, lossless), ``int8``, ``int4`` and ``sign``
with error feedback; then two DiLoCo runs (no DDP, an outer sync every held-out interval) with
``int4`` + EF and the ``sparse`` codec. The text is Python's own documentation (``pydoc_data.topics``).
Prints progress, then a table (final training and held-out loss, bytes put on the wire per step and
rank, MB one rank sent in all, step time, first 12 hex digits of the sha256 of the final weights) and
writes the loss curves to a PNG.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

from flatcomm.tools._cli import add_version, positive, say

RUNS = (
    ("torch allreduce", None),
    ("flatcomm fp32", "fp32"),
    ("flatcomm int8+EF", "int8"),
    ("flatcomm int4+EF", "int4"),
    ("flatcomm sign+EF", "sign"),
    # DiLoCo: no DDP; every rank trains its replica alone and syncs every eval interval (25 steps
    # at 300) with int4 + EF (DiLoCo's recipe), or sparse top-64 of 4,096 with SparseLoCo's recipe
    # (error decay 0.95, no outer momentum, outer lr 2.0, the gathered sum; docs/diloco.md).
    ("DiLoCo int4+EF", "diloco:int4"),
    ("DiLoCo sparse", "diloco:sparse"),
)
CONTEXT = 64
BATCH = 16  # per rank
D_MODEL = 64
LAYERS = 2
HEADS = 4
LR = 3e-3


def load_text():
    import pydoc_data.topics as topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    return data[:split], data[split:], len(chars)


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int = D_MODEL, layers: int = LAYERS, heads: int = HEADS, ctx: int = CONTEXT):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(ctx, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def batch(data: torch.Tensor, step: int, rank: int, n: int = BATCH, stream: int = 0):
    g = torch.Generator().manual_seed(1_000_003 * stream + 7919 * step + rank)
    ix = torch.randint(0, len(data) - CONTEXT - 1, (n,), generator=g)
    x = torch.stack([data[i:i + CONTEXT] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + CONTEXT] for i in ix.tolist()])
    return x, y


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def held_out_loss(model: torch.nn.Module, val: torch.Tensor, rank: int, world: int, vocab: int) -> float:
    """Cross-entropy on 4 fixed held-out batches (the same on every rank), averaged over ranks."""
    with torch.no_grad():
        vl = torch.zeros(1)
        for k in range(4):
            x, y = batch(val, k, rank, n=32, stream=1)
            vl += torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        dist.all_reduce(vl)
    return vl.item() / (4 * world)


def _train(rank: int, world: int, steps: int, log_every: int):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    train, val, vocab = load_text()
    loss_fn = torch.nn.functional.cross_entropy
    results = []
    t_all = time.perf_counter()
    eval_every = max(1, steps // 12)
    for label, codec in RUNS:
        torch.manual_seed(0)
        model = CharTransformer(vocab)
        nparams = sum(p.numel() for p in model.parameters())
        state = outer = None
        if codec is not None and codec.startswith("diloco:"):
            ddp = model  # each replica alone between syncs
        else:
            ddp = DDP(model)
            if codec is None:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            else:
                state = fddp.register(ddp, codec, track_norms=False, history=steps)  # every step's bytes
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
        if ddp is model:
            outer = _diloco(model, opt, codec, eval_every)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        losses, times, wire, val_curve = [], [], [], []
        t_run = time.perf_counter()
        for step in range(steps):
            x, y = batch(train, step, rank)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x).reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - t0)
            lt = loss.detach().reshape(1)
            dist.all_reduce(lt)  # the mean over ranks, for the curve (outside the timed step)
            losses.append(lt.item() / world)
            if step % eval_every == 0 or step == steps - 1:  # outside the timed step, no RNG drawn
                val_curve.append((step + 1, held_out_loss(model, val, rank, world, vocab)))
            if rank == 0 and (step % log_every == 0 or step == steps - 1):
                print(f"  [{label:17s}] step {step:4d}/{steps}  loss {losses[-1]:.4f}  "
                      f"{time.perf_counter() - t_run:6.1f}s", file=sys.stderr, flush=True)
        if outer is not None:  # the replicas' weights equal (a sync at the last step, if not due then)
            outer.finish()
            wire = _diloco_bytes(outer, steps)
            val_curve[-1] = (steps, held_out_loss(model, val, rank, world, vocab))
            outer.close()
        if state is not None:  # bytes per step (sign sends fp32 for its first steps), summed over buckets
            by_step: dict = {}
            for rec in state.stats["steps"]:
                by_step[rec["step"]] = by_step.get(rec["step"], 0) + rec["wire_bytes"]
            wire = [by_step[k] for k in sorted(by_step)]
        sha = weights_sha256(model)
        shas = [None] * world
        dist.all_gather_object(shas, sha)
        warm = times[5:] if len(times) > 10 else times
        ring = 2 * (world - 1) * 4 * nparams / world  # torch's hook: a ring all-reduce of fp32, per step
        sent = [sum(wire[:s]) if wire else s * ring for s, _ in val_curve]  # bytes one rank sent by then
        results.append({
            "label": label, "codec": codec, "losses": losses,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "val_loss": val_curve[-1][1], "val_curve": val_curve,
            "bytes_per_step": (sum(wire) / len(wire)) if wire else ring, "bytes_sent": sent,
            "bytes_measured": bool(wire),
            "step_ms": 1e3 * sorted(warm)[len(warm) // 2],
            "sha256": sha, "same_on_all_ranks": len(set(shas)) == 1,
            "params": nparams,
        })
    return {"results": results, "seconds": time.perf_counter() - t_all}


def _diloco(model, opt, codec: str, sync_every: int):
    from flatcomm.diloco import DiLoCo

    name = codec.split(":", 1)[1]
    if name == "sparse":  # SparseLoCo's recipe, the gathered sum
        return DiLoCo(model, opt, sync_every=sync_every, codec=name, mode="exact", error_decay=0.95,
                      outer_lr=2.0, outer_momentum=0.0)
    return DiLoCo(model, opt, sync_every=sync_every, codec=name)


def _diloco_bytes(outer, steps: int) -> list:
    """Bytes one rank sent at each step (a sync's payload on the step it started)."""
    per_sync = outer.stats["wire_bytes"] / max(1, outer.stats["syncs"])
    every = outer.config.schedule.sync_every
    return [per_sync if (s + 1) % every == 0 or s == steps - 1 and steps % every else 0.0 for s in range(steps)]


def fp32_matches_torch(results) -> bool:
    """Whether flatcomm fp32 trained bit for bit like torch's all-reduce hook: the same final weights
    (sha256) and the same loss at every step."""
    by = {r["codec"]: r for r in results}
    t, f = by.get(None), by.get("fp32")
    return bool(t and f and t["sha256"] == f["sha256"] and t["losses"] == f["losses"])


def _smooth(xs, k: int = 10):
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def _zoom(ax, curves, start: float) -> None:
    """y-limits that show the last stretch of every curve (from ``start`` of its length): the first
    drop would otherwise take the whole axis and the codecs would differ by pixels."""
    tail = [y for c in curves for y in c[int(start * len(c)):]]
    lo, hi = min(tail), max(tail)
    pad = 0.08 * (hi - lo or 1.0)
    ax.set_ylim(lo - pad, hi + pad)


def figure(results, same_bits: bool):
    """The demo's picture: training (thin) and held-out (markers) loss by step, zoomed on the last
    stretch; held-out loss against the bytes one rank sent (log x). fp32's legend says it equals
    torch's bit for bit when ``same_bits`` (:func:`fp32_matches_torch`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = dict(zip([r["label"] for r in results], ["0.45", "tab:blue", "tab:green", "tab:orange", "tab:red",
                                                      "tab:purple", "tab:brown"]))
    for r in results:
        c, label, dashed = colors[r["label"]], r["label"], r["codec"] == "fp32"
        if dashed and same_bits:
            label += " (= torch, bit for bit)"
        label += f": held-out {r['val_loss']:.3f}, {r['bytes_per_step'] / 1e3:,.0f} KB/step"
        steps, val = zip(*r["val_curve"])
        style = dict(color=c, ls="--" if dashed else "-", lw=2.2 if r["codec"] is None else 1.4)
        ax.plot(range(1, len(r["losses"]) + 1), _smooth(r["losses"]), color=c, lw=0.8, alpha=0.45)
        ax.plot(steps, val, marker="o", ms=3.5, label=label, **style)
        bx.plot([b / 1e6 for b in r["bytes_sent"]], val, marker="o", ms=3.5, **style)
    _zoom(ax, [r["losses"] for r in results] + [[v for _, v in r["val_curve"]] for r in results], 0.35)
    _zoom(bx, [[v for _, v in r["val_curve"]] for r in results], 0.35)
    tails = [r["bytes_sent"][int(0.35 * len(r["bytes_sent"])):] for r in results]
    bx.set_xlim(left=0.6 * min(b for t in tails for b in t) / 1e6)  # from where the zoomed curves start
    ax.set_xlabel("step")
    ax.set_ylabel("loss (zoomed on the last 2/3 of training)")
    ax.set_title("held-out loss (markers) and training loss (thin, 10-step mean)", fontsize=10)
    bx.set_xscale("log")
    bx.set_xlabel("MB one rank has sent (log scale)")
    bx.set_ylabel("held-out loss")
    bx.set_title("the same held-out loss against the bytes sent", fontsize=10)
    for a in (ax, bx):
        a.grid(alpha=0.3, which="both")
    fig.legend(loc="lower center", ncol=3, fontsize=8.5, frameon=False)
    fig.suptitle(f"Char transformer on pydoc topics, 2 gloo ranks, {len(results[0]['losses'])} steps: "
                 "torch's all-reduce vs flatcomm codecs", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot(results, path: str, same_bits: bool) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(results, same_bits)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.demo", description=__doc__.split("\n")[0])
    add_version(ap)
    ap.add_argument("--steps", type=positive(int), default=300, help="training steps per run (default 300)")
    ap.add_argument("--world", type=positive(int), default=2, help="gloo ranks (default 2)")
    ap.add_argument("--out", default=os.path.join("out", "demo_loss.png"), help="PNG of the loss curves")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from flatcomm.tools import spawn

    t0 = time.perf_counter()
    say("demo", f"{args.world} gloo ranks x 1 thread, char transformer ({LAYERS} layers, d_model "
          f"{D_MODEL}, context {CONTEXT}, batch {BATCH}/rank), {args.steps} steps per run")
    out = spawn.run(args.world, _train, args.steps, max(1, args.steps // 6), timeout_s=900)
    results = out[0]["results"]
    base = results[0]
    print(f"flatcomm demo: {args.world} gloo ranks, {args.steps} steps per run")
    hdr = (f"{'run':18s} {'final loss':>10s} {'val loss':>9s} {'bytes/step':>11s} {'vs torch':>8s} "
           f"{'MB sent':>8s} {'step ms':>8s} {'sha256':>13s}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        b = r["bytes_per_step"]
        mark = "" if r["bytes_measured"] else "~"
        print(f"{r['label']:18s} {r['final_loss']:10.4f} {r['val_loss']:9.4f} {mark + format(int(b), ','):>11s} "
              f"{b / base['bytes_per_step']:7.3f}x {r['bytes_sent'][-1] / 1e6:8.2f} {r['step_ms']:8.1f} "
              f"{r['sha256'][:12]:>13s}"
              + ("" if r["same_on_all_ranks"] else "  (RANKS DIFFER)"))
    print(f"\n{results[0]['params']:,} parameters; final loss = mean of the last 20 steps; bytes/step = what "
          f"one rank puts on the wire (~: 2(W-1)/W x 4 B x params, the ring all-reduce's volume); step ms = "
          f"median; sha256 of the final weights (rank 0, equal on all ranks unless marked).")
    same = fp32_matches_torch(results)
    print(f"flatcomm fp32 vs torch allreduce: {'the same bits' if same else 'DIFFERENT'} (final weights' sha256 "
          f"and the loss at every step {'equal' if same else 'compared'})")
    plot(results, args.out, same)
    say("demo", f"loss curves: {args.out}; total {time.perf_counter() - t0:.0f}s "
          f"(training {out[0]['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
