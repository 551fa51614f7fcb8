"""The codec autotuner as a tool: measure the cost model on N ranks and print the decision table.

    python -m flatcomm.tune [--ranks N] [--link RATE] [--budget int8] [--sizes 64K,1M,25M]
                            [--collective all_reduce|reduce_scatter] [--json PATH] [--save PROFILE]

Each size gets a row: the chosen codec and chunk count, the predicted milliseconds of every codec in
the budget and the reason; the last line is a ``pinned={...}`` dict (numel ranges) ready to paste
into ``Tuner(pinned=...)``. ``--link`` runs the ranks behind a shaped link (:mod:`flatcomm.netlink`,
root only); without it they talk over loopback (:mod:`flatcomm.spawn`). ``--save profile.json`` writes
the measured cost model as a profile: ``Tuner(profile="profile.json")`` then makes the same
decisions on every run, without measuring.

The engine lives in :mod:`flatcomm.autotune` (``Tuner``, ``decide``, ``measure``, ...); its names
are re-exported here for backward compatibility.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import List, Optional, Sequence

from .autotune import (KINDS, PRECISION, CostModel, Decision, Tuner, allowed, decide, measure,  # noqa: F401
                       predict, save_profile, tuner_for)

__all__ = ["PRECISION", "CostModel", "Decision", "Tuner", "allowed", "decide", "measure", "predict",
           "tuner_for", "main", "pinned_ranges"]


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def _rank(rank: int, world: int, sizes: Sequence[int], budget: str, kind: str):
    costs = measure(None)
    return costs, [decide(costs, n, world, budget, kind) for n in sizes]


def pinned_ranges(sizes: Sequence[int], codecs: Sequence[str]) -> dict:
    """``{"lo-hi": codec}`` covering all sizes: boundaries at the geometric mean of neighbours with
    different codecs (first ``lo`` and last ``hi`` open)."""
    pairs = sorted(zip(sizes, codecs))
    out, lo = {}, ""
    for i, (n, c) in enumerate(pairs):
        nxt = pairs[i + 1] if i + 1 < len(pairs) else None
        if nxt is not None and nxt[1] == c:
            continue
        hi = "" if nxt is None else str(int(math.sqrt(n * nxt[0])) + 1)
        out[f"{lo}-{hi}"] = c
        lo = hi
    return out


def _table(sizes, decisions: List[Decision], budget: str) -> str:
    cands = list(allowed(budget))
    hdr = f"{'numel':>10} {'codec':>6} {'chunks':>6} " + " ".join(f"{c + ' ms':>10}" for c in cands) + "  reason"
    lines = [hdr, "-" * len(hdr)]
    for n, d in zip(sizes, decisions):
        ms = " ".join(f"{d.predicted_s[c] * 1e3:10.3f}" for c in cands)
        lines.append(f"{n:>10} {d.codec:>6} {d.chunks:>6} {ms}  {d.reason.split(' for ')[0]}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    ap.add_argument("--link", metavar="RATE[,DELAY]", help="shaped link, e.g. 1gbit (needs root)")
    ap.add_argument("--budget", default="int8", choices=PRECISION, help="least precise codec allowed")
    ap.add_argument("--sizes", default="64K,1M,25M", help="fp32 element counts (K/M/G suffixes)")
    ap.add_argument("--collective", default="all_reduce", choices=KINDS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", metavar="PATH", help="write costs, decisions and pinned as JSON")
    ap.add_argument("--save", metavar="PROFILE", help="write the measured costs as a profile for Tuner(profile=...)")
    a = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in a.sizes.split(",") if s.strip()]
    if a.ranks < 2:
        ap.error("--ranks must be >= 2")
    from . import tune as importable  # `python -m` runs this file as __main__: ranks need the real name

    args = (sizes, a.budget, a.collective)
    if a.link:
        from .netlink import Link, LinkUnavailable

        try:
            link = Link(a.ranks, a.link)
            link.setup()
        except (LinkUnavailable, ValueError) as e:
            raise SystemExit(f"flatcomm.tune: --link {a.link}: {e}") from None
        with link:
            res = link.run(a.ranks, importable._rank, *args, timeout_s=a.timeout, threads=a.threads)
    else:
        from . import spawn

        res = spawn.run(a.ranks, importable._rank, *args, timeout_s=a.timeout, threads=a.threads)
    costs, decisions = res[0]
    if any(r[1] != decisions for r in res[1:]):
        raise SystemExit("flatcomm.tune: ranks disagree (a bug: the costs are MAX-agreed)")
    where = f"a {a.link} link" if a.link else "loopback"
    print(f"flatcomm.tune: {a.ranks} ranks over {where}, {a.collective}, budget {a.budget}")
    print(f"link {costs.link_Bps / 1e9:.3g} GB/s, latency {costs.latency_s * 1e6:.3g} us; pipeline compute "
          + ", ".join(f"{c} {v / 1e9:.3g}" for c, v in costs.compute_Bps.items()) + " GB/s (fp32 input)")
    print(_table(sizes, decisions, a.budget))
    pinned = pinned_ranges(sizes, [d.codec for d in decisions])
    print(f"pinned={pinned!r}")
    if a.save:
        save_profile(a.save, costs, world=a.ranks, link=a.link, budget=a.budget,
                     measured_on="a {} link".format(a.link) if a.link else "loopback")
        print(f"wrote profile {a.save}: flatcomm.autotune.Tuner(profile={a.save!r})")
    if a.json:
        doc = {"ranks": a.ranks, "link": a.link, "budget": a.budget, "collective": a.collective,
               "costs": dataclasses.asdict(costs),
               "decisions": [dict(dataclasses.asdict(d), numel=n) for n, d in zip(sizes, decisions)],
               "pinned": pinned}
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
