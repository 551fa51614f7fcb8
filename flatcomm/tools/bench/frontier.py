"""The DiLoCo loss-bytes frontier: held-out loss over fp32 DiLoCo against bytes per sync (a tool).

    python -m flatcomm.bench frontier [--sizes 100k,1m,4m] [--rows fp32,int8,int4,top32,...,top512]
        [--seeds 2] [--syncs 20,40,80,160] [--sync-every 15] [--replicas 2]
        [--points docs/bench/frontier.jsonl] [--doc docs/diloco.md] [--plot docs/bench/frontier.png]
        [--render-only]

A *point* is one training run: a model size, a row (the outer sync's codec and recipe), a seed and
a replica count, trained for ``max(--syncs) x --sync-every`` inner steps (the ``lm_diloco`` recipe:
AdamW betas (0.9, 0.95), weight decay 0.1 on the matrices, clipping at 1, gradient accumulation over 2
micro-batches, warm-up over a tenth of the steps, then cosine decay to a tenth over the whole run),
every rank its own replica with its own batches. The held-out loss is read after the sync that ends
each of ``--syncs`` (on the synced weights, the same on every replica), so 20, 40, 80 and 160 syncs
come from one run of 160. Bytes per parameter per sync are flatcomm's count of the payload bytes the
rank sent (``outer.stats["wire_bytes"]``: the codec's actual payload sizes), never a formula.

Every finished point appends one JSON line to ``--points``; a rerun skips the points already there
(the command is resumable: stop it any time). At the end (and with ``--render-only`` alone) the table
and the picture are rendered from every line of the file (:mod:`flatcomm.tools.bench.frontier_report`)
into ``--doc`` between the markers ``<!-- frontier:begin -->`` and ``<!-- frontier:end -->``.

Rows: ``fp32``, ``int8``, ``int4`` (DiLoCo's recipe: outer lr 0.7, Nesterov 0.9, error feedback,
the two-stage sum), ``top<k>`` (flatcomm's ``sparse`` codec keeping k of every 4,096 values with
SparseLoCo's recipe as measured best here: error decay 0.95, no outer momentum, outer lr 2.0, the
gathered sum), ``top<k>s4`` (the same with ``sparse4``'s 3-bit levels, ``top<k>s1`` with ``sparse1``'s
sign and one level), or a full ``diloco:...`` row
of the convergence benchmark (its ``H`` is set from ``--sync-every``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .convergence_workloads import LMDiLoCo, forward_backward, held_out_loss, parse_row

# name: (d_model, layers, heads, peak lr) of the character-level transformer of flatcomm.tools.demo.
SIZES: Dict[str, Tuple[int, int, int, float]] = {
    "100k": (64, 2, 4, 3e-3), "1m": (128, 5, 4, 2e-3), "4m": (256, 5, 8, 1e-3)}
SPARSE_RECIPE = "mode=exact,decay=0.95,outer_lr=2.0,momentum=0.0"
DEFAULT_ROWS = ("fp32", "top128", "top64", "top256", "int4", "top32", "top512", "int8")


def row_spec(row: str, h: int) -> str:
    """The convergence benchmark's row for a frontier row name (``top128``, ``int4``, ``diloco:...``)."""
    if row in ("fp32", "int8", "int4"):
        return f"diloco:codec={row},H={h}"
    m = re.fullmatch(r"top(\d+)(s4|s1)?", row)
    if m:
        codec = {"s4": "sparse4", "s1": "sparse1"}.get(m.group(2) or "", "sparse")
        return f"diloco:codec={codec},keep={int(m.group(1))},H={h},{SPARSE_RECIPE}"
    name, opts = parse_row(row)
    if name != "diloco":
        raise ValueError(f"frontier: row {row!r} is not fp32, int8, int4, top<k>, top<k>s4, top<k>s1 or diloco:...")
    opts["H"] = h
    return "diloco:" + ",".join(f"{k}={v}" for k, v in opts.items())


class SizedLM(LMDiLoCo):
    """``lm_diloco`` at another model size and length (``steps`` inner steps)."""

    def __init__(self, seed: int, size: str, steps: int):
        super().__init__(seed, 1.0)
        self.size = size
        self.steps = steps
        self.d, self.layers, self.heads, self.lr = SIZES[size]
        self.demo_lr = self.demo.LR

    def model(self):
        return self.demo.CharTransformer(self.vocab, d=self.d, layers=self.layers, heads=self.heads)

    def make_optimizer(self, params, onebit=None):
        self.demo.LR = self.lr  # the recipe reads the demo's peak lr
        try:
            return super().make_optimizer(params, onebit)
        finally:
            self.demo.LR = self.demo_lr


def point_key(p: Dict[str, Any]) -> Tuple:
    return (p["size"], p["replicas"], p["row"], p["seed"], p["H"], p["syncs"])


def _point_rank(rank: int, world: int, point: Dict[str, Any]) -> Dict[str, Any]:
    """One point on one rank: train, read the held-out loss after the syncs in ``point["read"]``."""
    from .convergence_diloco import build_outer

    h, read = point["H"], set(point["read"])
    w = SizedLM(point["seed"], point["size"], h * point["syncs"])
    torch.manual_seed(1000 + point["seed"])  # the convergence benchmark's init per seed
    model = w.model()
    opt, sched = w.make_optimizer(model.parameters())
    name, opts = parse_row(point["spec"])
    outer = build_outer(name, opts, model, opt)
    n = sum(p.numel() for p in model.parameters())
    readings: Dict[str, Dict[str, float]] = {}
    losses: List[float] = []
    t0 = time.perf_counter()
    for step in range(w.steps):
        opt.zero_grad(set_to_none=True)
        losses.append(float(forward_backward(w, model, step, rank, contextlib.nullcontext)))
        w.before_step(model.parameters())
        opt.step()  # DiLoCo's hook: the outer sync every H steps
        sched.step()
        if (step + 1) % h == 0 and (step + 1) // h in read:
            st = outer.stats
            readings[str((step + 1) // h)] = {
                "val": held_out_loss(w, model), "train": sum(losses[-h:]) / h,
                "bytes_per_param_per_sync": st["wire_bytes"] / max(1, st["syncs"]) / n}
            model.train()
    seconds = time.perf_counter() - t0
    outer.verify()  # the replicas' masters are the same bits
    outer.close()
    return {"params": n, "readings": readings, "seconds": seconds, "step_s": seconds / w.steps}


def run_point(point: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    from flatcomm.tools import spawn

    res = spawn.run(point["replicas"], _point_rank, point, timeout_s=timeout_s, run_s=timeout_s)
    return dict(point, **res[0])


def load_points(path: str) -> List[Dict[str, Any]]:
    """Every complete line of the points file (a half-written last line is ignored)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plan(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The points of the command line, seed by seed (so every row gets a seed before any gets two)."""
    syncs = max(args.syncs)
    return [{"size": size, "replicas": args.replicas, "row": row, "spec": row_spec(row, args.sync_every),
             "seed": seed, "H": args.sync_every, "syncs": syncs, "read": sorted(args.syncs)}
            for size in args.sizes for seed in range(args.seed0, args.seed0 + args.seeds) for row in args.rows]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def _rows(s: str) -> List[str]:
    """Rows separated by ';', or by ',' where a token without '=' starts a row (``fp32,diloco:codec=sparse,
    keep=128,top64`` is three rows)."""
    if ";" in s:
        return [x for x in s.split(";") if x]
    rows: List[str] = []
    for tok in filter(None, s.split(",")):
        if "=" in tok and rows and ":" not in tok:
            rows[-1] += "," + tok
        else:
            rows.append(tok)
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``bench frontier``."""
    ap.add_argument("--sizes", type=_names, default=["100k"], help=f"model sizes, of {', '.join(SIZES)}")
    ap.add_argument("--rows", type=_rows, default=list(DEFAULT_ROWS),
                    help="fp32, int8, int4, top<k>, top<k>s4, top<k>s1 or diloco:... rows, ';' between rows with "
                         "options (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per point (default 2)")
    ap.add_argument("--seed0", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--syncs", type=_ints, default=[20, 40, 80, 160],
                    help="read the held-out loss after these syncs of one run (default 20,40,80,160)")
    ap.add_argument("--sync-every", type=int, default=15, help="H, inner steps per sync (default 15)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas, one gloo rank each (default 2)")
    ap.add_argument("--points", default="docs/bench/frontier.jsonl", help="the JSON-lines file of points")
    ap.add_argument("--doc", default="docs/diloco.md", help="markdown file to render the table into")
    ap.add_argument("--plot", default=None,
                    help="the picture (needs matplotlib; default docs/bench/frontier.png for the frontier "
                         "section, none for another: a recipe search's points make no legible picture)")
    ap.add_argument("--section", default="frontier",
                    help="render between <!-- SECTION:begin --> and <!-- SECTION:end --> (default frontier)")
    ap.add_argument("--render-only", action="store_true", help="run nothing: render the file's points")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds one point may take (default 7200)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.bench frontier", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [s for s in args.sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"frontier: unknown size(s) {bad}; expected some of {list(SIZES)}")
    if args.seeds < 1 or args.replicas < 2 or not args.syncs:
        raise SystemExit("frontier: --seeds >= 1, --replicas >= 2 and --syncs are needed")
    todo = plan(args)  # also checks every row name
    if not args.render_only:
        done = {point_key(p) for p in load_points(args.points)}
        for k, point in enumerate(todo):
            if point_key(point) in done:
                continue
            print(f"[frontier] {k + 1}/{len(todo)} {point['size']} {point['row']} seed {point['seed']} "
                  f"x{point['replicas']}", file=sys.stderr, flush=True)
            res = run_point(point, args.timeout)
            os.makedirs(os.path.dirname(os.path.abspath(args.points)), exist_ok=True)
            with open(args.points, "a") as f:
                f.write(json.dumps(res) + "\n")
            last = res["readings"][str(point["syncs"])]
            print(f"[frontier]   val {last['val']:.4f}  {last['bytes_per_param_per_sync']:.4f} B/param/sync  "
                  f"{res['seconds']:.0f} s ({1e3 * res['step_s']:.0f} ms/step)", file=sys.stderr, flush=True)
    from .frontier_report import render

    plot = args.plot if args.plot is not None else ("docs/bench/frontier.png" if args.section == "frontier" else "")
    print(render(load_points(args.points), args.doc, plot, args.section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
