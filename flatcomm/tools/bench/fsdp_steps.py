"""FSDP2 whole training steps on N "nodes" x G ranks: the step time and the bytes that left a node
per parameter and step, read from the kernel's counters of the node's link interface (not
self-reported), split by collective kind. Run it through the bench CLI::

    python -m flatcomm.bench fsdp --nodes 2 --ranks-per-node 1 --link 1gbit --weights int8,int4 \\
        --param-dtype bf16 --params 25e6 --json docs/bench/fsdp_2x1_1gbit.json --plot fsdp_2x1.png

**Variants** (``GRADS[/WEIGHTS][:hpz]``), all in one run on the same init and batches, taking
turns step by step so that a slow phase of a shared machine hits them alike:

* ``plain``: FSDP2's own all-gathers and reduce-scatters (on gloo a reduce-scatter is an
  all-reduce: twice the bytes NCCL's would send);
* ``int8``: :func:`flatcomm.fsdp.apply` with that gradient codec (error feedback), FSDP's weights;
* ``int8/int8``: also ``weights="int8"`` (quantized weight all-gathers, no error feedback);
* ``...:hpz``: every block ``fully_shard(reshard_after_forward=G)``: the backward all-gather stays
  in the node (FSDP's own for ``plain``, flatcomm's kept rows with quantized weights).

The default list is ``plain``, the gradient codec alone, with the first ``--weights`` codec, the
same three with ``:hpz`` when G > 1, and one row per further ``--weights`` codec (``:hpz`` when G > 1).

**Time**: per step, the slowest rank's forward + backward + AdamW step (a MAX all-reduce after it);
the median over the timed steps, with the minimum and maximum. ``comm`` is the time rank 0 spent
inside the collectives (FSDP's calls of its all-gather and reduce-scatter), per step.

**Bytes** (with ``--link``): per timed step, the first rank of every node reads its ``fc0`` tx
counter after a barrier and again after the step's MAX all-reduce; minus what that bracket costs
around an empty step (nodes.py's method), it is what the node sent, headers and TCP ACKs included.
The split by kind comes from ``--count-steps`` more steps in which every collective call is
bracketed on its own (barrier, read, call, barrier, read, minus an empty bracket): weight
all-gathers in forward, in backward, and the gradient reduce-scatters. Both are reported for the
busiest node, per parameter (the model's unsharded count). ``self`` is flatcomm's own
``rs.stats.bytes_by_kind`` summed over the node's ranks: the bytes they sent to every peer, in
the node or not (without a link it is the only byte count).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .fsdp import Transformer

KINDS = ("weights_forward", "weights_backward", "gradients")
SHORT = {"weights_forward": "fwd gather", "weights_backward": "bwd gather", "gradients": "grads"}


# ---- variants ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    grads: str  # "plain" (FSDP's own) or a flatcomm codec
    weights: Optional[str]  # a flatcomm weight codec, None: FSDP's own gather
    hpz: bool

    @property
    def name(self) -> str:
        return self.grads + (f"/{self.weights}" if self.weights else "") + (":hpz" if self.hpz else "")


def parse_variant(text: str) -> Variant:
    """``"plain"``, ``"int8"``, ``"int8/int4:hpz"`` -> :class:`Variant` (ValueError naming the problem)."""
    from flatcomm.fsdp.weights import WEIGHT_CODECS
    from flatcomm.ops.codecs import CODECS

    body, colon, flag = text.strip().partition(":")
    if colon and flag != "hpz":
        raise ValueError(f"variant {text!r}: the only flag is ':hpz'")
    grads, slash, weights = body.partition("/")
    if grads != "plain" and grads not in CODECS:
        raise ValueError(f"variant {text!r}: gradients {grads!r} are 'plain' or one of {', '.join(CODECS)}")
    if slash and grads == "plain":
        raise ValueError(f"variant {text!r}: quantized weights come with flatcomm's gradients (e.g. int8/{weights})")
    if slash and weights not in WEIGHT_CODECS:
        raise ValueError(f"variant {text!r}: weights {weights!r} are one of {', '.join(WEIGHT_CODECS)}")
    return Variant(grads, weights or None, bool(colon))


def default_variants(grads: str, weights: List[str], ranks_per_node: int) -> List[str]:
    node = ranks_per_node > 1
    out = ["plain", grads, f"{grads}/{weights[0]}"]
    if node:
        out += [f"{v}:hpz" for v in out]
    out += [f"{grads}/{w}" + (":hpz" if node else "") for w in weights[1:]]
    return out


def model_dims(params: float, layers: int, vocab: int) -> Dict[str, int]:
    """The smallest width (a multiple of 64: one attention head per 64, feed-forward 4x) whose
    transformer of ``layers`` blocks has at least ``params`` parameters."""
    d = 64
    while transformer_params(d, layers, vocab) < params and d < 16384:
        d += 64
    return {"d_model": d, "layers": layers, "ff": 4 * d, "vocab": vocab}


def transformer_params(d: int, layers: int, vocab: int) -> int:
    block = 4 * d * d + 4 * d + 2 * d * 4 * d + 4 * d + d + 4 * d  # attention, feed-forward, two norms
    return layers * block + vocab * d + d * vocab + vocab


# ---- counting ----------------------------------------------------------------------------------------


class Meter:
    """This node's link counter around whole steps or single collective calls (read by the node's
    first rank), and the time every rank spends inside the calls."""

    def __init__(self, counters: bool, nodes: int, node: int, local_rank: int):
        self.counters, self.nodes, self.node, self.local_rank = counters, nodes, node, local_rank
        self.per_call = False  # bracket every call (the counting steps)
        self.call_overhead = 0.0
        self.bytes = dict.fromkeys(KINDS, 0.0)  # this node's, per-call brackets
        self.comm_s = 0.0

    def tx(self) -> int:
        if not self.counters or self.local_rank != 0:
            return 0
        from flatcomm.tools.netlink import interface_bytes

        return interface_bytes()[0]

    def node_sum(self, values: List[float]) -> List[List[float]]:
        """[node][i]: every node's ``values`` (those of its first rank), on every rank."""
        t = torch.zeros(self.nodes, len(values), dtype=torch.float64)
        if self.local_rank == 0:
            t[self.node] = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def empty_call_bracket(self) -> float:
        dist.barrier()
        t0 = self.tx()
        dist.barrier()
        return float(self.tx() - t0)

    def call(self, kind: str, fn):
        if not self.per_call:
            t0 = time.perf_counter()
            out = _finish(fn())
            self.comm_s += time.perf_counter() - t0
            return out
        dist.barrier()
        tx0 = self.tx()
        _finish(fn())
        dist.barrier()
        self.bytes[kind] += self.tx() - tx0 - self.call_overhead
        return None


def _finish(work):
    """A collective's Work, waited on (FSDP calls with async_op=False on CPU; a bracket must end
    with the bytes moved)."""
    if work is not None and hasattr(work, "wait"):
        work.wait()
    return None


class Counted:
    """An FSDP2 all-gather or reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
    that runs ``inner`` through a :class:`Meter`."""

    def __init__(self, inner, meter: Meter, gather: bool):
        self.inner, self.meter, self.gather = inner, meter, gather

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, **kwargs):  # FSDP passes keyword arguments
        if self.gather:
            kind = "weights_backward" if torch._C._current_graph_task_id() != -1 else "weights_forward"
        else:
            kind = "gradients"
        return self.meter.call(kind, lambda: self.inner(**kwargs))


# ---- one variant -----------------------------------------------------------------------------------


def _batch(rank: int, step: int, cfg: dict):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return tok, (tok * 7 + 3) % cfg["vocab"]


class _Run:
    def __init__(self, variant: Variant, rank: int, g: int, cfg: dict, meter: Meter):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        import flatcomm.fsdp as F

        self.variant, self.rank, self.cfg, self.meter = variant, rank, cfg, meter
        torch.manual_seed(0)
        self.model = Transformer(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["ff"])
        self.params = sum(p.numel() for p in self.model.parameters())
        kw: Dict[str, Any] = {}
        if cfg["param_dtype"] == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model.layers:
            fully_shard(layer, reshard_after_forward=g if variant.hpz else True, **kw)
        fully_shard(self.model, **kw)
        self.rs = None
        if variant.grads != "plain":
            self.rs = F.apply(self.model, variant.grads, weights=variant.weights)
        comms = self.rs.weights.comms if self.rs is not None and self.rs.weights is not None else {}
        for name, m in self.model.named_modules():
            if isinstance(m, FSDPModule):
                ag = comms.get(name) or DefaultAllGather()
                rsc = self.rs.for_module(m, self.model) if self.rs is not None else DefaultReduceScatter()
                m.set_custom_all_gather(Counted(ag, meter, True))  # type: ignore[arg-type]
                m.set_custom_reduce_scatter(Counted(rsc, meter, False))  # type: ignore[arg-type]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: List[float] = []
        self.sent: List[float] = []  # this node's bytes per timed step (first rank; 0 elsewhere)
        self.kind_bytes = dict.fromkeys(KINDS, 0.0)
        self.comm_s = 0.0
        self.loss = torch.zeros(())

    def _train_step(self, s: int) -> None:
        tok, target = _batch(self.rank, s, self.cfg)
        self.opt.zero_grad()
        out = self.model(tok)
        self.loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
        self.loss.backward()
        self.opt.step()

    def step(self, s: int, phase: str, step_overhead: float) -> None:
        """``phase``: "warmup", "timed" or "count" (every call bracketed)."""
        m = self.meter
        if phase == "count":
            m.per_call, m.bytes = True, dict.fromkeys(KINDS, 0.0)
            self._train_step(s)
            m.per_call = False
            for k in KINDS:
                self.kind_bytes[k] += m.bytes[k]
            return
        m.comm_s = 0.0
        dist.barrier()
        tx0 = m.tx()
        t0 = time.perf_counter()
        self._train_step(s)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        sent = m.tx() - tx0 - step_overhead
        if phase == "timed":
            self.times.append(float(dt))
            self.sent.append(sent)
            self.comm_s += m.comm_s

    def reset_stats(self) -> None:
        if self.rs is not None:
            self.rs.counters = type(self.rs.counters)()

    def record(self, cfg: dict) -> Dict[str, Any]:
        m, steps, counted = self.meter, cfg["steps"], cfg["count_steps"]
        per_step = m.node_sum(self.sent)  # [node][step]
        busiest = [max(per_step[n][i] for n in range(m.nodes)) for i in range(steps)]
        kinds = m.node_sum([self.kind_bytes[k] for k in KINDS])
        kind_node = max(range(m.nodes), key=lambda n: sum(kinds[n]))
        self_kinds = torch.zeros(m.nodes, len(KINDS), dtype=torch.float64)
        if self.rs is not None:
            by = self.rs.stats.bytes_by_kind
            self_kinds[m.node] = torch.tensor([float(by[k]) for k in KINDS], dtype=torch.float64)
        dist.all_reduce(self_kinds)  # every rank adds its own at its node: the node's sum
        final = self.loss.detach().float().reshape(1).clone()
        dist.all_reduce(final)
        n = self.params
        rec: Dict[str, Any] = {
            "variant": self.variant.name, "grads": self.variant.grads, "weights": self.variant.weights,
            "hpz": self.variant.hpz, "params": n, "step_s": statistics.median(self.times),
            "step_s_min": min(self.times), "step_s_max": max(self.times), "step_s_all": self.times,
            "comm_s": self.comm_s / steps, "final_loss": float(final) / dist.get_world_size()}
        if m.counters:
            rec["counters"] = True
            # not clipped at 0: a kind that sends nothing reads as the brackets' noise around 0
            rec["bytes_per_step"] = statistics.median(busiest)
            rec["bytes_per_step_all"] = busiest
            rec["bytes_per_param"] = rec["bytes_per_step"] / n
            rec["kind_bytes_per_param"] = {k: kinds[kind_node][i] / counted / n for i, k in enumerate(KINDS)}
        else:
            rec["counters"] = False
        if self.rs is not None:
            total = steps + counted  # stats reset after the warm-up
            rec["self_bytes_per_param"] = {k: float(max(self_kinds[:, i])) / total / n for i, k in enumerate(KINDS)}
        if self.rs is not None and self.rs.weights is not None:
            gathers = dict.fromkeys(("forward", "backward_node", "backward_full"), 0)
            for c in {id(c): c for c in self.rs.weights.comms.values()}.values():
                for k, v in c.gathers.items():
                    gathers[k] += v
            rec["weight_gathers"] = gathers
        return rec


def _rank_main(rank: int, world: int, cfg: dict) -> Optional[List[Dict[str, Any]]]:
    import warnings

    # FSDP2 warns that the root returns a view (Linear on 3-D input); nothing here writes to it
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    g = cfg["ranks_per_node"]
    if world % g:
        raise ValueError(f"fsdp_steps: world {world} is not a multiple of {g} ranks per node")
    meter = Meter(cfg["counters"], world // g, rank // g, rank % g)
    runs = [_Run(parse_variant(v), rank, g, cfg, meter) for v in cfg["variants"]]
    # What the brackets cost on their own (barriers, the MAX all-reduce, ACKs), in bytes.
    empty_steps, empty_calls = [], []
    for _ in range(5):
        dist.barrier()
        tx0 = meter.tx()
        dist.all_reduce(torch.zeros(1, dtype=torch.float64), op=dist.ReduceOp.MAX)
        empty_steps.append(float(meter.tx() - tx0))
        empty_calls.append(meter.empty_call_bracket())
    step_overhead = statistics.median(empty_steps)
    meter.call_overhead = statistics.median(empty_calls)
    w, steps = cfg["warmup"], cfg["steps"]
    for s in range(w + steps + cfg["count_steps"]):
        phase = "warmup" if s < w else "timed" if s < w + steps else "count"
        for r in runs:
            if s == w:
                r.reset_stats()
            r.step(s, phase, step_overhead)
    rows = [r.record(cfg) for r in runs]
    for r in rows:
        r.update(step_overhead_bytes=step_overhead, call_overhead_bytes=meter.call_overhead)
    return rows if rank == 0 else None


# ---- summary, table, plot ------------------------------------------------------------------------------


def finish(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Add the ratios against ``plain`` (same hpZ setting if present, else plain) and the bench's
    generic fields (``name``, ``step_s``, ``comm_s``, ``wire_bytes``)."""
    base = next((r for r in rows if r["variant"] == "plain"), None)
    for r in rows:
        r["name"] = r["variant"]
        if r["counters"]:
            r["wire_bytes"] = r["bytes_per_step"]
            r["wire_estimated"] = False
        else:
            r["wire_bytes"] = sum(r.get("self_bytes_per_param", {}).values()) * r["params"]
            r["wire_estimated"] = True  # self-reported (flatcomm rows) or unknown (plain: 0)
        if base is not None:
            r["step_ratio"] = r["step_s"] / base["step_s"]
            if r["counters"] and base["bytes_per_step"] > 0:
                r["bytes_ratio"] = r["bytes_per_step"] / base["bytes_per_step"]
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    hdr = (f"{'variant':<18} {'step ms':>8} {'(min-max)':>13} {'/plain':>6} {'comm ms':>8} | "
           f"{'B/param':>7} {'fwd':>5} {'bwd':>5} {'grads':>5} | {'self fwd':>8} {'bwd':>5} {'grads':>5} | {'loss':>7}")
    lines = [hdr, "-" * len(hdr)]

    def f(x, w, p=2):
        return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"

    for r in rows:
        kinds = r.get("kind_bytes_per_param") or {}
        me = r.get("self_bytes_per_param") or {}
        spread = f"({r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f})"
        lines.append(
            f"{r['variant']:<18} {r['step_s'] * 1e3:8.1f} {spread:>13} {f(r.get('step_ratio'), 6)} "
            f"{r['comm_s'] * 1e3:8.1f} | {f(r.get('bytes_per_param'), 7)} {f(kinds.get('weights_forward'), 5)} "
            f"{f(kinds.get('weights_backward'), 5)} {f(kinds.get('gradients'), 5)} | "
            f"{f(me.get('weights_forward'), 8)} {f(me.get('weights_backward'), 5)} {f(me.get('gradients'), 5)} | "
            f"{r['final_loss']:7.4f}")
    p = rows[0]["params"] if rows else 0
    lines.append(f"{p / 1e6:.1f}M parameters. step = median fwd+bwd+AdamW of the slowest rank (min-max over steps); "
                 f"/plain = step / plain FSDP2's; comm = time in the collectives (rank 0). B/param = bytes that left "
                 f"the busiest node per parameter per step (link counters, headers and ACKs included); fwd/bwd/grads "
                 f"= the same split by collective (counting steps, each call bracketed); self = flatcomm's "
                 f"bytes_by_kind summed over the node's ranks (to every peer, in the node or not).")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print(f"flatcomm.bench: --plot needs matplotlib; no plot written to {path}", file=sys.stderr)
        return False
    names = [r["variant"] for r in rows]
    ys = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.45 * len(rows) + 1.5)))
    med = [r["step_s"] * 1e3 for r in rows]
    err = [[m - r["step_s_min"] * 1e3 for m, r in zip(med, rows)],
           [r["step_s_max"] * 1e3 - m for m, r in zip(med, rows)]]
    ax1.barh(ys, med, xerr=err, color="tab:blue", capsize=3)
    ax1.set_yticks(ys, names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("step ms (median of the slowest rank, min-max)")
    left = [0.0] * len(rows)
    colors = {"weights_forward": "tab:orange", "weights_backward": "tab:green", "gradients": "tab:purple"}
    for k in KINDS:
        vals = [(r.get("kind_bytes_per_param") or {}).get(k, 0.0) for r in rows]
        ax2.barh(ys, vals, left=left, color=colors[k], label=SHORT[k] + " (counters)")
        left = [a + b for a, b in zip(left, vals)]
    tot = [r.get("bytes_per_param") for r in rows]
    ax2.scatter([t if t is not None else 0 for t in tot], ys, marker="|", s=200, color="k",
                label="whole step (counters)")
    me = [sum(r["self_bytes_per_param"].values()) if r.get("self_bytes_per_param") else None for r in rows]
    pts = [(v, y) for v, y in zip(me, ys) if v is not None]
    if pts:
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], marker="x", color="red",
                    label="flatcomm's own count (its collectives, to every peer)")
    ax2.set_yticks(ys, [""] * len(ys))
    ax2.invert_yaxis()
    ax2.set_xlabel("bytes that left a node per parameter per step")
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the bench CLI's `fsdp` command in this mode ------------------------------------------------------


def add_arguments(f) -> None:
    """The options of ``bench fsdp`` for this mode (on its subparser)."""
    from flatcomm.tools._cli import positive

    count = positive(int)
    f.add_argument("--nodes", type=count, help="N namespaces ('nodes') of --ranks-per-node ranks (needs --link): "
                                               "whole FSDP2 steps with bytes from the link counters")
    f.add_argument("--ranks-per-node", type=count, default=1, help="ranks per node with --nodes (default 1)")
    f.add_argument("--weights", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   help="whole-step mode: weight codecs, comma separated; the first gets the main rows, each "
                        "further one a row of its own (default int8,int4)")
    f.add_argument("--grads", default="int8", help="whole-step mode: flatcomm's gradient codec (default int8)")
    f.add_argument("--variants", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   help="whole-step mode: GRADS[/WEIGHTS][:hpz], comma separated (e.g. plain,int8,int8/int8:hpz); "
                        "default: see flatcomm/tools/bench/fsdp_steps.py")
    f.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="whole-step mode: bf16 = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    f.add_argument("--params", type=positive(float), help="whole-step mode: transformer parameters "
                                                          "(default 25e6; --quick 2e5)")
    f.add_argument("--layers", type=count, default=8, help="whole-step mode: transformer blocks (default 8)")
    f.add_argument("--batch", type=count, default=2, help="whole-step mode: sequences per rank (default 2)")
    f.add_argument("--seq", type=count, default=32, help="whole-step mode: tokens per sequence (default 32)")
    f.add_argument("--count-steps", type=count, default=1,
                   help="whole-step mode: extra steps with every collective bracketed by counter reads (default 1)")


def wanted(a) -> bool:
    """Whether ``bench fsdp`` runs whole steps (this module) rather than the reduce-scatter table."""
    return bool(getattr(a, "nodes", None) or getattr(a, "weights", None) or getattr(a, "variants", None))


def bench(a, meta: dict, run_ranks) -> List[Dict[str, Any]]:
    """``bench fsdp`` in whole-step mode; ``run_ranks`` is the CLI's runner (loopback or link)."""
    import sys

    if a.nodes and not a.link:
        raise SystemExit("flatcomm.bench: --nodes needs --link (the nodes are joined by a shaped link)")
    g = a.ranks_per_node if a.nodes else 1
    weights = a.weights or ["int8", "int4"]
    variants = a.variants or default_variants(a.grads, weights, g)
    try:
        for v in variants + [a.grads + "/" + w for w in weights]:
            if parse_variant(v).hpz and g < 2:
                raise ValueError(f"variant {v!r}: ':hpz' needs --ranks-per-node >= 2")
    except ValueError as e:
        raise SystemExit(f"flatcomm.bench fsdp: {e}") from None
    if "plain" not in variants:
        variants = ["plain"] + variants  # every ratio's baseline
    params = a.params or (2e5 if a.quick else 25e6)
    dims = model_dims(params, 2 if a.quick else a.layers, 256 if a.quick else 1024)
    cfg = dict(dims, variants=variants, ranks_per_node=g, counters=bool(a.link), param_dtype=a.param_dtype,
               steps=a.steps or (2 if a.quick else 6), warmup=a.warmup, count_steps=a.count_steps,
               batch=a.batch, seq=a.seq)
    meta["config"] = cfg
    n = transformer_params(dims["d_model"], dims["layers"], dims["vocab"])
    print(f"[bench] fsdp whole steps: {a.ranks} ranks ({g} per node), {n / 1e6:.1f}M parameters "
          f"(d {dims['d_model']}, {dims['layers']} blocks), {a.param_dtype} params, batch {a.batch}x{a.seq}/rank, "
          f"variants {', '.join(variants)}; {cfg['warmup']} warm-up + {cfg['steps']} timed + "
          f"{cfg['count_steps']} counting steps each (round robin)", file=sys.stderr, flush=True)
    if not a.link:
        print("[bench] no --link: no interface counters; bytes are flatcomm's own count", file=sys.stderr)
    rows = run_ranks(a, meta, _rank_main, cfg, timeout_s=a.timeout)[0]
    return finish(rows)
