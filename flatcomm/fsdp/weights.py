"""Quantized FSDP2 weight all-gathers (DeepSpeed ZeRO++'s qwZ) with node-local resharding (hpZ).

Used through :func:`flatcomm.fsdp.apply`::

    for block in model.blocks: fully_shard(block, reshard_after_forward=gpus_per_node)   # hpZ
    fully_shard(model)
    rs = flatcomm.fsdp.apply(model, "int8", weights="int8", keep_fp32="small")
    ...                                                  # train as usual
    rs.stats.bytes_by_kind    # {"weights_forward": ..., "weights_backward": ..., "gradients": ...}

**What is sent.** Before each weight all-gather, every rank encodes its shard of the master weight
with a flatcomm codec (``int8``/``int4``: blockwise, one fp32 scale per block; ``bf16``/``fp16``:
casts; ``fp32``: lossless) and FSDP gathers the payload bytes (uint8). After it, every rank's piece
is decoded straight into the unsharded parameter in the compute dtype
(``MixedPrecisionPolicy.param_dtype``, else the master's). There is no error feedback: every
gather re-encodes the exact master shard, so the error never accumulates in the weights (the
optimizer only ever sees full-precision masters), and the forward and backward gathers of one step
decode the same bytes. Each rank's piece is self-contained (its own block scales), encoded from its
dim-0-padded shard (FSDP's layout: ``ceil(rows / ranks)`` rows each, zero rows past the end), so
all pieces have one size and the unsharded parameter is their concatenation cut to its numel.

**How it plugs in.** FSDP2's public extension point: a sharded parameter's local tensor may define
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torch ``_fsdp_param.py``; torchao's float8
weights are the other user). :func:`apply` runs after ``fully_shard`` and before the first forward:
it replaces the local tensor of each sharded DTensor parameter by a :class:`QuantizedWeight` that
*shares its storage* (``Tensor._make_subclass``, as ``nn.Parameter`` does), so FSDP's padded buffer,
the optimizer's in-place updates and ``load_state_dict`` all keep writing the same memory, and has
FSDP look for the hooks again (what its lazy init does: "allow monkey patch after init"). Wrapping
after ``fully_shard`` keeps ``apply`` one call after sharding, as for gradients, and leaves FSDP's
padding and sharding untouched (torchao wraps before ``fully_shard`` and must then make ``new_zeros``,
``narrow`` and ``copy_`` return its subclass so that it survives sharding). Shared storage also
passes FSDP's check that the local tensor is still its padded buffer, which a wrapper subclass
without storage cannot.
``QuantizedWeight`` turns ``__torch_function__`` off, so every op on it returns a plain tensor:
optimizer states, ``detach()`` (hence ``model.state_dict()``) and DCP see ordinary full-precision
DTensors; DCP and ``load_state_dict`` write the masters in place. A ``load_state_dict(assign=True)``
that swaps the parameters is wrapped again by a post-load hook; ``model.to(...)`` and the like after
``apply`` are not (FSDP's gather buffers are sized for the payload: the next gather fails).

The pre-hook takes FSDP's one-argument form ``(mesh)`` (torchao's too): the five-argument form
requires every all-gather input of a dim-0-padded rank to have the padded shard's *shape*, which a
byte payload cannot have.

**Node-local resharding (hpZ).** ``fully_shard(reshard_after_forward=k)`` reshards to ``k`` ranks after
forward so that the backward all-gather stays within a group of ``k`` (the node). FSDP2 (torch
2.13) does not support that for all-gather extensions: it keeps a slice of the gathered uint8 bytes
as the resharded parameter (which fails: a uint8 parameter cannot require grad) and has no
pre-all-gather path from that state (``NotImplementedError``). So for a module holding quantized weights
:func:`apply` reads the ``k`` and its group from FSDP, sets the module to ``reshard_after_forward=True``
and installs :class:`WeightAllGather`: the forward gather keeps rows ``[j*R/k, (j+1)*R/k)`` of the
gathered payloads (``j``: this rank in its ``k``-group, ``R``: the shard ranks), and the backward
gather is an all-gather of those rows within the ``k``-group: the bytes the forward gather
produced, so forward and backward use the same weights bit for bit, and training is bitwise that of
``reshard_after_forward=True`` (users of DeepSpeed's hpZ report losses that differ from plain
ZeRO-3: #4851, #4886, #6926, #7164; the tests here hold them equal). The kept rows cost ``1/k`` of the module's payload, as FSDP's own
resharded copy does (int8: half of a bf16 copy). They are dropped once used, and not used when any
of the module's parameters changed since (their version counters), e.g. a write between forward and
backward: the backward gather then runs over all ``R`` ranks, re-encoding the masters. That choice is
each rank's own, from counters that move together on every rank (optimizer steps, loads); writing
the weights of some ranks only between a forward and its backward would split the ranks between the
two gathers. ``rs.weights.comms[name].gathers`` counts which way each gather went.

**Bytes.** Every FSDP module gets a :class:`WeightAllGather` (``set_custom_all_gather``), which adds
the bytes this rank sends (its input times the peers: ``nccl-tests``' all-gather volume) to
``rs.stats``: ``weights_forward_bytes``, ``weights_backward_bytes`` (also in ``wire_bytes`` and
``calls``); ``Stats.bytes_by_kind`` splits ``wire_bytes`` into weights forward / backward /
gradients. The first gather of each size checks, with one small all-gather, that every rank sends
the same number of bytes with the same codecs (a rank with other options would otherwise hang or
mis-decode), and raises on every rank if not.

**Non-finite weights.** As the gradient codecs: an inf or NaN in a block of an ``int8``/``int4``
shard makes every value of that block decode to NaN (the loss shows it at once; the master keeps
its values); the cast codecs carry them per element (``fp16`` also turns values above 65504 into
inf). A payload from another rank is decoded by the bounds-checked flatcomm decoders: any bytes
give some values, never an out-of-bounds access.

**Limits (raise at apply).** Parameters sharded on another dimension than 0 (``shard_placement_fn``),
DTensor parameters (tensor parallel), CPU offload, a module that has already gathered (apply before
the first forward), a module with several parameter groups, ``weights=`` twice. ``keep_fp32``
parameters, non-float and empty ones are gathered by FSDP itself, exactly.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import frames as _private
from ..comm.header import all_gather_single
from ..ops.codecs import WEIGHT_CODECS, Codec, resolve
from .quantized import QuantizedWeight, _Spec, decode_rows_into

__all__ = ["WEIGHT_CODECS", "QuantizedWeight", "WeightAllGather", "Weights", "apply", "decode_rows_into",
           "weight_codec"]

# WEIGHT_CODECS (the codec table's `weights` column): the codecs a weight may be gathered with. sign
# and topk are refused: without error feedback they would replace the weights by their signs / by
# zeros outside the largest 1%.


def weight_codec(weights: Any, block_size: Optional[int] = None) -> Codec:
    """``weights=`` as a :class:`flatcomm.Codec`, or a clear error."""
    if isinstance(weights, str) and weights == "auto":
        raise ValueError("flatcomm: weights= takes a fixed codec (one of "
                         f"{', '.join(WEIGHT_CODECS)}), not 'auto'")
    if not isinstance(weights, (str, Codec)):
        raise TypeError(f"flatcomm: weights must be a codec name or a flatcomm.Codec, got {weights!r}")
    c = resolve(weights, block_size)
    if not c.for_weights:
        raise ValueError(f"flatcomm: {c.name!r} cannot gather weights (no error feedback there: the weights "
                         f"themselves would be replaced); use one of {', '.join(WEIGHT_CODECS)}")
    return c


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # as FSDP's own is_bw()


class WeightAllGather:
    """An FSDP2 all-gather (``FSDPModule.set_custom_all_gather``) for one module: counts the bytes
    by kind into ``owner.counters`` and, with ``node=(group, k)``, does hpZ (module docstring)."""

    def __init__(self, owner: Any, params: Sequence[torch.Tensor], fingerprint: int,
                 node: Optional[Tuple[Any, int]] = None):
        self.owner = owner  # has .counters (a flatcomm.fsdp.Stats)
        self.params = list(params)  # the module's sharded parameters (version counters)
        self.specs: List[_Spec] = []  # of its quantized parameters
        self.fingerprint = fingerprint  # the same on every rank for the same options
        self.node = node
        self._kept: Optional[Tuple[torch.Tensor, Tuple[int, ...], Tuple[Any, ...]]] = None
        self._checked: set = set()
        # how each gather ran: "forward", "backward_node" (hpZ: the kept rows in the k-group) and
        # "backward_full" (all shard ranks: no hpZ, or the kept rows were stale or missing)
        self.gathers: Dict[str, int] = {"forward": 0, "backward_node": 0, "backward_full": 0}

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def _versions(self) -> Tuple[int, ...]:
        # The DTensor's counter moves with its in-place ops (optimizer, load): DTensor runs the
        # local op below autograd, which leaves the local's counter alone; a write to the local
        # tensor itself moves the local's.
        return tuple(v for p in self.params for v in (p._version, p._local_tensor._version))  # type: ignore[attr-defined]

    def _count(self, kind: str, nbytes: int) -> None:
        st = self.owner.counters
        st.wire_bytes += nbytes
        st.calls += 1
        if hasattr(st, kind):
            setattr(st, kind, getattr(st, kind) + nbytes)

    def _check(self, input_tensor: torch.Tensor, group) -> None:
        """Once per size: every rank sends as many bytes with the same options, or all raise."""
        sig = (input_tensor.numel(), input_tensor.dtype)
        if sig in self._checked:
            return
        mine = torch.tensor([input_tensor.numel(), input_tensor.element_size(), self.fingerprint],
                            dtype=torch.int64, device=input_tensor.device)
        every = torch.empty(dist.get_world_size(group) * 3, dtype=torch.int64, device=input_tensor.device)
        all_gather_single(every, mine, group=group)
        rows = every.view(-1, 3).tolist()
        if any(r != rows[0] for r in rows):
            raise RuntimeError(f"flatcomm: the ranks disagree on a weight all-gather (numel, element size, "
                               f"options fingerprint per rank: {rows}): every rank must wrap the same model "
                               f"with the same weights= and keep_fp32=")
        self._checked.add(sig)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 async_op: bool = False):
        world = dist.get_world_size(group)
        self._check(input_tensor, group)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        sig = (output_tensor.numel(), output_tensor.dtype, world)
        if _in_backward() and self.node is not None:
            kept, self._kept = self._kept, None
            if kept is not None and kept[2] == sig and kept[1] == self._versions():
                node_group, k = self.node
                self._count("weights_backward_bytes", kept[0].numel() * kept[0].element_size() * (k - 1))
                self.gathers["backward_node"] += 1
                return all_gather_single(output_tensor, kept[0], group=node_group, async_op=async_op)
        kind = "weights_backward_bytes" if _in_backward() else "weights_forward_bytes"
        self._count(kind, nbytes * (world - 1))
        self.gathers["backward_full" if kind == "weights_backward_bytes" else "forward"] += 1
        if self.node is None or kind == "weights_backward_bytes":
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        # forward with hpZ: gather (synchronously: FSDP only waits on a real Work), keep our rows
        all_gather_single(output_tensor, input_tensor, group=group)
        node_group, k = self.node
        per = world // k
        j = dist.get_rank(node_group)
        rows = output_tensor.view(world, -1)[j * per:(j + 1) * per].reshape(-1).clone()
        self._kept = (rows, self._versions(), sig)
        return None


@dataclasses.dataclass
class Weights:
    """What :func:`apply` did: the codec, the quantized and the kept parameters (names), and the
    modules whose backward gather stays in a group of ``k`` ranks (name -> k)."""
    codec: Codec
    quantized: List[str]
    kept: List[str]
    hpz: Dict[str, int]
    comms: Dict[str, WeightAllGather]


def _fingerprint(specs: Sequence[_Spec]) -> int:
    text = ";".join(f"{s.name}:{s.codec.name}:{s.codec.block_size}:{s.row_numel}" for s in specs)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _spec_for(name: str, p: torch.Tensor, codec: Codec) -> Optional[_Spec]:
    """The spec of one sharded parameter, None for one FSDP gathers itself (non-float); raises
    for layouts this cannot gather."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        raise ValueError(f"flatcomm: weights=: parameter {name!r} is not sharded by fully_shard (call apply "
                         f"after fully_shard), or list it in keep_fp32")
    if not p.dtype.is_floating_point:
        return None
    shards = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    others = [pl for pl in p.placements if not isinstance(pl, (Shard, Replicate))]
    if len(shards) != 1 or shards[0][1].dim != 0 or others:
        raise ValueError(f"flatcomm: weights=: parameter {name!r} has placements {p.placements}; quantized "
                         f"gathers need FSDP's dim-0 sharding (no tensor parallel, no shard_placement_fn); "
                         f"list it in keep_fp32")
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"flatcomm: weights=: parameter {name!r} is {p.dtype}; the codecs read fp32/bf16/fp16")
    if p.numel() == 0:
        return None
    ranks = p.device_mesh.size(shards[0][0])
    rows = p.shape[0]  # FSDP pads dim 0 to a multiple of the ranks: ceil(rows / ranks) rows each
    return _Spec(codec, -(-rows // ranks) * (p.numel() // rows), p.numel(), name)


def _owners(module: torch.nn.Module) -> Dict[int, Tuple[torch.nn.Module, str]]:
    """id(parameter) -> (submodule, attribute) where ``module`` holds it (first place seen)."""
    out: Dict[int, Tuple[torch.nn.Module, str]] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                out.setdefault(id(p), (sub, attr))
    return out


_Entry = Tuple[torch.nn.Module, str, _Spec]  # (submodule, attribute, spec) of a quantized parameter


def _wrap_module(module: torch.nn.Module, names: Dict[int, str], codec: Codec, keep) -> Tuple[List[_Entry], List[str]]:
    """Swap the local tensors of ``module``'s sharded parameters; (quantized entries, kept names)."""
    owners = _owners(module)
    entries: List[_Entry] = []
    kept: List[str] = []
    for p in _managed(module):
        name = names.get(id(p))
        if name is None or id(p) not in owners:
            continue
        if keep is not None and keep(name, p):
            kept.append(name)
            continue
        spec = _spec_for(name, p, codec)
        if spec is None:
            kept.append(name)
            continue
        p._local_tensor = QuantizedWeight(p._local_tensor, spec)  # type: ignore[attr-defined]
        entries.append((*owners[id(p)], spec))
    return entries, kept


def _rewrap_hook(module: torch.nn.Module, entries: List[_Entry], comm: WeightAllGather):
    """``load_state_dict(assign=True)`` registers new parameter objects: wrap them as the old ones
    (FSDP's own post-load hook, registered before, has re-padded them by then)."""
    from torch.distributed.tensor import DTensor

    old = _managed(module)

    def hook(mod, incompatible_keys) -> None:
        nonlocal old
        for sub, attr, spec in entries:
            p = sub._parameters.get(attr)
            if isinstance(p, DTensor) and not isinstance(p._local_tensor, QuantizedWeight):
                p._local_tensor = QuantizedWeight(p._local_tensor, spec)  # type: ignore[attr-defined]
        new = _managed(module)
        gone = {id(p) for p in old}
        comm.params = [p for p in comm.params if id(p) not in gone] + new
        old = new

    return hook


def _managed(module: torch.nn.Module) -> List[torch.Tensor]:
    """The parameters ``fully_shard(module)`` manages: its own and its submodules', nested
    FSDPModules left out, each once (in module order)."""
    from torch.distributed.fsdp import FSDPModule

    out: List[torch.Tensor] = []
    seen: set = set()

    def visit(m: torch.nn.Module) -> None:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        for c in m.children():
            if not isinstance(c, FSDPModule):
                visit(c)

    visit(module)
    return out


def apply(model: torch.nn.Module, owner: Any, weights: Any, *, keep_fp32: Any = None) -> Weights:
    """Quantize the weight all-gathers of every ``FSDPModule`` in ``model`` with ``weights`` (see the
    module docstring); bytes are counted in ``owner.counters``. Called by :func:`flatcomm.fsdp.apply`."""
    from torch.distributed.fsdp import FSDPModule

    from .._training import adapt

    codec = weight_codec(weights)
    keep = adapt.keep_predicate(keep_fp32)
    names = {id(p): n for n, p in model.named_parameters()}
    mods: List[Tuple[str, Any]] = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    for name, m in mods:  # every check before anything changes
        why = _private.fsdp2_weight_problem(m)
        if why is not None:
            raise ValueError(f"flatcomm: weights=: module {name or '<root>'}: {why}")
        for p in _managed(m):
            n = names.get(id(p))
            if isinstance(getattr(p, "_local_tensor", None), QuantizedWeight):
                raise ValueError(f"flatcomm: weights=: parameter {n!r} is quantized already (apply weights= once)")
            if n is not None and not (keep is not None and keep(n, p)):
                _spec_for(n, p, codec)
    out = Weights(codec, [], [], {}, {})
    comms: Dict[int, WeightAllGather] = {}  # one per FSDP state (fully_shard([a, b]) shares one)
    for name, m in mods:
        entries, kept = _wrap_module(m, names, codec, keep)
        _private.fsdp2_init_extensions(m)  # what FSDP's lazy init does: not only the first forward's
        out.quantized += [e[2].name for e in entries]
        out.kept += kept
        state = id(_private.fsdp2_state(m))
        comm = comms.get(state)
        if comm is None:
            comm = comms[state] = WeightAllGather(owner, [], 0, None)
            m.set_custom_all_gather(comm)  # type: ignore[arg-type]
        comm.params += _managed(m)
        comm.specs += [e[2] for e in entries]
        comm.fingerprint = _fingerprint(comm.specs)
        node = _private.fsdp2_post_forward_group(m) if entries else None
        if node is not None:  # (None once set below: the second module of a shared state keeps it)
            m.set_reshard_after_forward(True, recurse=False)  # FSDP's own would reshard the payload
            comm.node = node
        if comm.node is not None:
            out.hpz[name] = comm.node[1]
        out.comms[name] = comm
        m.register_load_state_dict_post_hook(_rewrap_hook(m, entries, comm))
    return out
