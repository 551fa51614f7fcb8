"""The codec autotuner as a tool: measure the cost model on N ranks and print the decision table.

    python -m flatcomm.tune [--ranks N] [--ranks-per-node G] [--link RATE] [--budget int8]
                            [--sizes 64K,1M,25M] [--collective all_reduce|reduce_scatter]
                            [--json PATH] [--save PROFILE]

``--ranks-per-node G`` (G > 1, N = ranks / G > 1 nodes): the ranks form a :class:`flatcomm.Topology`,
the profile holds both tiers' link costs and the all-reduce rows choose between flat and
hierarchical with a codec per tier (with ``--link``, the nodes are network namespaces joined by it).

Each size gets a row: the chosen codec and chunk count, the predicted milliseconds of every codec in
the budget and the reason; the last line is a ``pinned={...}`` dict (numel ranges) ready to paste
into ``Tuner(pinned=...)``. ``--link`` runs the ranks behind a shaped link (:mod:`flatcomm.tools.netlink`,
root only); without it they talk over loopback (:mod:`flatcomm.tools.spawn`).

The engine lives in the library, :mod:`flatcomm.autotune` (``Tuner``, ``decide``, ``measure``, ...).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import List, Optional, Sequence

from flatcomm.autotune import KINDS, PRECISION, Decision, allowed, decide, measure, save_profile
from flatcomm.tools._cli import add_version, format_size, positive, say
from flatcomm.tools._cli import sizes as size_list
from flatcomm.tools.netlink import link_arg

__all__ = ["main", "pinned_ranges"]


def _rank(rank: int, world: int, sizes: Sequence[int], budget: str, kind: str, local_size: int = 1):
    topo = None
    if local_size > 1:
        from flatcomm import Topology

        topo = Topology(local_size)
    costs = measure(None, topology=topo)
    paths = ("flat", "hierarchical") if topo is not None and not topo.flat else None
    return costs, [decide(costs, n, world, budget, kind, paths=paths) for n in sizes]


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
    for d in decisions:  # a topology adds hierarchical candidates (and names them hier:inter/intra)
        cands += [c for c in d.predicted_s if c not in cands]
    hdr = f"{'numel':>10} {'choice':>15} {'chunks':>6} " + " ".join(f"{c + ' ms':>10}" for c in cands) + "  reason"
    lines = [hdr, "-" * len(hdr)]
    for n, d in zip(sizes, decisions):
        ms = " ".join(f"{d.predicted_s[c] * 1e3:10.3f}" if c in d.predicted_s else f"{'-':>10}" for c in cands)
        choice = f"hier:{d.codec}/{d.intra_codec}" if d.path == "hierarchical" else d.codec
        lines.append(f"{format_size(n):>10} {choice:>15} {d.chunks:>6} {ms}  {d.reason.split(' for ')[0]}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flatcomm.tune", description=__doc__.split("\n")[0])
    add_version(ap)
    ap.add_argument("--ranks", type=positive(int), default=2, help="gloo ranks, at least 2 (default 2)")
    ap.add_argument("--ranks-per-node", type=positive(int), default=1,
                    help="ranks per node G (a Topology: both tiers measured; default 1 = flat)")
    ap.add_argument("--link", metavar="RATE[,DELAY]", type=link_arg, help="shaped link, e.g. 1gbit (needs root)")
    ap.add_argument("--budget", default="int8", choices=PRECISION, help="least precise codec allowed")
    ap.add_argument("--sizes", type=size_list, default=size_list("64K,1M,25M"),
                    help="fp32 element counts, comma separated (K/M/G suffixes; default 64K,1M,25M)")
    ap.add_argument("--collective", default="all_reduce", choices=KINDS)
    ap.add_argument("--threads", type=positive(int), default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--timeout", type=positive(float), default=300, help="seconds (default 300)")
    ap.add_argument("--json", metavar="PATH", help="write costs, decisions and pinned as JSON")
    ap.add_argument("--save", metavar="PROFILE", help="write the measured costs as a profile for Tuner(profile=...)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    sizes = a.sizes
    if a.ranks < 2:
        ap.error("--ranks must be >= 2")
    from flatcomm.tools import tune as importable  # `python -m` runs this file as __main__: ranks need the real name

    g = a.ranks_per_node
    if a.ranks % g:
        ap.error(f"--ranks {a.ranks} does not split into nodes of --ranks-per-node {g}")
    args = (sizes, a.budget, a.collective, g)
    where = f"a {a.link} link" if a.link else "loopback"
    say("tune", f"{a.ranks} ranks over {where}: measuring the cost model")
    if a.link:
        from .netlink import Link, LinkUnavailable

        try:
            link = Link(a.ranks // g, a.link, ranks_per_node=g) if g > 1 else Link(a.ranks, a.link)
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
    print(f"flatcomm.tune: {a.ranks} ranks over {where}, {a.collective}, budget {a.budget}")
    print(f"link {costs.link_Bps / 1e9:.3g} GB/s, latency {costs.latency_s * 1e6:.3g} us; pipeline compute "
          + ", ".join(f"{c} {v / 1e9:.3g}" for c, v in costs.compute_Bps.items()) + " GB/s (fp32 input)")
    print(_table(sizes, decisions, a.budget))
    pinned = pinned_ranges(sizes, [d.codec for d in decisions])
    print(f"pinned={pinned!r}")
    if a.save:
        save_profile(a.save, costs, world=a.ranks, ranks_per_node=g, link=a.link, budget=a.budget,
                     measured_on="a {} link".format(a.link) if a.link else "loopback")
        print(f"wrote profile {a.save}: flatcomm.autotune.Tuner(profile={a.save!r})", file=sys.stderr)
    if a.json:
        doc = {"ranks": a.ranks, "link": a.link, "budget": a.budget, "collective": a.collective,
               "costs": dataclasses.asdict(costs),
               "decisions": [dict(dataclasses.asdict(d), numel=n) for n, d in zip(sizes, decisions)],
               "pinned": pinned}
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        say("tune", f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
