"""FSDP2 rows of the convergence benchmark (:mod:`flatcomm.tools.bench.convergence`).

Rows: ``fsdp`` (plain FSDP2: its own all-gathers and reduce-scatters, the baseline of the others),
``fsdp:grads=int8`` (:func:`flatcomm.fsdp.apply` with that gradient codec, error feedback on),
``fsdp:grads=int8,weights=int8`` (also quantized weight all-gathers), ``fsdp:grads=int8,weights=int4``;
``weights=`` alone sends the gradients with flatcomm's lossless fp32; ``weights_block=64`` gives the
weight codec a smaller block (more scales, a finer grid). Every block of the model (the
transformer layers; for the sequential nets every child with parameters) is one ``fully_shard``
unit, the rest is in the root's. The same init and batches as the DDP rows of the same seed;
gradient accumulation pauses FSDP's gradient sync (``set_requires_gradient_sync(False)``) for all
but the last micro-batch, as DDP's rows use ``no_sync()``.

The held-out loss is that of the trained full-precision weights (gathered exactly with
``get_model_state_dict(full_state_dict=True)`` into an unsharded copy), the quantity every row is
compared on; ``val_gathered`` is the same loss through FSDP's forward, i.e. with the weights as the
quantized all-gathers deliver them (what inference on the sharded model would see).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from flatcomm.ops.codecs import Codec

from .convergence_workloads import Workload, forward_backward, parse_row

OPTIONS = ("grads", "weights", "weights_block")


def check_options(opts: Dict[str, Any]) -> None:
    """The options of an ``fsdp`` row, or a ValueError naming the problem."""
    from flatcomm.fsdp.weights import WEIGHT_CODECS
    from flatcomm.ops.codecs import CODECS

    bad = [k for k in opts if k not in OPTIONS]
    if bad:
        raise ValueError(f"fsdp rows take {', '.join(OPTIONS)}, not {', '.join(bad)}")
    if "grads" in opts and opts["grads"] not in CODECS:
        raise ValueError(f"grads={opts['grads']!r}: one of {', '.join(CODECS)}")
    if "weights" in opts and opts["weights"] not in WEIGHT_CODECS:
        raise ValueError(f"weights={opts['weights']!r}: one of {', '.join(WEIGHT_CODECS)}")
    if "weights_block" in opts:
        if "weights" not in opts or not str(opts["weights_block"]).isdigit():
            raise ValueError(f"weights_block={opts['weights_block']!r}: a block size, with weights=int8 or int4")
        try:
            Codec(opts["weights"], block_size=int(opts["weights_block"]))
        except ValueError as e:
            raise ValueError(f"weights_block={opts['weights_block']}: {e}") from None


def shard_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules that get a ``fully_shard`` of their own (before the root's)."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and hasattr(blocks, "layers"):  # demo.CharTransformer: its layers
        return list(blocks.layers)
    return [m for m in model.children() if next(m.parameters(), None) is not None]


@contextlib.contextmanager
def _no_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _held_out(w: Workload, model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(w.loss(model(x), y)) for x, y in w.held_out()) / len(w.held_out())


def train_fsdp(w: Workload, row: str, rank: int, world: int, seed: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import flatcomm.fsdp as F

    import warnings

    # FSDP2 warns that the root returns a view (Linear on 3-D input); nothing here writes to it
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    name, opts = parse_row(row)
    check_options(opts)
    torch.manual_seed(1000 + seed)  # the DDP rows' init
    model = w.model()
    n = sum(p.numel() for p in model.parameters())
    for unit in shard_units(model):
        fully_shard(unit)
    fully_shard(model)
    rs = None
    if opts:
        weights = opts.get("weights")
        if "weights_block" in opts:
            weights = Codec(weights, block_size=int(opts["weights_block"]))
        rs = F.apply(model, opts.get("grads", "fp32"), weights=weights)
    opt, sched = w.make_optimizer(model.parameters())
    curve: List[float] = []
    for step in range(w.steps):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(w, model, step, rank, lambda: _no_gradient_sync(model))
        w.before_step(model.parameters())
        opt.step()
        if sched is not None:
            sched.step()
        lt = loss.reshape(1)
        dist.all_reduce(lt)
        curve.append(lt.item() / world)
        if not math.isfinite(curve[-1]):
            break
    val_gathered = _held_out(w, model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = w.model()
    plain.load_state_dict(full)
    out = {"row": row, "codec": name, "options": opts, "val": _held_out(w, plain), "val_gathered": val_gathered,
           "curve": curve, "params": n}
    if rs is not None:
        steps = max(1, len(curve))
        out["wire_bytes_per_step"] = rs.stats.wire_bytes / steps
        out["bytes_by_kind"] = {k: v / steps for k, v in rs.stats.bytes_by_kind.items()}
    else:
        # nominal: (W-1)/W of the fp32 parameters per all-gather (forward and backward of every
        # micro-batch) and per reduce-scatter
        gathers = 2 * len(w.batches(0, rank))
        out["wire_bytes_per_step"] = (gathers + 1) * 4 * n * (world - 1) / world
    return out

