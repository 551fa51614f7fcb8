"""The user's number, summarised (:mod:`flatcomm.tools.bench.wallclock`'s runs): per link and row,
the held-out loss at the budget and the time to reach int4 DiLoCo's loss at the budget (same seed),
mean [min, max] over seeds; a markdown table and a picture (held-out loss against wall-clock).

Both numbers are read from a run's held-out curve, the (seconds, loss) points taken on the way, by
linear interpolation: the loss at the budget between the last point before it and the first after
(the run stops at the first sync past it); the time to a target where the curve first gets to it.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

BEGIN, END = "<!-- wallclock:begin -->", "<!-- wallclock:end -->"
TARGET_ROW = "int4"
NAMES = {"ddp": "DDP every step (gloo all-reduce)", "fp32": "DiLoCo fp32", "int4": "DiLoCo int4 + EF",
         "auto": "DiLoCo `codec=\"auto\"`", "sparseloco": "SparseLoCo (Templar's format)",
         "torchft": "torchft 0.2 DiLoCo (fp32)"}


def name(row: str) -> str:
    if row.startswith("top"):
        return f"DiLoCo sparse, top-{row[3:]} of 4,096"
    return NAMES.get(row, row)


def loss_at(curve: Sequence[Sequence[float]], t: float) -> float:
    """The curve's loss at time ``t``, linear between its points (its last value past its end)."""
    pts = sorted(curve)
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def time_to(curve: Sequence[Sequence[float]], target: float, until: Optional[float] = None) -> Optional[float]:
    """The first time the curve gets to ``target`` or below (linear between points), None if it does
    not by ``until`` (default: its end)."""
    pts = sorted(curve)
    if pts[0][1] <= target:
        return pts[0][0]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if v1 <= target:
            t = t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
            return t if until is None or t <= until * (1 + 1e-9) else None  # (the budget's own loss: rounding)
    return None


def _spread(xs: List[float]) -> Dict[str, Any]:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {"n": 0}


def summarize(points: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``{link: {"seconds", "rows": {row: {...}}, "best"}}``: per row the loss at the budget and the
    time to the target over seeds, the skipped runs with their reasons, auto's choices."""
    out: Dict[str, Any] = {}
    for link in dict.fromkeys(p["link"] for p in points):
        pts = [p for p in points if p["link"] == link]
        budget = pts[0]["seconds"]
        target = {p["seed"]: loss_at(p["evals"], budget) for p in pts
                  if p["row"] == TARGET_ROW and "evals" in p}
        rows: Dict[str, Any] = {}
        for row in dict.fromkeys(p["row"] for p in pts):
            ran = [p for p in pts if p["row"] == row and "evals" in p]
            times = [time_to(p["evals"], target[p["seed"]], budget) for p in ran if p["seed"] in target]
            r = {"loss": _spread([loss_at(p["evals"], budget) for p in ran]),
                 "to_target": _spread([t for t in times if t is not None]), "reached": sum(t is not None for t in times),
                 "paired": len(times), "seeds": [p["seed"] for p in ran],
                 "step_s": _spread([p["step_s"] for p in ran]), "syncs": _spread([p["syncs"] for p in ran]),
                 "tx_bpp": _spread([p["tx_bytes_per_param_per_sync"] for p in ran]),
                 "skipped": sorted({p["skipped"] for p in pts if p["row"] == row and "skipped" in p}),
                 "auto": [p["auto"] for p in ran if p.get("auto")], "curves": [p["evals"] for p in ran]}
            rows[row] = r
        ranked = sorted((r["loss"]["mean"], row) for row, r in rows.items() if r["loss"]["n"])
        out[link] = {"seconds": budget, "rows": rows, "best": ranked[0][1] if ranked else None,
                     "params": next((p["params"] for p in pts if "params" in p), None),
                     "H": next((p["H"] for p in pts if "H" in p), None)}
    return out


def _cell(s: Dict[str, Any], fmt: str) -> str:
    if not s["n"]:
        return "-"
    return f"{s['mean']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def _auto_note(choices: List[Dict[str, Any]]) -> str:
    picks = [c["codec"] + (f" top-{c['keep']}" if c.get("keep") else "") for c in choices]
    return "picked " + ", ".join(f"{k} x{picks.count(k)}" for k in dict.fromkeys(picks)) if picks else ""


def markdown(summary: Dict[str, Any]) -> str:
    """One table per link: loss at the budget, time to int4's loss, steps' time, syncs, bytes."""
    out = []
    for link, s in summary.items():
        out += [f"**{link}**, {s['seconds']:g} s of wall-clock per run, 2 replicas, "
                f"{s['params'] or 0:,} parameters, H = {s['H']}: mean [min, max] over seeds (n)", "",
                "| row | held-out loss at the budget | time to int4's loss, s (reached) | s per inner step "
                "| syncs (DDP: steps) | B/param/sync (DDP: step) off a node | note |", "|---|---|---|---|---|---|---|"]
        for row, r in s["rows"].items():
            loss = _cell(r["loss"], ".4f") + f" ({r['loss']['n']})"
            if row == s["best"]:
                loss = f"**{loss}**"
            reach = f"{_cell(r['to_target'], '.0f')} ({r['reached']}/{r['paired']})" if r["paired"] else "-"
            note = "; ".join(filter(None, [_auto_note(r["auto"])] +
                                    [f"skipped: {why}" for why in r["skipped"]]))
            syncs = f"{r['syncs']['mean']:.0f}" if r["syncs"]["n"] else "-"
            step = f"{r['step_s']['mean'] * 1e3:.0f} ms" if r["step_s"]["n"] else "-"
            bpp = f"{r['tx_bpp']['mean']:.3f}" if r["tx_bpp"]["n"] else "-"
            out.append(f"| {name(row)} | {loss} | {reach} | {step} | {syncs} | {bpp} | {note} |")
        out += ["", f"Lowest held-out loss at the budget: **{name(s['best'])}**." if s["best"] else "", ""]
    return "\n".join(out).rstrip() + "\n"


def _mean_curve(curves: List[List[List[float]]], grid: List[float]) -> List[float]:
    return [statistics.fmean(loss_at(c, t) for c in curves) for t in grid]


def plot(summary: Dict[str, Any], path: str) -> bool:
    """Held-out loss against wall-clock, mean over seeds, a panel per link; dotted: int4's final loss."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6.5 * len(summary), 4.5), squeeze=False)
    for ax, (link, s) in zip(axes[0], summary.items()):
        grid = [s["seconds"] * i / 60 for i in range(61)]
        for i, (row, r) in enumerate(s["rows"].items()):
            if r["curves"]:
                ax.plot(grid, _mean_curve(r["curves"], grid), color=plt.cm.tab10(i % 10), lw=1.4,
                        label=name(row).replace("`", ""))
        if s["rows"].get(TARGET_ROW, {}).get("loss", {}).get("n"):
            ax.axhline(s["rows"][TARGET_ROW]["loss"]["mean"], color="grey", lw=0.8, ls=":")
        ax.set_title(f"{link}, 2 replicas")
        ax.set_xlabel("wall-clock, s (held-out evaluations off the clock)")
        ax.set_ylabel("held-out loss (mean over seeds)")
        ax.set_ylim(top=min(4.5, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def render(summary: Dict[str, Any], doc: str, picture: Optional[str] = None) -> Tuple[str, bool]:
    """Write the markdown between the doc's markers (when both are there) and the picture; returns
    (the markdown, whether the doc was written)."""
    md = markdown(summary) if summary else "No runs yet.\n"
    if picture and summary:
        plot(summary, picture)
    if not os.path.exists(doc):
        return md, False
    text = open(doc).read()
    if BEGIN not in text or END not in text:
        return md, False
    head, rest = text.split(BEGIN, 1)
    with open(doc, "w") as f:
        f.write(head + BEGIN + "\n" + md + END + rest.split(END, 1)[1])
    return md, True
