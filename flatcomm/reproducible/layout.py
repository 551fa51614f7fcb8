"""Where the accumulator keeps the gradients: one flat buffer per parameter dtype, each parameter
starting on a block, so a block's exponent covers values of one tensor only."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

import torch

__all__ = ["GRAD_DTYPES", "Group", "layout", "trainable"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class Group:
    """Parameters of one dtype: their grads are views of ``flat``, each tensor starting on a block."""

    dtype: torch.dtype
    params: List[torch.nn.Parameter]
    offsets: List[int]             # start of each parameter in ``flat``
    flat: torch.Tensor             # grad storage, numel a multiple of the block
    start: int                     # position of ``flat`` in the global index space


def layout(named: Sequence[Tuple[str, torch.nn.Parameter]], block_size: int,
           device: torch.device) -> Tuple[List[Group], List[int]]:
    """The groups (fp32, bf16, fp16 order) and, per block of the global index space, the index in
    ``named`` of the parameter it belongs to."""
    groups: List[Group] = []
    block_param: List[int] = []
    start = 0
    for dtype in GRAD_DTYPES:
        idx = [i for i, (_, p) in enumerate(named) if p.dtype == dtype]
        if not idx:
            continue
        offsets, off = [], 0
        for i in idx:
            offsets.append(off)
            nb = -(-named[i][1].numel() // block_size)
            block_param.extend([i] * nb)
            off += nb * block_size
        flat = torch.zeros(off, dtype=dtype, device=device)
        groups.append(Group(dtype, [named[i][1] for i in idx], offsets, flat, start))
        start += off
    return groups, block_param


def trainable(model: Any) -> List[Tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires a gradient, each once: of a module, or
    of an iterable of parameters or (name, parameter) pairs."""
    if isinstance(model, torch.nn.Module):
        items = list(model.named_parameters())
    else:
        items = []
        for i, x in enumerate(model):
            items.append(tuple(x) if isinstance(x, tuple) else (f"param{i}", x))
    seen, out = set(), []
    for name, p in items:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out
