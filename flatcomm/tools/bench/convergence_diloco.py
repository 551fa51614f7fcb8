"""DiLoCo rows of the convergence benchmark (:mod:`flatcomm.tools.bench.convergence`).

``diloco:codec=int4,H=50`` trains every rank as its own replica: the workload's inner optimizer
(AdamW with warm-up + cosine for the LM recipes, gradient clipping and accumulation as the DDP rows)
on the rank's own batches, and :class:`flatcomm.diloco.DiLoCo` every ``H`` inner steps (outer SGD,
lr 0.7, Nesterov momentum 0.9, fp32 master) with the codec and error feedback (``ef=false``: without,
as torchft's quantized path). ``fragments=`` and ``delay=`` give Streaming DiLoCo. Same init and
batches per seed as the DDP rows, so ``torch`` (DDP every step) sees the same tokens. A lossy
DiLoCo row is compared with the fp32 DiLoCo row of the same ``H`` (paired per seed), the fp32 row
with ``torch``. The step count should be a multiple of ``H``: the held-out loss is measured on the
weights of the last sync, the same on every replica.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import torch

from .convergence_workloads import Workload, forward_backward, held_out_loss, parse_row, record_loss

OPTIONS = ("codec", "H", "ef", "fragments", "delay", "outer_lr")


def check_options(opts: Dict[str, Any]) -> None:
    bad = [k for k in opts if k not in OPTIONS]
    if bad:
        raise ValueError(f"diloco rows take {', '.join(OPTIONS)}, not {', '.join(bad)}")
    if not isinstance(opts.get("H"), int) or opts["H"] < 1:
        raise ValueError("diloco rows need H=<inner steps per sync>")


def baseline_row(opts: Dict[str, Any]) -> str:
    """The fp32 DiLoCo row a lossy one is compared with."""
    return f"diloco:codec=fp32,H={opts['H']}"


def train_diloco(w: Workload, row: str, rank: int, world: int, seed: int) -> dict:
    from flatcomm.diloco import DiLoCo

    _, opts = parse_row(row)
    check_options(opts)
    torch.manual_seed(1000 + seed)  # the DDP rows' init
    model = w.model()
    opt, sched = w.make_optimizer(model.parameters())
    outer = DiLoCo(model, opt, sync_every=opts["H"], codec=opts.get("codec", "int4"),
                   error_feedback=bool(opts.get("ef", True)), fragments=opts.get("fragments", 1),
                   fragment_sync_delay=opts.get("delay", 0), outer_lr=opts.get("outer_lr", 0.7))
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
    return {"row": row, "codec": f"diloco {opts.get('codec', 'int4')}", "options": opts, "val": val, "curve": curve,
            "params": sum(p.numel() for p in model.parameters()),
            "wire_bytes_per_step": st["wire_bytes"] / max(1, len(curve)), "syncs": st["syncs"]}
