"""FSDP2: the custom reduce-scatter flatcomm sets on every ``FSDPModule`` and :func:`apply`
(see :mod:`flatcomm.fsdp`)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import frames as _private
from . import adapt as _fadapt
from .backend import Stats, Backend, Done, Pieces
from ..ops.codecs import resolve

__all__ = ["ModuleReduceScatter", "ReduceScatter", "apply", "managed_params", "shard_layout"]


class ReduceScatter(Backend):
    """FSDP2 custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) running flatcomm.

    codec: ``fp32`` (lossless; fixed source-rank order: the same bits every run), ``bf16``, ``fp16``,
        ``int8``, ``int4``, ``sign``, ``topk`` or a :class:`flatcomm.Codec`.
        ``auto``: a :class:`flatcomm.autotune.Tuner` (``tuner=``, default error budget int8) picks
        per reduce-scatter size, the same on every rank; ``stats.decisions`` holds what and why.
    error_feedback: keep per-parameter residuals for lossy codecs (see the module docstring). With
        ``auto``, a parameter group reduced in fp32 still sends its parameters' residuals (added
        once by the fp32 encode, which zeroes them).
    mode: ``ordered`` or ``exact`` (fp32 only: order-independent integer sums).
    chunks, block_size, ratio: passed to the collective / codec.
    start_step: the first ``start_step`` reductions of each parameter group are lossless fp32 (a
        warm-up, as in :class:`flatcomm.ddp.State`); ``state_dict()`` carries the count.
    keep_fp32: parameters always sent in lossless fp32 (no residual), as in
        :class:`flatcomm.ddp.State`: a predicate ``f(name, param)``, fnmatch name patterns, or
        ``"small"``. A group that mixes both is sent as two reduce-scatters (:mod:`flatcomm.fsdp.adapt`).
        Needs parameter names: :func:`apply` (or :meth:`for_module`) gives them.
    backoff: ``codec="auto"`` only: a :class:`flatcomm.ddp.Backoff` (default ``Backoff()``;
        ``False``: off) that moves a collective size to a more precise codec when the error measured
        in training exceeds the budget, checked every ``every`` reductions of that size;
        ``adaptations`` (``kind``, ``numel``, ``step``: reductions of that size so far, from, to,
        numbers, why) and ``decisions`` say when and why; after a move ``state_dict()`` keeps the
        decisions (``"rank{r}.__decisions__"``).
    """

    def __init__(self, codec: Any = "fp32", *, error_feedback: bool = True, mode: str = "ordered",
                 chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, tuner=None, start_step: int = 0, keep_fp32: Any = None,
                 backoff: Any = None):
        super().__init__(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                         block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                         keep_fp32=keep_fp32, backoff=backoff)
        self._names: Dict[int, str] = {}  # id(sharded parameter) -> name (from for_module's model)
        # How each call found its parameters (see _pieces): "module", "fsdp_frame" or "size".
        self.layout_sources: Dict[str, int] = {"module": 0, "fsdp_frame": 0, "size": 0}
        self.weights: Any = None  # apply(weights=...): a flatcomm.fsdp.weights.Weights

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 op: Any = dist.ReduceOp.AVG, async_op: bool = False):
        return self._reduce_scatter(output_tensor, input_tensor, group, op, async_op, None)

    def for_module(self, module: torch.nn.Module, model: Optional[torch.nn.Module] = None) -> "ModuleReduceScatter":
        """This backend bound to one ``FSDPModule``, for ``module.set_custom_reduce_scatter``:
        it knows the module's parameters (names from ``model``, default ``module``), so residuals
        are keyed without FSDP's internals. :func:`apply` does this for every module."""
        named = list((model if model is not None else module).named_parameters())
        names = {id(p): n for n, p in named}
        self._names.update(names)
        self._params.update(named)
        layout = _module_layout(module, names)
        for name, numel, world in layout:
            self._res.templates[name] = world * numel
        worlds = {w for _, _, w in layout}
        whole = len(layout) == len(managed_params(module)) and len(worlds) == 1
        return ModuleReduceScatter(self, [(n, c) for n, c, _ in layout] if whole else None)

    def _reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: Any,
                        async_op: bool, layout: Optional[Pieces]):
        numel = input_tensor.numel()
        codec = self._codec_for(numel, group, input_tensor.device, "reduce_scatter")
        world = dist.get_world_size(group)
        pieces = self._pieces(layout, numel, world)
        if self._warming(tuple(n for n, _ in pieces)):
            codec = resolve("fp32")  # a residual loaded from a checkpoint is sent (flushed) once
        rest, kept = _fadapt.split(pieces, self._is_kept) if self._keep_fn is not None else (pieces, [])
        if not kept or not rest:
            return self._send(output_tensor, input_tensor, pieces, codec if rest else resolve("fp32"),
                              op, group, async_op=async_op, world=world, key_numel=numel)
        # keep_fp32: the codec's parameters and the kept ones in two reduce-scatters (fsdp_adapt)
        for side, side_codec in ((rest, codec), (kept, resolve("fp32"))):
            part = torch.empty(sum(c for _, c in side), dtype=output_tensor.dtype, device=output_tensor.device)
            self._send(part, _fadapt.take(input_tensor, world, pieces, side), side, side_codec, op, group,
                       async_op=False, world=world, key_numel=numel)
            _fadapt.put(output_tensor, part, pieces, side)
        return Done(output_tensor) if async_op else None

    def _pieces(self, layout: Optional[Pieces], numel: int, world: int) -> Pieces:
        """The parameters in this call's input: the bound module's (every parameter got a
        gradient: the common case, public API), else FSDP's own list (a private frame, see
        :mod:`flatcomm.fsdp.frames`), else one piece keyed by the size."""
        if layout is not None and sum(c for _, c in layout) * world == numel:
            self.layout_sources["module"] += 1
            return layout
        fps = _private.reduce_call_params()
        if fps is not None:
            pieces = []
            for fp in fps:
                param, fqn, c = _private.param_piece(fp)
                name = self._names.get(id(param)) or fqn
                if name is None or c is None:
                    break
                if param is not None:
                    self._params.setdefault(name, param)
                pieces.append((name, c))
            else:
                if sum(c for _, c in pieces) * world == numel:
                    self.layout_sources["fsdp_frame"] += 1
                    return pieces
        self.layout_sources["size"] += 1
        return [(f"flat{numel}", numel // world)]


class ModuleReduceScatter:
    """A :class:`ReduceScatter` as set on one ``FSDPModule`` (:meth:`ReduceScatter.for_module`):
    the backend plus the module's parameter layout (None: unknown, FSDP's list is used)."""

    def __init__(self, backend: ReduceScatter, layout: Optional[Pieces]):
        self.backend = backend
        self.layout = layout

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.backend.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 op: Any = dist.ReduceOp.AVG, async_op: bool = False):
        return self.backend._reduce_scatter(output_tensor, input_tensor, group, op, async_op, self.layout)


def shard_layout(p: torch.Tensor) -> Optional[Tuple[int, int, bool]]:
    """(values per rank, ranks it is sharded over, replicated too) of a parameter ``fully_shard``
    made, from its DTensor placements: FSDP pads the sharded dim to a multiple of the ranks, so
    rank r holds ``ceil(size / ranks)`` slices of it. None when not sharded over exactly one mesh
    dimension (e.g. also tensor-parallel): FSDP's own list is used then."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return None
    shards = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shards) != 1:
        return None
    i, pl = shards[0]
    world = p.device_mesh.size(i)
    shape = list(p.shape)
    rows = -(-shape[pl.dim] // world)
    return rows * math.prod(shape[:pl.dim] + shape[pl.dim + 1:]), world, any(
        isinstance(x, Replicate) for x in p.placements)


def managed_params(module: Any) -> List[torch.nn.Parameter]:  # an nn.Module that is an FSDPModule
    """The parameters ``fully_shard(module)`` manages, in FSDP's order (its reduce-scatter input
    layout): submodules in post-order (children first), nested FSDPModules left out, each once."""
    from torch.distributed.fsdp import FSDPModule

    seen_modules: set = set()
    seen: set = set()
    out: List[torch.nn.Parameter] = []
    order: List[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        seen_modules.add(m)
        for c in m.children():
            if c not in seen_modules and not isinstance(c, FSDPModule):
                visit(c)
        order.append(m)

    visit(module)
    for m in order:
        for _, p in m.named_parameters(recurse=False):
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def _module_layout(module: Any, names: Dict[int, str]) -> List[Tuple[str, int, int]]:
    """(name, values per rank, ranks) of each managed parameter whose layout is public."""
    out = []
    for p in managed_params(module):
        lay = shard_layout(p)
        if lay is not None and id(p) in names:
            out.append((names[id(p)], lay[0], lay[1]))
    return out


def apply(model: torch.nn.Module, codec: Any = "fp32", *, error_feedback: bool = True,
          mode: str = "ordered", chunks: Optional[int] = None, block_size: Optional[int] = None,
          ratio: Optional[float] = None, tuner=None, start_step: int = 0, keep_fp32: Any = None,
          backoff: Any = None, weights: Any = None) -> ReduceScatter:
    """Set one flatcomm :class:`ReduceScatter` on every ``FSDPModule`` in ``model`` and return it.

    One instance serves all modules (residuals are keyed by parameter name, not by module), so
    ``.stats`` and ``.state_dict()`` cover the whole model. ``model`` should be the root that
    FSDP's parameter names are relative to. ``codec`` defaults to lossless fp32 (FSDP's own
    reduce, same bits every run); ``"int8"`` is what :func:`flatcomm.ddp.register` defaults to.
    Each module gets ``rs.for_module(module, model)`` (see :class:`ModuleReduceScatter`).

    ``weights``: also quantize the weight all-gathers (ZeRO++ qwZ) with this codec (``"int8"``,
    ``"int4"``, ``"bf16"``, ``"fp16"``, ``"fp32"`` or a :class:`flatcomm.Codec`; default None: FSDP's
    own); ``keep_fp32`` parameters are gathered exactly. Call it after ``fully_shard`` and before
    the first forward; with ``fully_shard(reshard_after_forward=k)`` the backward gather stays in
    groups of ``k`` ranks (hpZ). ``rs.weights`` says what was done, ``rs.stats.bytes_by_kind``
    where the bytes go. See :mod:`flatcomm.fsdp.weights`.

    Args:
        model: the root module, after ``fully_shard`` (parameter names are relative to it).
        codec: the gradients' reduce-scatter codec (default ``"fp32"``, lossless), or ``"auto"``.
        error_feedback: keep residuals for a lossy codec (default True).
        mode: ``"ordered"`` (default) or ``"exact"`` (fp32 only).
        chunks: pipeline chunks per reduce-scatter (default: automatic).
        block_size: the codec's block size (default: the codec's).
        ratio: ``topk``'s kept fraction.
        tuner: ``codec="auto"``'s :class:`flatcomm.autotune.Tuner` (default one per group).
        start_step: reductions per parameter sent in lossless fp32 before the codec starts.
        keep_fp32: parameters always sent (and gathered) exactly: a predicate, name patterns or ``"small"``.
        backoff: ``codec="auto"``: a :class:`flatcomm.ddp.Backoff` (or False).
        weights: the weight all-gathers' codec (qwZ), or None (FSDP's own).

    Returns:
        The :class:`ReduceScatter` (``stats``, ``state_dict()``, ``load_state_dict()``).

    Example::

        >>> for layer in model.layers:
        ...     fully_shard(layer)
        >>> fully_shard(model)
        >>> rs = flatcomm.fsdp.apply(model, "int8", keep_fp32="small")
        >>> model(x).sum().backward()
        >>> rs.stats.wire_bytes, rs.stats.bytes_by_kind
    """
    from torch.distributed.fsdp import FSDPModule

    rs = ReduceScatter(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                       block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                       keep_fp32=keep_fp32, backoff=backoff)
    if weights is not None:  # first: it checks every module before it changes any
        from . import weights as fsdp_weights

        rs.weights = fsdp_weights.apply(model, rs, weights, keep_fp32=keep_fp32)
    found = False
    for m in model.modules():
        if isinstance(m, FSDPModule):
            found = True
            # FSDP's ReduceScatter ABC lives in a private module; FSDP only calls allocate() and __call__()
            m.set_custom_reduce_scatter(rs.for_module(m, model))  # type: ignore[arg-type]
    if not found:
        raise ValueError("flatcomm.fsdp.apply: no FSDPModule in the model (call fully_shard first)")
    return rs
