"""``keep_fp32=`` and the ``codec="auto"`` backoff for :mod:`flatcomm.fsdp` (FSDP2 and FSDP1).

**Exceptions.** FSDP2's reduce-scatter input is ``[world, S]``: row r is what rank r receives,
each parameter a range of columns (:mod:`flatcomm.fsdp`). Parameters that ``keep_fp32`` names are
sent in their own lossless fp32 reduce-scatter: :func:`split` divides a call's pieces in two,
:func:`take` copies one side's columns into a contiguous ``[world, S_side]`` input and
:func:`put` writes that side's reduced shard back into the output. Each side keeps its residuals
under its own group of parameter names (:class:`flatcomm._training.residual_store.Store`), so a parameter's
residual follows it; a kept parameter that still has one (a checkpoint saved without the
exception) sends it once through the fp32 encode, which zeroes it. FSDP1 flattens a unit's
parameters into one flat gradient whose chunk r is rank r's shard, so the kept values fall
differently in each chunk: :func:`rows` gives per-rank index rows padded to the widest (a padding
index reads a zero), :func:`gather` / :func:`scatter` move values and residuals, and the unit's
residual keeps its full layout (zeros where kept), so checkpoints do not change.

**Backoff.** As in the DDP hook (:class:`flatcomm._training.adapt.Monitor`), per ``auto`` decision key
``(kind, numel)``: each reduction with a residual adds ``||residual after||^2``,
``||input + residual before||^2`` and ``||input||^2`` to the key's window; every ``every``
reductions of the key, before the next one (the same point on every rank: FSDP issues the same
collectives in the same order everywhere), the window is summed over the ranks and the key may
move one codec up. ``state_dict()`` saves the decisions as one int64 tensor (:func:`encode`),
rows ``(kind, numel, codec, chunks)``, so a restart keeps what was learned.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from ..autotune import KINDS, Decision
from ..ops.codecs import CODECS

__all__ = ["decode", "encode", "gather", "put", "rows", "scatter", "split", "take"]

Pieces = List[Tuple[str, int]]  # (name, values per rank) in the input's column order


def split(pieces: Pieces, kept: Callable[[str], bool]) -> Tuple[Pieces, Pieces]:
    """(pieces sent with the codec, pieces kept in fp32), each in input order."""
    return [p for p in pieces if not kept(p[0])], [p for p in pieces if kept(p[0])]


def _columns(pieces: Pieces, side: Pieces) -> List[Tuple[int, int]]:
    """(offset, width) in the full row of each piece of ``side``."""
    want = {n for n, _ in side}
    out, off = [], 0
    for n, c in pieces:
        if n in want:
            out.append((off, c))
        off += c
    return out


def take(x: torch.Tensor, world: int, pieces: Pieces, side: Pieces) -> torch.Tensor:
    """The columns of ``side`` from the flat ``[world, S]`` input, as a contiguous flat tensor."""
    rows = x.view(world, -1)
    return torch.cat([rows[:, o:o + c] for o, c in _columns(pieces, side)], dim=1).reshape(-1)


def put(out: torch.Tensor, part: torch.Tensor, pieces: Pieces, side: Pieces) -> None:
    """Write ``side``'s reduced shard ``part`` into its columns of this rank's shard ``out``."""
    o2 = 0
    for o, c in _columns(pieces, side):
        out[o:o + c].copy_(part[o2:o2 + c])
        o2 += c


def rows(mask: torch.Tensor, world: int) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """FSDP1: the flat gradient's chunk r is rank r's shard; ``mask`` marks kept values, which
    fall differently in each chunk. Returns (kept, rest, kept count per rank): ``[world, width]``
    indices into the flat gradient, each row padded with the index ``numel`` (a zero, see
    :func:`gather`) to the widest row."""
    numel = mask.numel()
    m = mask.view(world, -1)
    idx = torch.arange(numel).view(world, -1)
    counts = [int(c) for c in m.sum(1)]

    def side(sel: torch.Tensor) -> torch.Tensor:
        width = max(int(s.sum()) for s in sel)
        out = torch.full((world, width), numel, dtype=torch.int64)
        for r in range(world):
            ids = idx[r][sel[r]]
            out[r, :ids.numel()] = ids
        return out

    return side(m), side(~m), counts


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]`` as a new contiguous flat tensor, the padding index reading a zero."""
    ext = torch.cat([flat.reshape(-1), flat.new_zeros(1)])
    return ext[idx.reshape(-1).to(flat.device)]


def scatter(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """The inverse of :func:`gather` (padding left out)."""
    i = idx.reshape(-1).to(flat.device)
    keep = i < flat.numel()
    flat.view(-1)[i[keep]] = values[keep]


def encode(decisions: Dict[Tuple[str, int], Any]) -> torch.Tensor:
    """``{(kind, numel): Decision}`` as an int64 tensor, rows (kind, numel, codec, chunks)."""
    rows = [[KINDS.index(k), n, CODECS.index(d.codec), int(d.chunks)] for (k, n), d in decisions.items()
            if k in KINDS and d.codec in CODECS]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


def decode(t: Any, key: str) -> Dict[Tuple[str, int], Any]:
    """The decisions of :func:`encode`, checked (the error names the checkpoint entry)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != 4:
        raise ValueError(f"flatcomm: checkpoint entry {key!r} must be an int64 tensor of rows "
                         f"(kind, numel, codec, chunks), got {t!r}")
    out = {}
    for kind, numel, codec, chunks in t.tolist():
        if not (0 <= kind < len(KINDS) and 0 <= codec < len(CODECS) and numel > 0 and chunks > 0):
            raise ValueError(f"flatcomm: checkpoint entry {key!r} holds a bad row {(kind, numel, codec, chunks)}")
        out[(KINDS[kind], numel)] = Decision(CODECS[codec], chunks, "restored from a checkpoint", {})
    return out
