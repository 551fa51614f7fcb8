"""Convergence benchmark: does a codec change what training reaches? (a tool; the library never imports it)

    python -m flatcomm.tools.bench.convergence [--quick] [--workloads lm,cnn,mlp_sgd,lm_recipe] [--seeds 3]
        [--codecs torch,fp32,bf16,int8,int4,sign,fsdp,...] [--json P] [--plot P.png] [--steps-scale F]
        [--preset sparse --sync-every 15]

Four workloads, each trained on 2 gloo ranks (:mod:`flatcomm.tools.spawn`, one thread per rank) once per
seed and per row:

* ``lm``: the character-level transformer of :mod:`flatcomm.tools.demo` on ``pydoc_data.topics`` (text that
  ships with Python), AdamW; held-out cross-entropy.
* ``cnn``: a small convolutional net on generated 16x16 images (10 classes: a random template per
  class, shifted by up to 2 pixels, in Gaussian noise of 1.5x their sd, a quarter of the labels
  replaced by another class), AdamW; held-out cross-entropy.
* ``mlp_sgd``: an MLP learning a fixed random teacher network's labels from Gaussian inputs, SGD
  with momentum 0.9; held-out cross-entropy.
* ``lm_recipe``: ``lm``'s model and text with a GPT-style recipe: AdamW betas (0.9, 0.95), weight
  decay 0.1 on the matrices, gradient clipping at norm 1, gradient accumulation over 2
  micro-batches (DDP's ``no_sync``, FSDP2's paused gradient sync).
* ``lm_diloco`` (not in the default list): ``lm_recipe`` over 300 steps, for the DiLoCo rows
  (``diloco:codec=int4,H=50``, :mod:`flatcomm.tools.bench.convergence_diloco`) and the SparseLoCo
  baseline's (``sparseloco:H=15``); ``--preset sparse`` runs the sparse codec's grid against it.

Every workload warms its learning rate up linearly and decays it along a cosine to a tenth.

FSDP2 rows (:mod:`flatcomm.tools.bench.convergence_fsdp`): ``fsdp`` is plain FSDP2 (its own
collectives), ``fsdp:grads=int8`` flatcomm's gradients, ``fsdp:grads=int8,weights=int8`` also
quantized weight all-gathers (``weights=int4`` likewise); they are compared with ``fsdp``, every
other row (``fsdp`` included) with ``torch``.

A row is torch's default all-reduce hook (``torch``) or ``flatcomm.ddp.register(ddp, codec, **opts)``
with its defaults (error feedback on for lossy codecs); ``sign:block_size=32,start_step=50`` passes
options; ``sign:accordion=int8,accordion_every=10,accordion_threshold=0.5`` registers with a
:class:`flatcomm.ddp.accordion.Accordion`. ``onebit:codec=sign,warmup_steps=20`` trains with
:class:`flatcomm.optim.OnebitAdam` (the workload's AdamW settings, options passed on) and its hook
instead; it applies to the AdamW workloads only (its row is left out of the others). Within a seed
every row starts from the same weights and sees the same batches, so the paired difference to
``torch`` measures the codec, not the seed. The held-out metric is reported relative to the row's
baseline (``val / val_base - 1`` per seed, then mean, sample sd, min and max over seeds).

JSON: ``{"command": "convergence", "world", "seeds", "quick", "workloads": {name: {"optimizer",
"steps", "params", "rows": [{"row", "codec", "options", "val": [per seed], "rel": [per seed],
"baseline", "rel_mean", "rel_sd", "rel_min", "rel_max", "curves": [[train loss per step] per seed],
"residual_norm": [[...]],
"rel_error": [[...]], "wire_bytes_per_step", "codec_share": {codec: share of bucket-steps},
FSDP2 rows also "val_gathered": [per seed], "bytes_by_kind": [per seed]}]}}, "seconds"}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

DEFAULT_ROWS = ("torch", "fp32", "bf16", "int8", "int4", "sign", "fsdp", "fsdp:grads=int8",
                "fsdp:grads=int8,weights=int8", "fsdp:grads=int8,weights=int4")
WORKLOADS = ("lm", "cnn", "mlp_sgd", "lm_recipe")
TRACK_EVERY = 5  # steps between residual-norm samples (stats reads are cheap but not free)


from .convergence_workloads import (  # noqa: F401 - the workloads, re-exported for the benchmark's users
    CNN, LM, MLPSGD, WORKLOAD_CLASSES, LMDiLoCo, LMRecipe, Workload, forward_backward, held_out_loss, parse_row,
    record_loss)


# ---- one training run --------------------------------------------------------------------------------

def _train_one(w: Workload, row: str, rank: int, world: int, seed: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    name, opts = parse_row(row)
    torch.manual_seed(1000 + seed)
    model = w.model()
    ddp = DDP(model)
    state = onebit = None
    n = sum(p.numel() for p in model.parameters())
    ring = 2 * (world - 1) * 4 * n / world  # a ring all-reduce of fp32, nominal
    if name == "torch":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "onebit":
        from flatcomm import optim as foptim

        onebit = opts
    else:
        state = fddp.register(ddp, name, history=w.steps + 1, **_accordion_opts(opts))
    opt, sched = w.make_optimizer(ddp.parameters(), onebit) if onebit is not None else \
        w.make_optimizer(ddp.parameters())
    if onebit is not None:
        foptim.register(ddp, opt)
    curve, onebit_wire, onebit_warm = [], [], 0
    for step in range(w.steps):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(w, ddp, step, rank, ddp.no_sync)
        w.before_step(ddp.parameters())
        compressing = onebit is not None and opt.compressing
        opt.step()
        if onebit is not None:
            onebit_wire.append(opt.last_wire_bytes if compressing else ring)
            onebit_warm += not compressing
        if sched is not None:
            sched.step()
        if not record_loss(curve, loss, world):
            break
    val = held_out_loss(w, model)  # the weights are equal on every rank
    out = {"row": row, "codec": name, "options": opts, "val": val, "curve": curve}
    if state is not None:
        steps = state.stats["steps"]
        out["residual_norm"] = [s.get("residual_norm", 0.0) for s in steps][::TRACK_EVERY]
        out["rel_error"] = [s.get("rel_error", 0.0) for s in steps][::TRACK_EVERY]
        out["wire_bytes_per_step"] = statistics.fmean(s["wire_bytes"] for s in steps) if steps else 0.0
        used = [b["codec"] for s in steps for b in s["buckets"]]
        out["codec_share"] = {c: used.count(c) / len(used) for c in sorted(set(used))} if used else {}
    elif onebit is not None:
        out["wire_bytes_per_step"] = statistics.fmean(onebit_wire) if onebit_wire else 0.0
        out["codec_share"] = {"fp32 (DDP)": onebit_warm / len(onebit_wire),
                              opt.codec.name: 1 - onebit_warm / len(onebit_wire)} if onebit_wire else {}
    else:
        out["wire_bytes_per_step"] = ring
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def _accordion_opts(opts: Dict[str, Any]) -> Dict[str, Any]:
    """Row options ``accordion=int8,accordion_every=10,accordion_threshold=0.5`` -> ``accordion=Accordion(...)``."""
    extra = {k: opts[k] for k in ("accordion_every", "accordion_threshold") if k in opts}
    if not extra:
        return opts
    from flatcomm.ddp.accordion import Accordion

    out = {k: v for k, v in opts.items() if k not in extra}
    out["accordion"] = Accordion(low=out.get("accordion", "int8"), every=extra.get("accordion_every", 10),
                                 threshold=extra.get("accordion_threshold", 0.5))
    return out


def _applies(row: str, w: Workload) -> bool:
    """OnebitAdam rows apply to the (plain) AdamW workloads only."""
    return parse_row(row)[0] != "onebit" or w.optimizer == "AdamW"


def _train(w: Workload, row: str, rank: int, world: int, seed: int) -> dict:
    if parse_row(row)[0] in ("diloco", "sparseloco"):
        from .convergence_diloco import train_diloco

        return train_diloco(w, row, rank, world, seed)
    if parse_row(row)[0] == "fsdp":
        from .convergence_fsdp import train_fsdp

        return train_fsdp(w, row, rank, world, seed)
    return _train_one(w, row, rank, world, seed)


def _rank_main(rank: int, world: int, workloads: List[str], rows: List[str], seeds: int, scale: float) -> dict:
    results: Dict[str, Dict[str, Any]] = {}
    t0 = time.perf_counter()
    for wname in workloads:
        runs: Dict[str, List[dict]] = {r: [] for r in rows}
        meta: Dict[str, Any] = {}
        for seed in range(seeds):
            w = WORKLOAD_CLASSES[wname](seed, scale)
            meta = {"optimizer": w.optimizer, "steps": w.steps}
            for row in rows:
                if not _applies(row, w):
                    continue
                r = _train(w, row, rank, world, seed)
                runs[row].append(r)
                meta["params"] = r["params"]
                if rank == 0:  # progress: a run takes seconds to minutes
                    print(f"  [{wname} seed {seed}] {row:28s} val {r['val']:.4f}  "
                          f"{time.perf_counter() - t0:6.0f}s", file=sys.stderr, flush=True)
        results[wname] = {"meta": meta, "runs": runs}
    return results


# ---- summary ---------------------------------------------------------------------------------------

def baseline(row: str, runs: Dict[str, List[dict]]) -> Optional[str]:
    """The row a row is compared with: plain FSDP2 (``fsdp``) for the FSDP2 rows with options, fp32
    DiLoCo at the same H for the lossy DiLoCo rows, torch's DDP all-reduce for the others (``fsdp``
    and fp32 DiLoCo included); None when it did not run."""
    name, opts = parse_row(row)
    base = "fsdp" if name == "fsdp" and opts else "torch"
    if name == "sparseloco" or (name == "diloco" and opts.get("codec", "int4") != "fp32"):
        from .convergence_diloco import baseline_row

        base = baseline_row(opts)  # a lossy DiLoCo row against fp32 DiLoCo at the same H
    return base if runs.get(base) else None


def summarize(raw: Dict[str, Any], rows: List[str]) -> Dict[str, Any]:
    out = {}
    for wname, wr in raw.items():
        runs = wr["runs"]
        table = []
        for row in rows:
            rs = runs[row]
            if not rs:  # a row that does not apply to this workload
                continue
            vals = [r["val"] for r in rs]
            bname = baseline(row, runs)
            base = [r["val"] for r in runs[bname]] if bname else None
            rel = [v / b - 1.0 for v, b in zip(vals, base)] if base else []
            rec = {"row": row, "codec": rs[0]["codec"], "options": rs[0]["options"], "val": vals, "rel": rel,
                   "baseline": bname, "rel_mean": statistics.fmean(rel) if rel else None,
                   "rel_sd": statistics.stdev(rel) if len(rel) > 1 else 0.0,
                   "rel_min": min(rel) if rel else None, "rel_max": max(rel) if rel else None,
                   "curves": [r["curve"] for r in rs],
                   "wire_bytes_per_step": statistics.fmean(r["wire_bytes_per_step"] for r in rs)}
            for k in ("residual_norm", "rel_error", "codec_share", "val_gathered", "bytes_by_kind",
                      "bytes_per_param_per_sync"):
                if k in rs[0]:
                    rec[k] = [r[k] for r in rs]
            table.append(rec)
        out[wname] = dict(wr["meta"], rows=table)
    return out


def print_table(doc: Dict[str, Any]) -> None:
    for wname, w in doc["workloads"].items():
        print(f"\n{wname}: {w['optimizer']}, {w['steps']} steps, {w['params']:,} parameters, "
              f"{doc['world']} ranks, {doc['seeds']} seeds")
        hdr = (f"{'row':32s} {'held-out loss':>14s} {'vs baseline: mean [min, max]':>30s} {'sd':>7s} "
               f"{'baseline':>8s} {'wire/step':>10s} {'gathered':>9s} {'B/param/sync':>12s}")
        print(hdr)
        print("-" * len(hdr))
        for r in w["rows"]:
            v = statistics.fmean(r["val"])
            rel = sd = ""
            if r["rel_mean"] is not None:
                rel = f"{100 * r['rel_mean']:+.2f}% [{100 * r['rel_min']:+.2f}, {100 * r['rel_max']:+.2f}]"
                sd = f"{100 * r['rel_sd']:.2f}%"
            gathered = f"{statistics.fmean(r['val_gathered']):9.4f}" if r.get("val_gathered") else f"{'':9s}"
            bps = f"{statistics.fmean(r['bytes_per_param_per_sync']):12.4f}" if r.get("bytes_per_param_per_sync") \
                else ""
            print(f"{r['row']:32s} {v:14.4f} {rel:>30s} {sd:>7s} {r['baseline'] or '-':>8s} "
                  f"{int(r['wire_bytes_per_step']):>10,d} {gathered} {bps}")
        if any(r.get("val_gathered") for r in w["rows"]):
            print("gathered = the FSDP2 rows' held-out loss through FSDP's forward (the weights as the "
                  "all-gathers deliver them); the other columns use the trained full-precision weights")


def plot(doc: Dict[str, Any], path: str) -> None:
    """Per workload, top: training loss, mean over seeds (10-step moving average), band = min..max of
    seeds; bottom: held-out loss relative to the row's baseline, mean and min..max of seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["workloads"])
    nrows = max(len(w["rows"]) for w in doc["workloads"].values())
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 6.5 + 0.25 * nrows), squeeze=False,
                             gridspec_kw={"height_ratios": [4.5, 2 + 0.25 * nrows]})
    for ax, wname in zip(axes[1], names):
        _plot_rel(ax, doc["workloads"][wname], plt)
    for ax, wname in zip(axes[0], names):
        w = doc["workloads"][wname]
        for i, r in enumerate(w["rows"]):
            n = min(len(c) for c in r["curves"])
            sm = [_smooth(c[:n], 10) for c in r["curves"]]
            mean = [statistics.fmean(col) for col in zip(*sm)]
            lo = [min(col) for col in zip(*sm)]
            hi = [max(col) for col in zip(*sm)]
            rel = "" if r["rel_mean"] is None else f" ({100 * r['rel_mean']:+.1f}%)"
            line, = ax.plot(range(n), mean, lw=1.3, label=r["row"] + rel, color=plt.cm.tab20(i % 20))
            ax.fill_between(range(n), lo, hi, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(f"{wname} ({w['optimizer']}), {doc['seeds']} seeds", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="held-out vs baseline (torch; FSDP2 rows: fsdp)", title_fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_rel(ax, w: Dict[str, Any], plt) -> None:
    rows = [r for r in w["rows"] if r["rel_mean"] is not None]
    for i, r in enumerate(rows):
        mean, lo, hi = (100 * r[k] for k in ("rel_mean", "rel_min", "rel_max"))
        ax.errorbar([mean], [i], xerr=[[mean - lo], [hi - mean]], fmt="o", capsize=3, color=plt.cm.tab20(i % 20))
        ax.scatter([100 * x for x in r["rel"]], [i] * len(r["rel"]), s=8, color="k", zorder=3)
    ax.set_yticks(range(len(rows)), [f"{r['row']} (vs {r['baseline']})" for r in rows], fontsize=7)
    ax.invert_yaxis()
    for x, style in ((0.0, "-"), (0.5, ":"), (-0.5, ":")):
        ax.axvline(x, color="grey", lw=0.8, ls=style)
    ax.set_xlabel("held-out loss vs baseline, % (mean, min..max and each seed)")
    ax.grid(axis="x", alpha=0.3)


def _smooth(xs: List[float], k: int) -> List[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``bench convergence`` (on its own parser, or on ``bench --help``'s subparser).

    Args:
        ap: the parser to add them to.
    """
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma separated, of {', '.join(WORKLOAD_CLASSES)} (default {','.join(WORKLOADS)})")
    ap.add_argument("--codecs", default=",".join(DEFAULT_ROWS),
                    help="rows separated by ';' or ','; options after ':' (sign:block_size=32,start_step=50)")
    ap.add_argument("--seeds", type=int, default=3, help="training runs per row, each from other weights (default 3)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every workload's step count")
    ap.add_argument("--quick", action="store_true", help="CI: 2 seeds, a few steps, torch/fp32/int8/sign")
    ap.add_argument("--preset", choices=["sparse"], default=None,
                    help="sparse: lm_diloco, the sparse-codec grid against SparseLoCo's format at H = --sync-every")
    ap.add_argument("--sync-every", type=int, default=15, help="H of --preset sparse (default 15)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the curves and summaries as JSON")
    ap.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot (needs matplotlib)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="the process group's timeout, s (default 3600)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.bench convergence", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    sep = ";" if ";" in args.codecs else None
    rows = [r for r in (args.codecs.split(sep) if sep else _split_rows(args.codecs)) if r]
    if args.quick:
        args.seeds = min(args.seeds, 2)
        args.steps_scale = min(args.steps_scale, 0.04)
        if args.codecs == ",".join(DEFAULT_ROWS):
            rows = ["torch", "fp32", "int8", "sign"]
    if args.preset == "sparse":
        from .convergence_diloco import sparse_grid_rows

        rows, args.workloads = sparse_grid_rows(args.sync_every), "lm_diloco"
    workloads = [w for w in args.workloads.split(",") if w]
    for wname in workloads:
        if wname not in WORKLOAD_CLASSES:
            ap.error(f"unknown workload {wname!r}; expected some of {', '.join(WORKLOADS)}")
    for r in rows:
        name, opts = parse_row(r)
        if name in ("fsdp", "diloco", "sparseloco"):
            import importlib

            mod = importlib.import_module(f".convergence_{'diloco' if name == 'sparseloco' else name}", __package__)
            try:
                mod.check_options(opts, name) if name == "sparseloco" else mod.check_options(opts)
            except ValueError as e:
                ap.error(f"row {r!r}: {e}")
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")

    from flatcomm.tools import spawn

    t0 = time.perf_counter()
    print(f"[bench] convergence: {', '.join(workloads)} x {len(rows)} rows x {args.seeds} seeds on {args.world} "
          f"ranks (a line per run)", file=sys.stderr, flush=True)
    raw = spawn.run(args.world, _rank_main, workloads, rows, args.seeds, args.steps_scale,
                    timeout_s=args.timeout)[0]
    doc = {"command": "convergence", "world": args.world, "seeds": args.seeds, "quick": args.quick,
           "steps_scale": args.steps_scale, "workloads": summarize(raw, rows),
           "seconds": time.perf_counter() - t0}
    print_table(doc)
    if args.preset == "sparse":
        from .convergence_diloco import markdown_table

        print("\n" + markdown_table(doc["workloads"]["lm_diloco"]["rows"]))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f)
    if args.plot:
        plot(doc, args.plot)
    print(f"\n{doc['seconds']:.0f}s on {args.world} gloo ranks (1 thread each)"
          + (f"; JSON {args.json}" if args.json else "") + (f"; plot {args.plot}" if args.plot else ""))
    return 0


def _split_rows(spec: str) -> List[str]:
    """Split ``a,b:x=1,y=2,c`` at commas that start a new row (a token without '=' begins one)."""
    rows: List[str] = []
    for tok in spec.split(","):
        if "=" in tok and rows and ":" not in tok:
            rows[-1] += "," + tok
        else:
            rows.append(tok)
    return rows


if __name__ == "__main__":
    sys.exit(main())
