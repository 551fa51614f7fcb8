"""flatcomm benchmarks from one command line (a tool: the library never imports this package).

    python -m flatcomm.bench kernels     [--quick] [--sizes 1M,25M] [--codecs int8,int4] [--block-sizes]
    python -m flatcomm.bench collectives [--ranks N] [--link RATE[,DELAY]] [--sizes 1M] [--quick]
    python -m flatcomm.bench collectives --nodes N --ranks-per-node G --link 1gbit [--sizes 24M]
    python -m flatcomm.bench scale       [--measured P.json ...] [--project-nodes 128] [--project-gpus 8] [--plot P.png]
    python -m flatcomm.bench ddp         [--ranks N] [--link 1gbit] [--params 25e6] [--hooks ...]
    python -m flatcomm.bench fsdp        [--ranks N] [--link 1gbit] [--codecs default,int8]
    python -m flatcomm.bench fsdp --nodes N --ranks-per-node G --link 1gbit --weights int8,int4 [--param-dtype bf16]
    python -m flatcomm.bench backend     [--ranks 4] [--sizes 4K,1M,100M] (the flatcomm backend vs gloo)
    python -m flatcomm.bench diloco      [--link 100mbit] [--params 25e6] [--sync-every 40] [--replicas 2,4]
                                         [--codecs int4,sparse,sparse:exact,sparseloco] [--time-codecs int4,sparse]
    python -m flatcomm.bench convergence [--quick] [--workloads lm,cnn,mlp_sgd,lm_recipe] [--seeds 3] [--codecs ...]
                                         [--preset sparse --sync-every 15] (sparse vs SparseLoCo's format)
    common: [--json PATH] [--plot PATH.png] [--timeout S]; --version

``--link`` runs each rank in its own network namespace joined by a rate-limited link
(:mod:`flatcomm.tools.netlink`, needs root); without it the ranks talk over loopback
(:mod:`flatcomm.tools.spawn`).

The measurements live beside this module: ``kernels.bench_size``, ``collectives._rank_main``,
``ddp._worker`` and ``fsdp._rank_main``; this module adds the runner (loopback or link), one table
(stdout; progress and warnings go to stderr), JSON and plots.

JSON: ``{"command", "world", "link", "results": [...], "failed": [...]}``;
every record in ``results`` has ``name`` (``torch-allreduce``, ``torch-quant-perchannel``,
``torch-powersgd-r1``, ``fp32``, ``int8``, ``int4``, ``sign``, ``auto``, ...), ``step_s`` and ``comm_s``
(medians per step; for a collective both are its time, for a kernel ``comm_s`` is 0) and
``wire_bytes`` (bytes one rank sends per step; ``wire_estimated`` marks nominal volumes of torch's
own collectives).

``collectives --nodes N`` (with ``--link``) runs N namespaces of G ranks (``benchmarks/bench_nodes.py``)
and writes records ``{"path": "torch"|"flat"|"hierarchical", "codec", "time_s", "cross_node_bytes",
...}``: ``cross_node_bytes`` is what left the busiest node per all-reduce, from the kernel's
counters of its link interface.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

from flatcomm.ops.codecs import CODECS
from flatcomm.tools._cli import add_version, codecs, format_size, names, parse_size, positive, say, sizes

COMMANDS = ("kernels", "collectives", "ddp", "fsdp", "scale", "backend", "diloco", "convergence", "frontier")
# Commands with a CLI of their own (their modules' main); ``--help`` lists them through their add_arguments.
OWN_CLI = {"backend": "the flatcomm backend vs gloo: collectives, a DDP and an FSDP2 step",
           "diloco": "DiLoCo over a shaped slow link: bytes per sync, inner-step time (needs root)",
           "convergence": "training runs per codec: held-out loss against torch's",
           "frontier": "DiLoCo's loss-bytes frontier: loss over fp32 DiLoCo against bytes per sync"}
FIXED = CODECS
# The team's targets for these numbers are in docs/bench/targets.md, not in users' tables.


def _say(msg: str) -> None:
    say("bench", msg)


# ---- running ranks: loopback or a shaped link ------------------------------------------------------


def _run_ranks(a: argparse.Namespace, meta: dict, fn: Callable, *args: Any, timeout_s: float) -> List[Any]:
    if a.link:
        from flatcomm.tools.netlink import Link, LinkUnavailable

        nodes, g = getattr(a, "nodes", None), getattr(a, "ranks_per_node", 1)
        try:
            if nodes:
                link = Link(nodes, a.link, ranks_per_node=g, require_delay=not a.allow_no_delay)
            else:
                link = Link(a.ranks, a.link, require_delay=not a.allow_no_delay)
            link.setup()
        except (LinkUnavailable, ValueError) as e:
            raise SystemExit(f"flatcomm.bench: --link {a.link}: {e}") from None
        with link:
            meta["link"] = dict(link.info(), spec=a.link)
            _say(f"link: {link.describe()}")
            return link.run(link.world if nodes else a.ranks, fn, *args, timeout_s=timeout_s,
                            threads=a.threads)
    from flatcomm.tools import spawn

    meta["link"] = None
    return spawn.run(a.ranks, fn, *args, timeout_s=timeout_s, threads=a.threads)


# ---- kernels -----------------------------------------------------------------------------------------


def bench_kernels(a: argparse.Namespace, meta: dict) -> List[dict]:
    import torch

    import flatcomm

    bk = importlib.import_module(".kernels", __name__)
    if a.block_sizes:
        n = (a.sizes or [25 << 20])[0]
        meta["config"] = {"block_sizes": True, "numel": n, "reps": a.reps}
        _say(f"kernels: int8 encode+EF by block size, {format_size(n)} values")
        rows = bk.bench_block_sizes(n, a.reps)
    else:
        if a.quick:
            sizes, codecs, reps = [1 << 20, 25 << 20], ["int8", "int4", "sign", "bf16"], 5
        else:
            sizes, codecs, reps = [1 << 20, 1 << 22, 1 << 24], list(flatcomm.CODECS), a.reps
        sizes, codecs = a.sizes or sizes, a.codecs or codecs
        meta["config"] = {"sizes": sizes, "codecs": codecs, "reps": reps, "reference": not a.no_ref}
        _say(f"kernels: sizes {', '.join(map(format_size, sizes))}, codecs {', '.join(codecs)}, "
             f"{torch.get_num_threads()} threads")
        rows = []
        for n in sizes:
            bk.bench_size(n, codecs, reps, not a.no_ref, rows)
    out = []
    for r in rows:
        codec, n = r["codec"], r["numel"]
        rec = {"name": codec or r["op"], "op": r["op"], "numel": n, "step_s": r["median_s"], "comm_s": 0.0,
               "min_s": r["min_s"], "max_s": r["max_s"], "spread": r["spread"], "samples": r["samples"],
               "wire_bytes": r.get("wire_bytes", flatcomm.wire_bytes(codec, n) if codec else 0)}
        for k in ("gbps", "x_copy", "vs_torch", "block_size", "rel_error"):
            if k in r:
                rec[k] = r[k]
        out.append(rec)
    warning = noisy_warning(out)
    if warning:
        meta.setdefault("warnings", []).append(warning)
    return out


def noisy_warning(results: List[dict]) -> Optional[str]:
    """A warning when timings varied too much (max/min above kernels.NOISY_SPREAD) to be trusted."""
    from .kernels import NOISY_SPREAD

    noisy = [r for r in results if r["spread"] > NOISY_SPREAD]
    if not noisy:
        return None
    return (f"{len(noisy)} of {len(results)} timings varied by more than {NOISY_SPREAD}x (max/min, marked !): "
            f"other load on this machine; ratios use the fastest sample, rerun on a quiet machine to trust them")


def _spread(r: dict) -> str:
    from .kernels import NOISY_SPREAD

    return f"{r['spread']:.1f}" + ("!" if r["spread"] > NOISY_SPREAD else "")


def table_kernels(results: List[dict]) -> str:
    if results and "block_size" in results[0]:
        hdr = f"{'block':>6} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'wire/fp32':>10} {'rel. error':>11}"
        lines = [hdr, "-" * len(hdr)]
        for r in results:
            lines.append(f"{r['block_size']:>6} {r['step_s'] * 1e3:10.3f} {r['min_s'] * 1e3:8.3f} "
                         f"{r['max_s'] * 1e3:8.3f} {r['wire_bytes'] / (4 * r['numel']):10.4f} {r['rel_error']:11.2e}")
        lines.append("int8 encode with error feedback by block size (one fp32 scale per block); rel. error = "
                     "||decode - x|| / ||x|| on values of uneven magnitude.")
        return "\n".join(lines)
    nw = max([4] + [len(r["name"]) for r in results])  # column widths: names like "ordered_sum W=4"
    ow = max([2] + [len(r["op"]) for r in results if r["op"] != r["name"]])
    hdr = (f"{'name':<{nw}} {'op':<{ow}} {'size':>6} {'median ms':>10} {'min ms':>9} {'spread':>7} {'GB/s':>7} "
           f"{'x copy':>7} {'vs torch':>9} {'wire MB':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        op = "" if r["op"] == r["name"] else r["op"]
        ref = f"{r['vs_torch']:8.1f}x" if r.get("vs_torch") else f"{'-':>9}"
        lines.append(f"{r['name']:<{nw}} {op:<{ow}} {format_size(r['numel']):>6} {r['step_s'] * 1e3:10.3f} "
                     f"{r['min_s'] * 1e3:9.3f} {_spread(r):>7} {r['gbps']:7.1f} {r['x_copy']:7.2f} {ref} "
                     f"{r['wire_bytes'] / 1e6:8.2f}")
    lines.append("times per call (torch.utils.benchmark); spread = max/min of the op's (and its torch reference's) "
                 "samples, ! above 1.5: disturbed by other load; "
                 "GB/s = bytes the op must read and write / fastest time; x copy = vs Tensor.copy_ at the same "
                 "size; vs torch = speed-up over the pure-torch reference (fastest times); wire = encoded payload.")
    return "\n".join(lines)


# ---- collectives -------------------------------------------------------------------------------------


def bench_nodes(a: argparse.Namespace, meta: dict) -> List[dict]:
    """``collectives --nodes``: torch / flat / hierarchical all-reduce with cross-node bytes."""
    from flatcomm.ops.codecs import CODECS

    if not a.link:
        raise SystemExit("flatcomm.bench: --nodes needs --link (the nodes are joined by a shaped link)")
    bn = importlib.import_module(".nodes", __name__)
    sizes = a.sizes or [1 << 20]
    codecs = a.codecs or ["fp32", "int8", "int4", "sign"]
    for c in codecs:
        if c not in CODECS:
            raise SystemExit(f"flatcomm.bench: unknown codec {c!r} for --nodes (one of {', '.join(CODECS)})")
    paths = a.paths
    for p in paths:
        if p not in ("torch", "flat", "hierarchical"):
            raise SystemExit(f"flatcomm.bench: unknown path {p!r} (torch, flat, hierarchical)")
    if "hierarchical" in paths and not bn.hierarchical_available():
        _say("this flatcomm has no two-level all-reduce (flatcomm.Topology): hierarchical rows skipped")
    cfg = dict(sizes=sizes, codecs=codecs, paths=paths, reps=3 if a.quick else a.reps, warmup=1)
    meta["config"] = cfg
    meta["world"] = a.nodes * a.ranks_per_node
    _say(f"collectives: {a.nodes} nodes x {a.ranks_per_node} ranks, sizes {sizes}, codecs {codecs}, paths {paths}")
    rows = _run_ranks(a, meta, bn._rank_main, cfg, timeout_s=a.timeout)[0]
    base = {r["numel"]: r for r in rows if r["path"] == "torch"}
    flat = {(r["numel"], r["codec"]): r for r in rows if r["path"] == "flat"}
    for r in rows:
        r.update(name=f"{r['path']}-{r['codec']}", step_s=r["time_s"], comm_s=r["time_s"],
                 wire_bytes=int(r["cross_node_bytes"]), wire_estimated=False)
        t = base.get(r["numel"])
        if t is not None:
            r["time_vs_torch"] = r["time_s"] / t["time_s"]
            r["bytes_vs_torch"] = r["cross_node_bytes"] / max(t["cross_node_bytes"], 1.0)
        f = flat.get((r["numel"], r["codec"]))
        if f is not None and r["path"] == "hierarchical":
            r["time_vs_flat"] = r["time_s"] / f["time_s"]
            r["bytes_vs_flat"] = r["cross_node_bytes"] / max(f["cross_node_bytes"], 1.0)
    return rows


def table_nodes(results: List[dict]) -> str:
    hdr = (f"{'size':>8} {'path':<13} {'codec':<6} {'time ms':>9} {'MB left node':>12} {'t/torch':>8} "
           f"{'B/torch':>8} {'t/flat':>7} {'B/flat':>7}")
    lines = [hdr, "-" * len(hdr)]

    def f(r, k, w):
        return f"{r[k]:{w}.3f}" if k in r else f"{'-':>{w}}"

    for r in results:
        lines.append(f"{4 * r['numel'] / 1e6:7.3g}M {r['path']:<13} {r['codec']:<6} {r['time_s'] * 1e3:9.1f} "
                     f"{r['cross_node_bytes'] / 1e6:12.2f} {f(r, 'time_vs_torch', 8)} {f(r, 'bytes_vs_torch', 8)} "
                     f"{f(r, 'time_vs_flat', 7)} {f(r, 'bytes_vs_flat', 7)}")
    lines.append("size = fp32 input in MB; time = median of the slowest rank; MB left node = bytes the busiest "
                 "node sent per all-reduce, from its link interface's kernel counters (headers included), median; "
                 "lossy codecs with error feedback.")
    return "\n".join(lines)


def bench_collectives(a: argparse.Namespace, meta: dict) -> List[dict]:
    from flatcomm.ops.codecs import CODECS

    if a.nodes:
        return bench_nodes(a, meta)
    bc = importlib.import_module(".collectives", __name__)
    if a.quick:
        sizes, codecs, reps, exact, chunk = [1 << 18], ["fp32", "int8", "int4", "sign", "auto"], 3, False, []
    else:
        sizes = [1 << 20, 4 << 20] if a.link else [1 << 20, 25 << 20]
        codecs, reps, exact, chunk = list(CODECS) + ["auto"], a.reps, True, ["fp32", "int8"]
    sizes, codecs = a.sizes or sizes, a.codecs or codecs
    if a.no_exact:
        exact = False
    cfg = dict(sizes=sizes, codecs=codecs, exact=exact, reps=reps, warmup=1, chunk_codecs=chunk,
               chunk_compare=bool(chunk))
    meta["config"] = cfg
    _say(f"collectives: {a.ranks} ranks, sizes {', '.join(map(format_size, sizes))}, codecs {', '.join(codecs)}, "
         f"{reps} reps")
    rows = _run_ranks(a, meta, bc._rank_main, cfg, timeout_s=a.timeout)[0]
    base = {(r["collective"], r["numel"]): r["time_ms"] for r in rows if r["impl"] == "gloo"}
    out = []
    for r in rows:
        if r["impl"] == "gloo":
            name = "torch-allreduce" if r["collective"] == "all_reduce" else "torch-reduce-scatter"
        else:
            name = r["codec"] + ("-exact" if r["mode"] == "exact" else "")
            if r["chunks"] == 1:
                name += "-chunks1"
        out.append({"name": name, "collective": r["collective"], "numel": r["numel"], "world": r["world"],
                    "chunks": r["chunks"], "step_s": r["time_ms"] / 1e3, "comm_s": r["time_ms"] / 1e3,
                    "wire_bytes": int(round(r["wire_MB"] * 1e6)), "wire_estimated": r["impl"] == "gloo",
                    "busbw_GBps": r["busbw_GBps"], "algbw_GBps": r["algbw_GBps"],
                    "ratio_vs_torch": r["time_ms"] / base[(r["collective"], r["numel"])]})
        if "chosen" in r:
            out[-1].update(chosen=r["chosen"], reason=r["reason"])
    return out


def table_collectives(results: List[dict]) -> str:
    hdr = (f"{'collective':<14} {'numel':>8} {'name':<22} {'chunks':>6} {'time ms':>9} {'busbw GB/s':>10} "
           f"{'wire MB':>8} {'vs torch':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        wire = ("~" if r["wire_estimated"] else "") + f"{r['wire_bytes'] / 1e6:.2f}"
        chose = f"  chose {r['chosen']}" if r.get("chosen") else ""
        lines.append(f"{r['collective']:<14} {format_size(r['numel']):>8} {r['name']:<22} {str(r['chunks']):>6} "
                     f"{r['step_s'] * 1e3:9.2f} {r['busbw_GBps']:10.3f} {wire:>8} {r['ratio_vs_torch']:7.2f}x{chose}")
    lines.append("numel = fp32 input values; time = median of the slowest rank; busbw per nccl-tests; wire = bytes "
                 "one rank sends (~ = gloo's nominal ring volume); vs torch = time / gloo's fp32 collective of the "
                 "same kind; chunks aN = automatic.")
    return "\n".join(lines)


# ---- scale: the alpha-beta model, validated on the harness and projected -------------------------------

# Stated projection parameters (override on the command line): 8 x 400 Gbit/s NICs per node, NVLink
# 900 GB/s per GPU, and a GPU pipeline throughput assumed until benchmarks/gpu_check.sh measures one.
PROJECT_INTER_GBPS = 8 * 400 / 8
PROJECT_INTRA_GBPS = 900.0
PROJECT_INTER_LATENCY_US = 10.0
PROJECT_INTRA_LATENCY_US = 3.0
PROJECT_GPU_GBPS = 1000.0  # fp32 input bytes/s of one GPU's whole flat pipeline per codec (assumed)
PROJECT_GPU_REDUCE_GBPS = 3000.0  # fp32 adds (HBM bound, assumed)
# TCP payload per byte tc's shaper counts: 1448 of a 1514-byte Ethernet frame (MTU 1500, timestamps).
TCP_PAYLOAD_SHARE = 1448 / 1514


def _probe_cluster(spec: str, nodes: int, g: int, kern: dict, timeout: float):
    """(:class:`flatcomm.autotune.costmodel.Cluster`, probed inter-node bytes/s) for ``nodes`` x ``g`` ranks
    on a ``spec`` link of this machine. The inter tier's rate is the shaped rate (tc's, in payload
    bytes: TCP_PAYLOAD_SHARE), its latency probed (a small all-to-all): on a shared box a probed rate moves by 2x and
    more from run to run with the other processes' load (the kernel's TCP work competes for the
    cores), which measures the box, not the link. The intra tier and the
    compute are probed on the harness (the kernels timed on every rank at once, so the cores'
    share is measured: ``compute_share`` 1; the node tier's loopback transfers use the same cores:
    ``shared_cores``), ``kern``'s codecs and size."""
    from flatcomm.autotune import costmodel as M
    from flatcomm.tools.netlink import Link, parse_link

    bn = importlib.import_module(".nodes", __name__)
    cfg = {"codecs": list(kern["codec_s"]), "kernel_numel": kern["numel"]}
    with Link(nodes, spec, ranks_per_node=g) as link:
        _say(f"probe: {link.describe()}")
        tiers = link.run(link.world, bn.probe_rank, cfg, timeout_s=timeout, echo=False)[0]
    _, probed_Bps, small_sent, small_s = tiers["inter"]
    rate = parse_link(spec)[0] / 8 * TCP_PAYLOAD_SHARE
    inter = M.Tier(max(0.0, small_s - small_sent / rate), rate)
    intra = M.Tier(*tiers["intra"][:2]) if "intra" in tiers else M.Tier(0.0, float("inf"))
    k = tiers["kernels"]
    return M.Cluster(nodes, g, inter, intra, k["codec_s"], k["reduce_s"], 1.0, shared_cores=True), probed_Bps


def bench_scale(a: argparse.Namespace, meta: dict) -> List[dict]:
    from flatcomm.autotune import costmodel as M

    codecs = a.codecs or ["fp32", "int8", "int4", "sign"]
    out: List[dict] = []
    if a.measured:
        # the model's compute is timed by the probe, on the harness ranks (see _probe_cluster)
        clusters = {}
        for path in a.measured:
            with open(path) as fh:
                doc = json.load(fh)
            L = doc.get("link") or {}
            nodes, g = L.get("nodes"), L.get("ranks_per_node")
            if not nodes or not g:
                raise SystemExit(f"flatcomm.bench scale: {path} is not a `collectives --nodes` result")
            # The kernels at the measured size by default: a smaller probe partly fits in the
            # last-level cache and times the codecs faster than the collectives run them.
            numel = parse_size(a.kernel_numel) if a.kernel_numel else max(r["numel"] for r in doc["results"])
            kern = {"codec_s": dict.fromkeys(codecs), "numel": numel}
            key = (L["spec"], nodes, g, numel)
            if key not in clusters:
                clusters[key], probed = _probe_cluster(L["spec"], nodes, g, kern, a.timeout)
                meta.setdefault("probes", []).append(dict(clusters[key].describe(), link=L["spec"],
                                                          inter_GBps_probed=probed / 1e9))
            cl = clusters[key]
            for r in doc["results"]:
                if r["codec"] not in cl.codec_s:
                    continue
                model = M.predict(cl, r["path"], r["numel"], r["codec"])
                out.append({"kind": "validation", "source": path, "nodes": nodes, "ranks_per_node": g,
                            "path": r["path"], "codec": r["codec"], "numel": r["numel"],
                            "measured_s": r["time_s"], "model_s": model, "ratio": r["time_s"] / model,
                            "within_25pct": abs(r["time_s"] / model - 1) <= 0.25})
    g = a.project_gpus
    gpu = {c: 4.0 / (a.gpu_gbps * 1e9) for c in codecs}
    meta["projection"] = {"ranks_per_node": g, "inter_GBps_per_node": a.inter_gbps, "intra_GBps": a.intra_gbps,
                          "inter_latency_us": a.inter_latency_us, "intra_latency_us": a.intra_latency_us,
                          "gpu_pipeline_GBps": a.gpu_gbps, "gpu_reduce_GBps": a.gpu_reduce_gbps,
                          "gpu_figures": "assumed (not yet measured by benchmarks/gpu_check.sh)"}
    n = 1
    while n <= a.project_nodes:
        cl = M.Cluster(n, g, M.Tier(a.inter_latency_us * 1e-6, a.inter_gbps * 1e9),
                       M.Tier(a.intra_latency_us * 1e-6, a.intra_gbps * 1e9), gpu, 4.0 / (a.gpu_reduce_gbps * 1e9))
        for numel in a.project_sizes:
            out.append({"kind": "projection", "nodes": n, "ranks_per_node": g, "path": "torch", "codec": "fp32",
                        "numel": numel, "model_s": M.ring(cl, numel)})
            for path in ("flat", "hierarchical"):
                for c in codecs:
                    # hierarchical: the segment count codec="auto" picks (flatcomm.autotune.tiers)
                    k = M.best_segments(cl, numel, c) if path == "hierarchical" else None
                    out.append({"kind": "projection", "nodes": n, "ranks_per_node": g, "path": path, "codec": c,
                                "numel": numel, "model_s": M.predict(cl, path, numel, c, segments=k),
                                "segments": k})
        n *= 2
    for r in out:  # the generic fields the JSON and plots of the other commands have
        r.update(name=f"{r['path']}-{r['codec']}", step_s=r.get("measured_s", r["model_s"]),
                 comm_s=r.get("measured_s", r["model_s"]), wire_bytes=None)
    return out


def table_scale(results: List[dict]) -> str:
    lines = []
    val = [r for r in results if r["kind"] == "validation"]
    if val:
        hdr = f"{'N x G':>6} {'size':>8} {'path':<13} {'codec':<6} {'measured ms':>11} {'model ms':>9} {'meas/model':>10}"
        lines += ["validation (harness vs model)", hdr, "-" * len(hdr)]
        for r in val:
            lines.append(f"{r['nodes']}x{r['ranks_per_node']:<4} {4 * r['numel'] / 1e6:7.3g}M {r['path']:<13} "
                         f"{r['codec']:<6} {r['measured_s'] * 1e3:11.1f} {r['model_s'] * 1e3:9.1f} {r['ratio']:10.2f}"
                         + ("" if r["within_25pct"] else "  (outside +-25%)"))
        lines.append("")
    proj = [r for r in results if r["kind"] == "projection"]
    for numel in sorted({r["numel"] for r in proj}):
        rows = [r for r in proj if r["numel"] == numel]
        cols = []
        for r in rows:
            if (r["path"], r["codec"]) not in cols:
                cols.append((r["path"], r["codec"]))
        names = ["torch" if p == "torch" else f"{p[:4]} {c}" for p, c in cols]
        hdr = f"{'nodes':>5} " + " ".join(f"{nm:>10}" for nm in names)
        lines += [f"projection: all-reduce of {4 * numel / 1e6:.4g} MB fp32, ms, G = {rows[0]['ranks_per_node']}",
                  hdr, "-" * len(hdr)]
        for n in sorted({r["nodes"] for r in rows}):
            by = {(r["path"], r["codec"]): r["model_s"] for r in rows if r["nodes"] == n}
            lines.append(f"{n:>5} " + " ".join(f"{by[k] * 1e3:10.3f}" for k in cols))
    return "\n".join(lines)


def plot_scale(results: List[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"flatcomm.bench: --plot needs matplotlib; no plot written to {path}", file=sys.stderr)
        return False
    proj = [r for r in results if r["kind"] == "projection"]
    numel = max(r["numel"] for r in proj)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in [("torch", "fp32"), ("flat", "int8"), ("flat", "sign"), ("hierarchical", "fp32"),
                ("hierarchical", "int8"), ("hierarchical", "int4"), ("hierarchical", "sign")]:
        pts = sorted((r["nodes"], r["model_s"] * 1e3) for r in proj
                     if (r["path"], r["codec"]) == key and r["numel"] == numel)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label="torch ring fp32" if key[0] == "torch" else f"{key[0]} {key[1]}",
                    ls="--" if key[0] == "flat" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes (x {proj[0]['ranks_per_node']} GPUs)")
    ax.set_ylabel(f"all-reduce of {4 * numel / 1e6:.4g} MB, ms (model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


# ---- DDP ------------------------------------------------------------------------------------------------

_DDP_NAMES = {"noop": "noop", "torch allreduce": "torch-allreduce", "torch quant_perchannel": "torch-quant-perchannel",
              "torch powerSGD r1": "torch-powersgd-r1", "torch powerSGD r4": "torch-powersgd-r4"}


def _ddp_name(hook: str) -> str:
    return _DDP_NAMES.get(hook, hook.split()[-1])


def bench_ddp(a: argparse.Namespace, meta: dict) -> List[dict]:
    bd = importlib.import_module(".ddp", __name__)
    if a.nodes and not a.link:
        raise SystemExit("flatcomm.bench: --nodes needs --link (the nodes are joined by a shaped link)")
    back = {_ddp_name(h): h for h in bd.HOOKS}
    hooks = [back[n] for n in a.hooks] if a.hooks else list(bd.HOOKS)
    for must in ("torch allreduce", "noop"):  # the baselines every ratio needs
        if must not in hooks:
            hooks.insert(0, must)
    wargs = SimpleNamespace(auto_budget=a.auto_budget, params=a.params, batch=a.batch, steps=a.steps if a.steps else (4 if not a.quick else 2),
                            warmup=a.warmup, rounds=a.rounds if a.rounds else (2 if a.link else 3), skip=set())
    if a.quick:
        wargs.rounds = 1
    meta["config"] = dict(vars(wargs), skip=None, hooks=[_ddp_name(h) for h in hooks])
    _say(f"ddp: {a.ranks} ranks, MLP ~{a.params / 1e6:.0f}M params in one bucket, {wargs.warmup} warm-up + "
         f"{wargs.steps} timed steps per hook, best of {wargs.rounds} round(s)")
    rows = _run_ranks(a, meta, bd._worker, wargs, hooks, timeout_s=a.timeout)[0]
    by = {r["name"]: r for r in rows}
    noop, base = by["noop"], by["torch allreduce"]
    if "failed" in noop or "failed" in base:
        raise SystemExit(f"flatcomm.bench: baseline failed: noop: {noop.get('failed')}, "
                         f"torch allreduce: {base.get('failed')}")
    w = a.ranks
    params = base["params"]
    ring = 2 * (w - 1) * 4 * params / w
    base_comm = max(0.0, base["step_s"] - noop["step_s"])
    out, failed = [], []
    for r in rows:
        name = _ddp_name(r["name"])
        if "failed" in r:
            failed.append({"name": name, "reason": r["failed"]})
            continue
        comm = max(0.0, r["step_s"] - noop["step_s"])  # below the step's noise: 0, as the table says
        wire, est = r.get("wire_bytes"), False
        if wire is None:
            wire, est = (ring if name == "torch-allreduce" else r.get("wire_bytes_estimate")), True
        rec = {"name": name, "step_s": r["step_s"], "comm_s": comm, "wire_bytes": wire, "wire_estimated": est,
               "comm_ratio": comm / base_comm if base_comm > 0 else None,
               "step_ratio": r["step_s"] / base["step_s"], "wire_ratio": (wire / ring) if wire is not None else None,
               "hook_s": r.get("hook_s"), "final_loss": r.get("final_loss"), "params": r.get("params"),
               "grads_finite": r.get("grads_finite"), "buckets_per_step": r.get("buckets_per_step")}
        for k in ("encode_s", "exchange_s", "decode_s"):
            if k in r:
                rec[k] = r[k]
        for k in ("decisions", "hook_codecs"):
            if k in r:
                rec[k] = r[k]
        out.append(rec)
    _mark_auto(out)
    meta["failed"] = failed
    return out


def _mark_auto(out: List[dict]) -> None:
    """auto's comm time relative to the best fixed flatcomm codec of the same run."""
    auto = next((r for r in out if r["name"] == "auto"), None)
    fixed = [r for r in out if r["name"] in FIXED]
    if auto is None or not fixed:
        return
    best = min(fixed, key=lambda r: r["comm_s"])
    auto["best_fixed"] = best["name"]
    auto["auto_vs_best"] = auto["comm_s"] / best["comm_s"] if best["comm_s"] > 0 else None


def table_ddp(results: List[dict], meta: dict) -> str:
    hdr = (f"{'name':<24} {'step ms':>8} {'comm ms':>8} {'comm/torch':>10} {'wire MB':>8} "
           f"{'wire/torch':>10} {'loss':>10}  notes")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        label = r["name"] + ("+EF" if r["name"] in ("int8", "int4", "sign") else "")
        ratio = f"{r['comm_ratio']:10.3f}" if r["comm_ratio"] is not None else f"{'-':>10}"
        wire = "?" if r["wire_bytes"] is None else ("~" if r["wire_estimated"] else "") + f"{r['wire_bytes'] / 1e6:.1f}"
        wr = f"{r['wire_ratio']:10.3f}" if r["wire_ratio"] is not None else f"{'?':>10}"
        notes = []
        if "encode_s" in r:
            notes.append(f"enc {r['encode_s'] * 1e3:.0f}/xchg {r['exchange_s'] * 1e3:.0f}/dec {r['decode_s'] * 1e3:.0f} ms")
        if r.get("buckets_per_step") not in (None, 1, 1.0):
            notes.append(f"{r['buckets_per_step']:.2f} hook calls/step")
        if r.get("grads_finite") is False:
            notes.append("NON-FINITE GRADS")
        loss = f"{r['final_loss']:10.5f}" if r.get("final_loss") is not None else f"{'-':>10}"
        if r.get("decisions"):
            vs = f"{r['auto_vs_best']:.2f}x the comm of " if r.get("auto_vs_best") is not None else ""
            best = f" ({vs}the best fixed codec, {r['best_fixed']})" if r.get("best_fixed") else ""
            notes.append("chose " + ",".join(d["codec"] for d in r["decisions"]) + best)
        lines.append(f"{label:<24} {r['step_s'] * 1e3:8.1f} {r['comm_s'] * 1e3:8.1f} {ratio} {wire:>8} "
                     f"{wr} {loss}  {'; '.join(notes)}")
    for f in meta.get("failed", []):
        lines.append(f"{f['name']:<24} failed: {f['reason']}")
    lines.append("step = median fwd+bwd+SGD (best round); comm = step - noop-hook step; comm/torch = comm / torch "
                 "fp32 all-reduce hook's comm; wire = bytes one rank sends per step (~ = nominal: ring volume or "
                 "PowerSGD estimate); loss = final loss of the short run (same init and data for every hook).")
    return "\n".join(lines)


# ---- FSDP ----------------------------------------------------------------------------------------------


def bench_fsdp(a: argparse.Namespace, meta: dict) -> List[dict]:
    steps = importlib.import_module(".fsdp_steps", __name__)
    if steps.wanted(a):  # whole steps, weights and link counters: fsdp_steps.py
        return steps.bench(a, meta, _run_ranks)
    bf = importlib.import_module(".fsdp", __name__)
    codecs = list(a.codecs) if a.codecs else ["default", "fp32", "int8", "int4", "sign", "auto"]
    if "default" not in codecs:
        codecs.insert(0, "default")
    cfg = {"codecs": codecs, "steps": a.steps or (2 if a.quick else 8), "warmup": a.warmup,
           "d_model": 128 if a.quick else 256, "layers": 2 if a.quick else 4, "ff": 512 if a.quick else 1024,
           "vocab": 1024, "seq": 32, "batch": 4}
    meta["config"] = cfg
    _say(f"fsdp: {a.ranks} ranks, codecs {codecs}, {cfg['warmup']} warm-up + {cfg['steps']} steps (round robin)")
    rows = _run_ranks(a, meta, bf._rank_main, cfg, timeout_s=a.timeout)[0]
    base = next(r for r in rows if r["codec"] == "default")
    out = []
    for r in rows:
        name = "torch-reduce-scatter" if r["codec"] == "default" else r["codec"]
        out.append({"name": name, "step_s": r["step_ms"] / 1e3, "comm_s": r["comm_ms"] / 1e3,
                    "wire_bytes": r["wire_bytes_per_step"], "wire_estimated": r["codec"] == "default",
                    "codec_s": None if r["codec_ms"] is None else r["codec_ms"] / 1e3,
                    "step_ratio": r["step_ms"] / base["step_ms"],
                    "comm_ratio": r["comm_ms"] / base["comm_ms"] if base["comm_ms"] > 0 else None,
                    "wire_ratio": r["wire_bytes_per_step"] / base["wire_bytes_per_step"],
                    "final_loss": r["final_loss"], "params": r["params"]})
        if r.get("chosen"):
            out[-1]["chosen"] = r["chosen"]
    return out


def table_fsdp(results: List[dict]) -> str:
    if results and "variant" in results[0]:
        return importlib.import_module(".fsdp_steps", __name__).table(results)
    hdr = (f"{'name':<22} {'step ms':>8} {'comm ms':>8} {'codec ms':>8} {'step/torch':>10} {'comm/torch':>10} "
           f"{'wire KB':>8} {'wire/torch':>10} {'loss':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        cr = f"{r['comm_ratio']:10.3f}" if r["comm_ratio"] is not None else f"{'-':>10}"
        kd = f"{r['codec_s'] * 1e3:8.1f}" if r["codec_s"] is not None else f"{'-':>8}"
        wire = ("~" if r["wire_estimated"] else "") + f"{r['wire_bytes'] / 1024:.1f}"
        chose = f"  chose {','.join(r['chosen'])}" if r.get("chosen") else ""
        lines.append(f"{r['name']:<22} {r['step_s'] * 1e3:8.1f} {r['comm_s'] * 1e3:8.1f} {kd} {r['step_ratio']:10.3f} "
                     f"{cr} {wire:>8} {r['wire_ratio']:10.3f} {r['final_loss']:8.4f}{chose}")
    lines.append("step = median of the slowest rank (fwd+bwd+Adam); comm = time per step inside the reduce-scatter "
                 "calls (rank 0); codec = flatcomm's encode+exchange+decode; wire = bytes one rank sends per step "
                 "(~ = nominal (n-1)/n of the fp32 input).")
    return "\n".join(lines)


# ---- output ----------------------------------------------------------------------------------------------


def plot_labels(results: List[dict], command: str) -> List[str]:
    """One label per bar, each word once (``copy_ 64K``, not ``copy_ copy_ 0.0655M``)."""
    def words(r):
        if command == "kernels" and "block_size" in r:
            return r["op"], r["name"], f"block {r['block_size']}"
        if command == "kernels":
            return r["op"], r["name"], format_size(r["numel"])
        if command == "collectives":
            return r["name"], r["collective"], format_size(r["numel"])
        return (r["name"],)

    return [" ".join(dict.fromkeys(words(r))) for r in results]


def _save(plt, fig, path: str) -> bool:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(results: List[dict], command: str, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"flatcomm.bench: --plot needs matplotlib (pip install matplotlib); no plot written to {path}",
              file=sys.stderr)
        return False
    labels = plot_labels(results, command)
    if command == "kernels" and "block_size" in results[0]:
        values, xlabel = [r["step_s"] * 1e3 for r in results], "ms per call (median)"
        second, xlabel2 = None, None
    elif command == "kernels":
        values, xlabel = [r["gbps"] for r in results], "GB/s (bytes read + written / fastest time)"
        second, xlabel2 = None, None
    else:
        values, xlabel = [r["comm_s"] * 1e3 for r in results], "communication ms per step"
        second = [(r["wire_bytes"] or 0) / 1e6 for r in results]
        xlabel2 = "MB one rank sends per step"
    h = max(3.0, 0.28 * len(labels) + 1.2)
    ncols = 1 if second is None else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, h), squeeze=False)
    ys = list(range(len(labels)))
    axes[0][0].barh(ys, values, color="tab:blue")
    axes[0][0].set_yticks(ys, labels, fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][0].set_xlabel(xlabel)
    if second is not None:
        axes[0][1].barh(ys, second, color="tab:orange")
        axes[0][1].set_yticks(ys, [""] * len(ys))
        axes[0][1].invert_yaxis()
        axes[0][1].set_xlabel(xlabel2)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def _hook_names() -> List[str]:
    return [_ddp_name(h) for h in importlib.import_module(".ddp", __name__).HOOKS]


def build_parser() -> argparse.ArgumentParser:
    from flatcomm.tools.netlink import link_arg

    ap = argparse.ArgumentParser(prog="python -m flatcomm.bench", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n")[1])
    add_version(ap)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the results as JSON")
    common.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    common.add_argument("--quick", action="store_true", help="a small configuration (seconds)")
    common.add_argument("--timeout", type=positive(float), default=600, help="bound on the whole run, s (default 600)")
    dist_opts = argparse.ArgumentParser(add_help=False)
    dist_opts.add_argument("--ranks", type=positive(int), default=2, help="gloo ranks (default 2)")
    dist_opts.add_argument("--link", metavar="RATE[,DELAY]", type=link_arg,
                           help="run every rank in its own network namespace behind a shaped link, e.g. 1gbit "
                                "or 10gbit,0.2ms (needs root; delay needs netem)")
    dist_opts.add_argument("--allow-no-delay", action="store_true",
                           help="with a delay on a kernel without netem: go on without the delay")
    dist_opts.add_argument("--threads", type=positive(int), default=1, help="torch threads per rank (default 1)")
    codec_list = names(codecs, "codec")
    count = positive(int)

    k = sub.add_parser("kernels", parents=[common], help="kernel throughput vs copy_ and pure torch")
    k.add_argument("--sizes", type=sizes, help="element counts, comma separated (K/M/G suffixes: 64K,1M,25M)")
    k.add_argument("--codecs", type=codec_list, help="comma separated (default: all; --quick int8,int4,sign,bf16)")
    k.add_argument("--reps", type=count, default=7, help="timing samples per op at least (default 7)")
    k.add_argument("--no-ref", action="store_true", help="skip the pure-torch reference timings")
    k.add_argument("--block-sizes", action="store_true",
                   help="int8 encode+EF time and error by block size instead (at the first --sizes, default 25M)")

    c = sub.add_parser("collectives", parents=[common, dist_opts], help="flatcomm vs gloo collectives")
    c.add_argument("--sizes", type=sizes, help="fp32 element counts, comma separated (default 1M,25M; with --link 1M,4M)")
    c.add_argument("--codecs", type=names(lambda: (*codecs(), "auto"), "codec"), help="comma separated (default: all)")
    c.add_argument("--reps", type=count, default=5, help="timed reps per collective (default 5; --quick 3)")
    c.add_argument("--no-exact", action="store_true", help="skip mode='exact'")
    c.add_argument("--nodes", type=positive(int), help="N namespaces ('nodes') of --ranks-per-node ranks each (needs --link)")
    c.add_argument("--ranks-per-node", type=positive(int), default=1, help="ranks per node with --nodes (default 1)")
    c.add_argument("--paths", type=names(lambda: ("torch", "flat", "hierarchical"), "path"),
                   default=["torch", "flat", "hierarchical"], help="with --nodes: torch,flat,hierarchical")

    d = sub.add_parser("ddp", parents=[common, dist_opts], help="DDP comm hooks: comm time per step")
    d.add_argument("--nodes", type=positive(int), help="N namespaces of --ranks-per-node ranks (needs --link); "
                                                       "flatcomm hooks go two-level (topology from LOCAL_WORLD_SIZE)")
    d.add_argument("--ranks-per-node", type=positive(int), default=1, help="ranks per node with --nodes (default 1)")
    d.add_argument("--auto-budget", choices=CODECS,
                   help="the auto hook's error budget (default sign; int8 = Tuner's default)")
    d.add_argument("--params", type=positive(float), default=25e6, help="MLP parameters (default 25e6)")
    d.add_argument("--batch", type=count, default=32, help="samples per rank per step (default 32)")
    d.add_argument("--steps", type=count, help="timed steps per hook (default 4; --quick 2)")
    d.add_argument("--warmup", type=count, default=2, help="untimed steps per hook first (default 2)")
    d.add_argument("--rounds", type=count, help="repeat the hook list, keep the best (default 3; 2 with --link)")
    d.add_argument("--hooks", type=names(_hook_names, "hook"),
                   help="comma separated: noop, torch-allreduce, torch-quant-perchannel, torch-powersgd-r1, "
                        "torch-powersgd-r4, fp32, bf16, int8, int4, sign, auto (default all; auto's error budget "
                        "is sign)")

    sc = sub.add_parser("scale", parents=[common], help="alpha-beta model: validate on the harness, project")
    sc.add_argument("--measured", type=lambda t: [x for x in t.split(",") if x], help="JSON files of `collectives --nodes` runs to validate against (comma separated)")
    sc.add_argument("--codecs", type=codec_list, help="comma separated (default fp32,int8,int4,sign)")
    sc.add_argument("--kernel-numel", default=None,
                    help="values for the kernel probe (default: the measured file's largest size)")
    sc.add_argument("--project-nodes", type=int, default=128, help="largest node count in the projection "
                                                                   "(1, 2, 4, ... up to it; default 128)")
    sc.add_argument("--project-gpus", type=int, default=8, help="GPUs per node in the projection")
    sc.add_argument("--project-sizes", type=sizes, default=[25 << 20], help="fp32 values per all-reduce (default 25M)")
    sc.add_argument("--inter-gbps", type=float, default=PROJECT_INTER_GBPS, help="GB/s a node sends (default 8 x 400 Gbit/s)")
    sc.add_argument("--intra-gbps", type=float, default=PROJECT_INTRA_GBPS, help="GB/s per GPU inside a node (NVLink)")
    sc.add_argument("--inter-latency-us", type=float, default=PROJECT_INTER_LATENCY_US,
                    help=f"latency between nodes, us (default {PROJECT_INTER_LATENCY_US:g})")
    sc.add_argument("--intra-latency-us", type=float, default=PROJECT_INTRA_LATENCY_US,
                    help=f"latency inside a node, us (default {PROJECT_INTRA_LATENCY_US:g})")
    sc.add_argument("--gpu-gbps", type=float, default=PROJECT_GPU_GBPS,
                    help="fp32 input GB/s of one GPU's flat pipeline per codec (assumed until measured)")
    sc.add_argument("--gpu-reduce-gbps", type=float, default=PROJECT_GPU_REDUCE_GBPS,
                    help="fp32 input GB/s of one GPU's sum of received values (assumed; default "
                         f"{PROJECT_GPU_REDUCE_GBPS:g})")

    f = sub.add_parser("fsdp", parents=[common, dist_opts], help="FSDP2 reduce-scatter: default vs codecs")
    f.add_argument("--codecs", type=names(lambda: ("default", *codecs(), "auto"), "codec"),
                   help="comma separated, 'default' = FSDP's own (default: default,fp32,int8,int4,sign,auto)")
    f.add_argument("--steps", type=count, help="timed steps (default 8; --quick 2)")
    f.add_argument("--warmup", type=count, default=2, help="untimed steps first (default 2)")
    importlib.import_module(".fsdp_steps", __name__).add_arguments(f)
    for name, what in OWN_CLI.items():  # parsed by their own main (see main()); listed here for --help
        own = sub.add_parser(name, help=what, description=what)
        importlib.import_module(f".{name}", __name__).add_arguments(own)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # convergence: training runs, not timings; backend: one spawn on init_process_group("flatcomm");
    # diloco: runs on links of its own. Each has its own CLI (also under --help via build_parser).
    if args[:1] and args[0] in OWN_CLI:
        return importlib.import_module(f".{args[0]}", __name__).main(args[1:])
    a = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    import torch

    import flatcomm

    meta: Dict[str, Any] = {"command": a.command, "argv": list(sys.argv[1:] if argv is None else argv),
                            "torch": torch.__version__, "build": flatcomm.build_info()}
    if a.command not in ("kernels", "scale"):
        if a.link and a.ranks < 2:
            raise SystemExit("flatcomm.bench: --link needs --ranks >= 2")
        meta["world"] = a.ranks
        if getattr(a, "nodes", None) is not None:
            if a.nodes < 2 or a.ranks_per_node < 1:
                raise SystemExit("flatcomm.bench: --nodes needs at least 2 nodes and --ranks-per-node >= 1")
            a.ranks = meta["world"] = a.nodes * a.ranks_per_node
    # Backstop bound on the whole command (rank runs have their own, tighter timeouts).
    def _alarm(signum, frame):
        raise TimeoutError(f"flatcomm.bench: gave up after --timeout {a.timeout:g} s (+60 s)")

    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(a.timeout) + 60)
    try:
        return _main(a, meta, t0)
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)


def _main(a: argparse.Namespace, meta: Dict[str, Any], t0: float) -> int:
    runner = {"kernels": bench_kernels, "collectives": bench_collectives, "ddp": bench_ddp, "fsdp": bench_fsdp,
              "scale": bench_scale}
    results = runner[a.command](a, meta)
    where = ""
    if meta.get("link"):
        L = meta["link"]
        delay = ""
        if L["delay_s"]:
            delay = f", delay {L['delay_s'] * 1e3:g} ms" + ("" if L["delay_applied"] else " NOT applied (no netem)")
        where = f" on a {L['rate']} link ({L['topology']}{delay})"
    elif a.command not in ("kernels", "scale"):
        where = " over loopback"
    who = f"{a.ranks} ranks" if a.command not in ("kernels", "scale") else "1 process"
    if a.command == "scale":
        who = "alpha-beta model"
    if getattr(a, "nodes", None):
        who = f"{a.nodes} nodes x {a.ranks_per_node} ranks"
    title = f"flatcomm.bench {a.command}: {who}{where}"
    if a.command == "kernels":
        table = table_kernels(results)
    elif a.command == "collectives":
        table = table_nodes(results) if getattr(a, "nodes", None) else table_collectives(results)
    elif a.command == "ddp":
        table = table_ddp(results, meta)
    elif a.command == "scale":
        table = table_scale(results)
    else:
        table = table_fsdp(results)
    print(title)
    print(table, flush=True)
    for w in meta.get("warnings", []):
        print(f"flatcomm.bench: warning: {w}", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    _say(f"{elapsed:.0f} s")
    if a.json:
        doc = dict(meta, results=results, failed=meta.get("failed", []), elapsed_s=elapsed)
        doc.setdefault("world", 1)
        doc.setdefault("link", None)
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        _say(f"wrote {a.json}")
    if a.plot and a.command == "scale":
        if plot_scale(results, a.plot, title):
            _say(f"wrote {a.plot}")
    elif a.plot and results and "variant" in results[0]:
        if importlib.import_module(".fsdp_steps", __name__).plot(results, a.plot, title):
            _say(f"wrote {a.plot}")
    elif a.plot and plot(results, a.command, a.plot, title):
        _say(f"wrote {a.plot}")
    return 0
