"""The frontier's table and picture (:mod:`flatcomm.tools.bench.frontier` runs the points).

Every lossy row is compared with fp32 DiLoCo of the same model size, replica count, H and seed
(paired per seed: ``val / val_fp32 - 1``), at each number of syncs read. Bytes per parameter per sync
are the rows' own counts of their payload bytes, the mean over the run's syncs.
"""
from __future__ import annotations

import os
import re
import statistics
from typing import Any, Dict, List, Optional, Tuple

BEGIN, END = "<!-- frontier:begin -->", "<!-- frontier:end -->"
PARITY = 0.01  # "within +1% of fp32 DiLoCo"


def _order(row: str) -> Tuple[int, int, str]:
    m = re.fullmatch(r"top(\d+)(s4|s1)?", row)
    if m:
        return (1, -int(m.group(1)), row)
    return ({"fp32": -3, "int8": -2, "int4": -1}.get(row, 2), 0, row)


def short(row: str) -> str:
    """A table's name for a row: ``diloco:codec=sparse,keep=128,...,outer_lr=3.0`` -> ``top128 decay 0.95 lr 3.0``."""
    if not row.startswith("diloco:"):
        return row
    opts = dict(kv.split("=", 1) for kv in row.split(":", 1)[1].split(",") if "=" in kv)
    codec = opts.pop("codec", "int4")
    suffix = {"sparse4": "s4", "sparse1": "s1"}.get(codec, "")
    name = f"top{opts.pop('keep', 64)}{suffix}" if codec.startswith("sparse") else codec
    words = {"decay": "decay", "outer_lr": "lr", "momentum": "momentum", "mode": "", "H": None}
    extra = [f"{words.get(k, k)} {v}".strip() for k, v in opts.items()
             if words.get(k, k) is not None and not (k == "mode" and v == "exact")]
    return " ".join([name] + extra)


def summarize(points: List[Dict[str, Any]]) -> Dict[Tuple[str, int, int, int], Dict[str, Dict[int, Dict[str, Any]]]]:
    """{(size, replicas, H, syncs of the run): {row: {syncs read: {"val": [...], "rel": [...], "seeds": [...],
    "bpp": mean}}}}: runs of another length are another table (their learning-rate schedule differs)."""
    base: Dict[Tuple, float] = {}
    for p in points:
        if p["row"] == "fp32":
            for s, r in p["readings"].items():
                base[(p["size"], p["replicas"], p["H"], p["syncs"], p["seed"], int(s))] = r["val"]
    out: Dict[Tuple[str, int, int, int], Dict[str, Dict[int, Dict[str, Any]]]] = {}
    seen = set()
    for p in points:
        k = (p["size"], p["replicas"], p["H"], p["row"], p["seed"], p["syncs"])
        if k in seen:  # a point run twice counts once
            continue
        seen.add(k)
        rows = out.setdefault((p["size"], p["replicas"], p["H"], p["syncs"]), {})
        for s, r in p["readings"].items():
            cell = rows.setdefault(p["row"], {}).setdefault(int(s), {"val": [], "rel": [], "seeds": [], "bpp": []})
            cell["val"].append(r["val"])
            cell["seeds"].append(p["seed"])
            cell["bpp"].append(r["bytes_per_param_per_sync"])
            b = base.get((p["size"], p["replicas"], p["H"], p["syncs"], p["seed"], int(s)))
            if b is not None and p["row"] != "fp32":
                cell["rel"].append(r["val"] / b - 1.0)
    for rows in out.values():
        for cells in rows.values():
            for c in cells.values():
                c["bpp"] = statistics.fmean(c["bpp"])
    return out


def _cell(c: Optional[Dict[str, Any]], fp32: bool) -> str:
    if not c:
        return ""
    if fp32:
        sd = statistics.stdev(c["val"]) if len(c["val"]) > 1 else 0.0
        return f"{statistics.fmean(c['val']):.4f} ({sd:.4f}, n={len(c['val'])})"
    if not c["rel"]:
        return f"{statistics.fmean(c['val']):.4f} (no fp32 pair)"
    r = [100 * x for x in c["rel"]]
    return f"{statistics.fmean(r):+.2f}% [{min(r):+.2f}, {max(r):+.2f}] n={len(r)}"


def lowest_at_parity(rows: Dict[str, Dict[int, Dict[str, Any]]], at: List[int]) -> Optional[str]:
    """The row with the fewest bytes per sync whose mean is within +1% of fp32 DiLoCo at every syncs
    count in ``at`` (all must have been read), or None."""
    ok = []
    for row, cells in rows.items():
        if row == "fp32" or any(s not in cells or not cells[s]["rel"] for s in at):
            continue
        if all(statistics.fmean(cells[s]["rel"]) <= PARITY for s in at):
            ok.append((cells[at[-1]]["bpp"], row))
    return min(ok)[1] if ok else None


def markdown(points: List[Dict[str, Any]]) -> str:
    summary = summarize(points)
    out: List[str] = []
    for (size, replicas, h, length), rows in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2],
                                                                                  -kv[0][3])):
        params = next(p["params"] for p in points if p["size"] == size)
        syncs = sorted({s for cells in rows.values() for s in cells})
        out.append(f"**{size}** ({params:,} parameters), {replicas} replicas, H = {h}, runs of {length} syncs: "
                   "held-out loss vs fp32 DiLoCo at the same seed, mean [min, max] over seeds (fp32 row: the "
                   "loss, mean (sd))")
        out.append("")
        out.append("| row | B/param/sync | " + " | ".join(f"{s} syncs" for s in syncs) + " |")
        out.append("|---|---|" + "---|" * len(syncs))
        for row in sorted(rows, key=_order):
            cells = rows[row]
            bpp = cells[syncs[-1]]["bpp"] if syncs[-1] in cells else next(iter(cells.values()))["bpp"]
            out.append(f"| `{short(row)}` | {bpp:.4f} | " + " | ".join(_cell(cells.get(s), row == "fp32") for s in syncs)
                       + " |")
        at = [s for s in (80, 160) if s in syncs] or syncs[-1:]
        if at:
            best = lowest_at_parity(rows, at)
            out.append("")
            where = " and ".join(str(s) for s in at)
            out.append(f"Fewest bytes within +1% of fp32 DiLoCo (mean) at {where} syncs: "
                       + (f"**`{short(best)}`** ({rows[best][at[-1]]['bpp']:.4f} B/param/sync, "
                          f"{len(rows[best][at[-1]]['rel'])} seeds)." if best
                          else "none measured."))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def plot(points: List[Dict[str, Any]], path: str, syncs: int = 160) -> bool:
    """Loss ratio to fp32 DiLoCo against B/param/sync (log), a line per model size (and replica count),
    at ``syncs`` (solid) and ``syncs // 2`` (dashed); bars: min..max over seeds."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    runs = {k: v for k, v in summarize(points).items() if k[3] == syncs}  # the full-length runs
    for i, ((size, replicas, h, _), rows) in enumerate(sorted(runs.items())):
        color = plt.cm.tab10(i % 10)
        for s, style in ((syncs, "-"), (syncs // 2, "--")):
            pts = sorted((c[s]["bpp"], 100 * statistics.fmean(c[s]["rel"]), 100 * min(c[s]["rel"]),
                          100 * max(c[s]["rel"]), row) for row, c in rows.items() if s in c and c[s]["rel"])
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(x, y, yerr=err, fmt="o" + style, color=color, capsize=3, ms=4, lw=1.2,
                        label=f"{size}, {replicas} replicas, H = {h}: at sync {s} of {syncs}")
            if style == "-":
                for p in pts:
                    ax.annotate(p[4], (p[0], p[1]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = ax.get_xlim()
    ax.set_xticks([t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 4) if lo <= t <= hi])
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axhline(100 * PARITY, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("bytes per parameter per sync (payload, as counted by the sync)")
    ax.set_ylabel("held-out loss vs fp32 DiLoCo, %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def render(points: List[Dict[str, Any]], doc: Optional[str], picture: Optional[str],
           section: str = "frontier") -> str:
    """The markdown of ``points``; written into ``doc`` between the markers ``<!-- section:begin -->``
    and ``<!-- section:end -->`` (when both are there) and the picture to ``picture``. Returns the
    markdown."""
    md = markdown(points) if points else "No points yet.\n"
    if picture and points:
        plot(points, picture)
    begin, end = BEGIN.replace("frontier", section), END.replace("frontier", section)
    if doc and os.path.exists(doc):
        text = open(doc).read()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            tail = rest.split(end, 1)[1]
            with open(doc, "w") as f:
                f.write(head + begin + "\n" + md + end + tail)
    return md
