"""What a lossy codec does to Adam: compressed vs true gradients and moments along one training run.

    python -m flatcomm.tools.bench.adam_probe [--rows sign,int8] [--steps 80] [--every 10] [--json P]

Trains the ``lm`` workload of :mod:`flatcomm.tools.bench.convergence` (AdamW) on 2 gloo ranks with
``flatcomm.ddp`` and a wrapper hook that keeps each bucket's local gradient before flatcomm reduces
it. After every backward pass the true mean gradient (a plain fp32 all-reduce of those copies) feeds
a shadow Adam (same betas) next to the optimizer's state, which saw the codec's output. Every
``--every`` steps, on rank 0:

* ``grad_cos``, ``grad_norm_ratio``: the reduced gradient against the true mean gradient;
* ``v_ratio_p10/p50/p90``: percentiles over all coordinates of sqrt(v_codec / v_true), Adam's
  per-coordinate step size divisor (1.0 everywhere: the codec leaves the variance estimate alone);
* ``update_cos``, ``update_norm_ratio``: Adam's direction m / (sqrt(v) + eps) with the codec's
  moments against the true ones;
* ``residual_over_grad``: ||residuals|| (client + server, all buckets) / ||true mean gradient||.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

from flatcomm.tools.bench.convergence import LM, parse_row


def _probe_row(row: str, rank: int, world: int, steps: int, every: int, seed: int) -> List[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    name, opts = parse_row(row)
    w = LM(seed, steps / LM.steps)
    torch.manual_seed(1000 + seed)
    model = w.model()
    ddp = DDP(model)
    state = fddp.State(name, model=ddp, **opts)
    kept: List[tuple] = []

    def keeping_hook(st, bucket):
        kept.append((list(bucket.parameters()), bucket.buffer().detach().clone()))
        return fddp.hook(st, bucket)

    keeping_hook.__annotations__ = dict(fddp.hook.__annotations__)
    ddp.register_comm_hook(state, keeping_hook)
    opt, sched = w.make_optimizer(ddp.parameters())
    b1, b2 = opt.defaults["betas"]
    eps = opt.defaults["eps"]
    m_true: Dict[int, torch.Tensor] = {}
    v_true: Dict[int, torch.Tensor] = {}
    out = []
    for step in range(w.steps):
        x, y = w.batch(step, rank)
        kept.clear()
        opt.zero_grad(set_to_none=True)
        w.loss(ddp(x), y).backward()
        true: Dict[int, torch.Tensor] = {}
        for params, buf in kept:
            dist.all_reduce(buf)
            buf /= world
            for p, g in zip(params, torch.split(buf, [p.numel() for p in params])):
                true[id(p)] = g.view_as(p)
        opt.step()
        sched.step()
        for p in model.parameters():
            g = true[id(p)]
            m_true.setdefault(id(p), torch.zeros_like(p)).mul_(b1).add_(g, alpha=1 - b1)
            v_true.setdefault(id(p), torch.zeros_like(p)).mul_(b2).addcmul_(g, g, value=1 - b2)
        if rank == 0 and (step % every == 0 or step == w.steps - 1):
            out.append(_measure(step, model, opt, true, m_true, v_true, eps, state))
    return out


def _cat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def _measure(step, model, opt, true, m_true, v_true, eps, state) -> dict:
    params = list(model.parameters())
    g_c, g_t = _cat(p.grad for p in params), _cat(true[id(p)] for p in params)
    v_c = _cat(opt.state[p]["exp_avg_sq"] for p in params)
    m_c = _cat(opt.state[p]["exp_avg"] for p in params)
    v_t, m_t = _cat(v_true[id(p)] for p in params), _cat(m_true[id(p)] for p in params)
    ratio = (v_c / v_t.clamp_min(1e-30)).sqrt()
    q = torch.quantile(ratio[v_t > 0].float(), torch.tensor([0.1, 0.5, 0.9])).tolist()
    u_c, u_t = m_c / (v_c.sqrt() + eps), m_t / (v_t.sqrt() + eps)
    st = state.stats["steps"]
    res = st[-1].get("residual_norm", 0.0) if st else 0.0
    return {"step": step,
            "grad_cos": float(torch.nn.functional.cosine_similarity(g_c, g_t, dim=0)),
            "grad_norm_ratio": float(g_c.norm() / g_t.norm()),
            "v_ratio_p10": q[0], "v_ratio_p50": q[1], "v_ratio_p90": q[2],
            "update_cos": float(torch.nn.functional.cosine_similarity(u_c, u_t, dim=0)),
            "update_norm_ratio": float(u_c.norm() / u_t.norm()),
            "residual_over_grad": res / float(g_t.norm())}


def _rank_main(rank, world, rows, steps, every, seed):
    return {row: _probe_row(row, rank, world, steps, every, seed) for row in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="sign,int8", help="rows as in the convergence benchmark, ';'-separated "
                                                        "when they carry options")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(";" if ";" in args.rows else ",") if r]
    from flatcomm.tools import spawn

    res = spawn.run(2, _rank_main, rows, args.steps, max(1, args.every), args.seed, timeout_s=args.timeout)[0]
    cols = ("grad_cos", "grad_norm_ratio", "v_ratio_p10", "v_ratio_p50", "v_ratio_p90", "update_cos",
            "update_norm_ratio", "residual_over_grad")
    for row, recs in res.items():
        print(f"\n{row}")
        print(f"{'step':>5s} " + " ".join(f"{c:>18s}" for c in cols))
        for r in recs:
            print(f"{r['step']:5d} " + " ".join(f"{r[c]:18.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "adam_probe", "steps": args.steps, "rows": res}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
