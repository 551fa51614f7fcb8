"""DiLoCo rows of the convergence benchmark (:mod:`flatcomm.tools.bench.convergence`).

``diloco:codec=int4,H=50`` trains every rank as its own replica: the workload's inner optimizer
(AdamW with warm-up + cosine for the LM recipes, gradient clipping and accumulation as the DDP rows)
on the rank's own batches, and :class:`flatcomm.diloco.DiLoCo` every ``H`` inner steps (outer SGD,
lr 0.7, Nesterov momentum 0.9, fp32 master) with the codec and error feedback (``ef=false``: without,
as torchft's quantized path). ``fragments=`` and ``delay=`` give Streaming DiLoCo. Same init and
batches per seed as the DDP rows, so ``torch`` (DDP every step) sees the same tokens. A lossy
DiLoCo row is compared with the fp32 DiLoCo row of the same ``H`` (paired per seed), the fp32 row
with ``torch``. ``momentum=0.0``, ``decay=0.95`` (``error_decay``) and ``mode=exact`` pass DiLoCo's
``outer_momentum``, ``error_decay`` and ``mode``, ``keep=128`` the sparse codecs' values kept per
chunk: ``diloco:codec=sparse,H=20,decay=0.95,outer_lr=1.0,
momentum=0.0`` is SparseLoCo's recipe on flatcomm's codec. ``sparseloco:H=20`` is SparseLoCo's own
outer sync as Templar runs it (:mod:`flatcomm.tools.bench.sparseloco`: 2-bit, 12-bit indices,
all-gather; ``chunking=flat`` cuts the flat model into 4,096-value runs as flatcomm's codec does,
``decay=`` and ``outer_lr=`` override 0.95 and 1.0), compared with fp32 DiLoCo at the same H.
The step count should be a multiple of ``H``: the held-out loss is measured on the
weights of the last sync, the same on every replica.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import torch

from .convergence_workloads import Workload, forward_backward, held_out_loss, parse_row, record_loss

OPTIONS = ("codec", "H", "ef", "fragments", "delay", "outer_lr", "momentum", "decay", "mode", "keep")
SPARSELOCO_OPTIONS = ("H", "decay", "outer_lr", "chunking", "topk")


def check_options(opts: Dict[str, Any], name: str = "diloco") -> None:
    allowed = SPARSELOCO_OPTIONS if name == "sparseloco" else OPTIONS
    bad = [k for k in opts if k not in allowed]
    if bad:
        raise ValueError(f"{name} rows take {', '.join(allowed)}, not {', '.join(bad)}")
    if not isinstance(opts.get("H"), int) or opts["H"] < 1:
        raise ValueError("diloco rows need H=<inner steps per sync>")


def sparse_grid_rows(h: int) -> List[str]:
    """The rows of ``bench convergence --preset sparse``: fp32 and int4+EF DiLoCo, flatcomm's sparse
    codec with DiLoCo's recipe and with SparseLoCo's (error decay 0.95, no momentum, outer lr 1.0,
    and 2.0: SparseLoCo's mean over the replicas that sent a value is up to R times a mean over all
    R), each with the two-stage and the gathered sum, and SparseLoCo's own format (Templar's tiles,
    and flat 4,096-value runs)."""
    return [f"diloco:codec=fp32,H={h}", f"diloco:codec=int4,H={h}", f"diloco:codec=sparse,H={h}",
            f"diloco:codec=sparse,H={h},mode=exact",
            f"diloco:codec=sparse,H={h},decay=0.95,outer_lr=1.0,momentum=0.0",
            f"diloco:codec=sparse,H={h},mode=exact,decay=0.95,outer_lr=1.0,momentum=0.0",
            f"diloco:codec=sparse,H={h},decay=0.95,outer_lr=2.0,momentum=0.0",
            f"diloco:codec=sparse,H={h},mode=exact,decay=0.95,outer_lr=2.0,momentum=0.0",
            f"sparseloco:H={h}", f"sparseloco:H={h},chunking=flat"]


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    """The summarised rows of a DiLoCo run (``convergence.summarize``) as a markdown table: held-out
    loss mean (sample sd over seeds), against fp32 DiLoCo at the same H (mean [min, max] of the
    per-seed ratios), bytes per parameter per sync (the sync's own count of payload bytes)."""
    import statistics

    out = ["| row | held-out loss, mean (sd) | vs fp32 DiLoCo: mean [min, max] | B/param/sync |",
           "|---|---|---|---|"]
    for r in rows:
        v = r["val"]
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        rel = "-" if r["rel_mean"] is None or r["baseline"] == "torch" else \
            f"{100 * r['rel_mean']:+.2f}% [{100 * r['rel_min']:+.2f}, {100 * r['rel_max']:+.2f}]"
        bps = r.get("bytes_per_param_per_sync")
        b = f"{statistics.fmean(bps):.4f}" if bps else "-"
        out.append(f"| `{r['row']}` | {statistics.fmean(v):.4f} ({sd:.4f}) | {rel} | {b} |")
    return "\n".join(out)


def baseline_row(opts: Dict[str, Any]) -> str:
    """The fp32 DiLoCo row a lossy one is compared with."""
    return f"diloco:codec=fp32,H={opts['H']}"


def build_outer(name: str, opts: Dict[str, Any], model, opt):
    """The row's outer sync: flatcomm's DiLoCo, or the SparseLoCo baseline."""
    if name == "sparseloco":
        from .sparseloco import SparseLoCo

        return SparseLoCo(model, opt, sync_every=opts["H"], error_decay=opts.get("decay", 0.95),
                          outer_lr=opts.get("outer_lr", 1.0), chunking=opts.get("chunking", "tiles"),
                          topk=opts.get("topk", 64))
    from flatcomm.diloco import DiLoCo

    codec = opts.get("codec", "int4")
    if "keep" in opts:  # the chunked sparse codecs' values kept per 4,096
        from flatcomm import Codec

        codec = Codec(codec, keep=opts["keep"])
    return DiLoCo(model, opt, sync_every=opts["H"], codec=codec,
                  error_feedback=bool(opts.get("ef", True)), fragments=opts.get("fragments", 1),
                  fragment_sync_delay=opts.get("delay", 0), outer_lr=opts.get("outer_lr", 0.7),
                  outer_momentum=opts.get("momentum", 0.9), error_decay=opts.get("decay", 1.0),
                  mode=opts.get("mode", "ordered"))


def train_diloco(w: Workload, row: str, rank: int, world: int, seed: int) -> dict:
    name, opts = parse_row(row)
    check_options(opts, name)
    torch.manual_seed(1000 + seed)  # the DDP rows' init
    model = w.model()
    opt, sched = w.make_optimizer(model.parameters())
    outer = build_outer(name, opts, model, opt)
    curve: List[float] = []
    for step in range(w.steps):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(w, model, step, rank, contextlib.nullcontext)
        w.before_step(model.parameters())
        opt.step()  # DiLoCo's hook: the outer sync every H steps
        if sched is not None:
            sched.step()
        if not record_loss(curve, loss, world):
            break
    outer.verify()  # the replicas' masters are the same bits
    val = held_out_loss(w, model)
    st = outer.stats
    n = sum(p.numel() for p in model.parameters())
    outer.close()
    codec = "sparseloco" if name == "sparseloco" else f"diloco {opts.get('codec', 'int4')}"
    return {"row": row, "codec": codec, "options": opts, "val": val, "curve": curve, "params": n,
            "wire_bytes_per_step": st["wire_bytes"] / max(1, len(curve)), "syncs": st["syncs"],
            "bytes_per_param_per_sync": st["wire_bytes"] / max(1, st["syncs"]) / n}
