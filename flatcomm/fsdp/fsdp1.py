"""FSDP1 comm hook built on flatcomm (the shared backend: :mod:`flatcomm.fsdp.backend`)::

    fsdp = FullyShardedDataParallel(model, ...)
    state = flatcomm.fsdp.fsdp1.FSDP1State("int8", model=fsdp)      # also flatcomm.fsdp.FSDP1State
    fsdp.register_comm_hook(state, flatcomm.fsdp.fsdp1.fsdp1_hook)

Sharded strategies reduce-scatter, NO_SHARD all-reduces (client + server residuals); hooks average
(FSDP1 divides only on its default path). Residuals are keyed by FSDP unit (module name when
``model`` is given, else the order in which units first reduce); dtypes, ops, ``keep_fp32``,
``auto`` and checkpoints as in :mod:`flatcomm.fsdp`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import frames as _private
from .._training import checks as check
from .. import collectives as C
from . import adapt as _fadapt
from .backend import Backend, group_sig, reduce, wire_codec
from ..ops.codecs import Codec, resolve

__all__ = ["FSDP1State", "fsdp1_hook"]

_FSDP1_WRAPPER = "_fsdp_wrapped_module."


class FSDP1State(Backend):
    """State for ``FullyShardedDataParallel.register_comm_hook(state, fsdp1_hook)``.

    The hook averages over the FSDP process group (sharded strategies: reduce-scatter; NO_SHARD:
    all-reduce with client + server residuals). ``model`` (the FSDP root) names the units in the
    state dict; without it units are named by the order they first reduce (deterministic for a
    given model). ``group`` overrides the group (default: the unit's FSDP process group).
    ``codec="auto"``, ``tuner=`` and ``backoff=``: as for :class:`ReduceScatter` (all-reduce sizes
    for NO_SHARD). ``keep_fp32=`` (needs ``model``): as for :class:`ReduceScatter`, per parameter
    inside each unit (the predicate's ``param`` is a meta tensor of the parameter's original shape:
    FSDP1 flattens parameters); see :mod:`flatcomm.fsdp.adapt`.
    """

    def __init__(self, codec: Any = "fp32", *, error_feedback: bool = True, mode: str = "ordered",
                 chunks: Optional[int] = None, block_size: Optional[int] = None,
                 ratio: Optional[float] = None, model: Optional[torch.nn.Module] = None, group=None,
                 tuner=None, start_step: int = 0, backoff: Any = None, keep_fp32: Any = None):
        if keep_fp32 is not None and model is None:
            raise ValueError("flatcomm: FSDP1State(keep_fp32=...) needs model= (the FSDP root) to name "
                             "the parameters inside each unit")
        super().__init__(codec, error_feedback=error_feedback, mode=mode, chunks=chunks,
                         block_size=block_size, ratio=ratio, tuner=tuner, start_step=start_step,
                         backoff=backoff, keep_fp32=keep_fp32)
        self.group = group
        self._unit_names: Dict[int, str] = {}
        self._ef: Dict[str, C.ErrorFeedback] = {}  # NO_SHARD residuals
        self._flat_of: Dict[str, Any] = {}  # unit name -> its flat parameter (keep_fp32)
        self._masks: Dict[Tuple[str, int], Optional[torch.Tensor]] = {}  # keep_fp32 per unit, or None
        self._rows: Dict[Tuple[str, int], Any] = {}  # keep_fp32: fsdp_adapt.rows per sharded unit
        if model is not None:
            named = list(model.named_parameters())
            self._param_names = {id(p): n for n, p in named}
            self._params.update(named)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            for name, m in model.named_modules():
                flat = _private.fsdp1_flat_param(m) if isinstance(m, FSDP) else None
                if flat is not None:
                    self._unit_names[id(flat)] = name or "<root>"

    def _unit(self, numel: int) -> Tuple[str, Any]:
        """(unit name, FSDP's process group) of the hook call in progress (FSDP1 passes only the
        gradient: read from its frame, see :mod:`flatcomm.fsdp.frames`), else a size key."""
        unit = _private.fsdp1_unit()
        if unit is None:
            return f"flat{numel}", None
        key = id(unit[0])
        if key not in self._unit_names:
            self._unit_names[key] = f"unit{len(self._unit_names)}"
        self._flat_of[self._unit_names[key]] = unit[0]
        return self._unit_names[key], unit[1]

    def _kept_mask(self, name: str, numel: int) -> Optional[torch.Tensor]:
        """keep_fp32: which values of the unit's (padded) flat gradient belong to kept parameters
        (None: none do, or the layout is unknown); computed once per unit."""
        if self._keep_fn is None:
            return None
        if (name, numel) not in self._masks:
            ranges = _private.fsdp1_param_ranges(self._flat_of[name]) if name in self._flat_of else None
            # names as the model lists them (FSDP1 wraps modules in "_fsdp_wrapped_module")
            prefix = "" if name == "<root>" else (name + ".").replace(_FSDP1_WRAPPER, "")
            mask = torch.zeros(numel, dtype=torch.bool)
            for param, fqn, off, n, shape in ranges or []:
                pname = self._param_names.get(id(param)) if param is not None else None
                pname = pname or prefix + fqn.replace(_FSDP1_WRAPPER, "")
                # FSDP1 flattens parameters (even use_orig_params ones are 1-D shard views): the
                # predicate gets a meta tensor of the original shape
                if self._keep_fn(pname, torch.empty(shape, device="meta")):
                    mask[off:off + n] = True
            self._masks[(name, numel)] = mask if bool(mask.any()) else None
        return self._masks[(name, numel)]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        sd = super().state_dict()
        if self.error_feedback:
            p = self._prefix()
            for name, ef in self._ef.items():
                sd[f"{p}{name}.client"] = ef.client.clone()
                sd[f"{p}{name}.server"] = ef.server.clone()
        return sd

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self._check_ranks(state_dict)
        apply_step, state_dict = self._take_step(state_dict)
        apply_decisions, state_dict = self._take_decisions(state_dict)
        if not self.error_feedback:
            self._refuse_residuals(state_dict)
            apply_step()
            apply_decisions()
            return
        p = self._prefix()
        ef = {}
        rest = {}
        for k, v in state_dict.items():
            if k.startswith(p) and k.endswith(".client") and k[:-7] + ".server" in state_dict:
                name = k[len(p):-7]
                c = check.residual(name, v, (getattr(v, "numel", lambda: 0)(),), "client residual")
                sv = state_dict[k[:-7] + ".server"]
                ef[name] = C.ErrorFeedback(c.clone(), check.residual(name, sv, c.shape, "server residual").clone())
            elif not (k.startswith(p) and k.endswith(".server")):
                rest[k] = v
        self._res.load_state_dict(rest, p)  # checks everything before it changes anything
        self._ef = ef
        apply_step()
        apply_decisions()

    def communicate(self, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        """What :func:`fsdp1_hook` does: reduce-scatter ``grad`` into ``output`` (sharded strategies)
        or average it in place (NO_SHARD)."""
        name, fsdp_group = self._unit(grad.numel())
        group = self.group if self.group is not None else fsdp_group
        world = dist.get_world_size(group)
        warming = self._warming(name)
        kind = "all_reduce" if output is None else "reduce_scatter"
        codec = self._codec_for(grad.numel(), group, grad.device, kind)
        codec = resolve("fp32") if warming else codec
        mask = self._kept_mask(name, grad.numel())
        if output is None:
            self._all_reduce(grad, name, codec, group, world, mask)
        elif mask is None:
            self._send(output, grad, [(name, grad.numel() // world)], codec, "avg", group, async_op=False, world=world,
                       key_numel=grad.numel())
        else:
            self._reduce_scatter_kept(output, grad, name, codec, group, world, mask)
        return None

    def _all_reduce(self, grad: torch.Tensor, name: str, codec: Codec, group, world: int,
                    mask: Optional[torch.Tensor]) -> None:
        """NO_SHARD: the whole gradient averaged in place, with client + server residuals per unit;
        with keep_fp32, the codec's values and the kept ones as two all-reduces."""
        ef = None
        if self.error_feedback and (not codec.lossless or name in self._ef or mask is not None):
            ef = self._ef.get(name)
            if ef is not None and ef.client.numel() != grad.numel():
                raise ValueError(f"flatcomm: the residual of FSDP unit {name!r} has {ef.client.numel()} values "
                                 f"but its gradient {grad.numel()} (a checkpoint of another model or world size)")
            if ef is None:
                ef = self._ef[name] = C.ErrorFeedback.zeros(grad.numel(), grad.device)
            elif ef.client.device != grad.device:  # loaded on the CPU
                ef = self._ef[name] = C.ErrorFeedback(ef.client.to(grad.device), ef.server.to(grad.device))
            if codec.lossless or mask is not None:
                # fp32 (auto's choice) sends client + server once; a split changes the shard layout the
                # server residual is valid for: either way it is folded into the client one first
                ef.client.add_(ef.server, alpha=float(world))
                ef.server.zero_()
        flat = grad if grad.is_contiguous() else grad.contiguous()
        if mask is None:
            self._send_all(flat, ef, codec, group)
        else:
            mask = mask.to(flat.device)
            for sel, c in ((~mask, codec), (mask, resolve("fp32"))):
                part = flat.view(-1)[sel]
                res = C.ErrorFeedback(ef.client[sel], ef.server[sel]) if ef is not None else None
                self._send_all(part, res, c, group)
                flat.view(-1)[sel] = part
                if ef is not None and res is not None:
                    ef.client[sel] = res.client
                    ef.server[sel] = res.server
        if flat is not grad:
            grad.copy_(flat)

    def _send_all(self, flat: torch.Tensor, ef: Optional[C.ErrorFeedback], codec: Codec, group) -> None:
        measured = self._measured(codec, flat.numel(), "all_reduce", flat, ef.client if ef is not None else None)
        C.all_reduce(flat, codec=wire_codec(codec, flat.dtype), op="avg", mode=self.mode,
                     group=group, residual=ef, chunks=self.chunks, stats=self.counters,
                     validate=self._first_call("ar", group_sig(group), flat.numel(), flat.dtype, codec.name))
        if measured is not None:
            measured(None)

    def _reduce_scatter_kept(self, output: torch.Tensor, grad: torch.Tensor, name: str, codec: Codec, group,
                             world: int, mask: torch.Tensor) -> None:
        """A sharded unit holding keep_fp32 parameters: each rank's chunk splits into its codec values
        and its kept ones (counts differ per rank: rows padded with zeros, :func:`flatcomm.fsdp.adapt.rows`),
        sent as two reduce-scatters; the unit's residual keeps its full layout (kept values: zero)."""
        if (name, world) not in self._rows:
            self._rows[(name, world)] = _fadapt.rows(mask, world)
        ik, ir, kept_counts = self._rows[(name, world)]
        numel, shard = grad.numel(), grad.numel() // world
        flat = grad.reshape(-1)
        res = None
        if self.error_feedback:
            res = self._res.get([(name, shard)], world, grad.device)
        me = dist.get_rank(group)
        mine = mask.view(world, shard)[me].to(output.device)
        for idx, c, kept in ((ir, codec, False), (ik, resolve("fp32"), True)):
            x = _fadapt.gather(flat, idx)
            r = _fadapt.gather(res, idx) if res is not None else None
            out = torch.empty(idx.shape[1], dtype=output.dtype, device=output.device)
            measured = self._measured(c, numel, "reduce_scatter", x, r)
            reduce(out, x, codec=c, op="avg", mode=self.mode, group=group, async_op=False, residual=r,
                    chunks=self.chunks, stats=self.counters, first_call=self._first_call)
            if measured is not None:
                measured(None)
            if res is not None and r is not None:
                _fadapt.scatter(res, idx, r)
            output[mine if kept else ~mine] = out[:kept_counts[me] if kept else shard - kept_counts[me]]


def fsdp1_hook(state: FSDP1State, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """FSDP1 comm hook: ``hook(state, padded_unsharded_grad, new_sharded_grad)`` for sharded
    strategies (reduce-scatter into ``output``), ``hook(state, grad)`` for NO_SHARD (in place)."""
    state.communicate(grad, output)
