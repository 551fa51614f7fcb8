"""Every private attribute of torch's FSDP that flatcomm reads, in one place.

FSDP2's public surface, ``FSDPModule.set_custom_reduce_scatter``, hands a reduce-scatter its
tensors but not the parameters they hold. :mod:`flatcomm.fsdp` derives each module's layout from
public information (the sharded parameters are DTensors whose placements give the shard sizes;
:func:`flatcomm.fsdp.apply` binds one comm per module). Only three cases need FSDP's internals:

* FSDP2, a step where only some of a module's parameters received a gradient, or a
  ``ReduceScatter`` set by hand on a module: the parameters of this call are the ``fsdp_params``
  argument of ``foreach_reduce``, read from the caller's frame (:func:`reduce_call_params`), each
  an ``FSDPParam`` with ``sharded_param``, ``_param_fqn`` and ``padded_sharded_param_size``.
* FSDP1 comm hooks receive only the gradient: the unit is the ``handle`` local (a
  ``FlatParamHandle``, its ``flat_param``) of the frame that calls the hook, the process group its
  ``state`` local (:func:`fsdp1_unit`); ``module._handle`` names units at construction.
* FSDP1 ``keep_fp32=``: where each parameter lies in its unit's flat parameter
  (:func:`fsdp1_param_ranges`: ``_numels_with_padding``, ``_is_padding_mask``, ``_fqns``,
  ``_shapes`` and, with ``use_orig_params``, ``_params``).
* Tests compare the public layout with FSDP's own (:func:`fsdp2_param_groups`).
* FSDP2 quantized weights (:mod:`flatcomm.fsdp.weights`): whether a module can still take
  all-gather hooks (:func:`fsdp2_weight_problem`: ``FSDPParam._unsharded_param``,
  ``all_gather_outputs``, ``offload_to_cpu``, ``is_dtensor``); the hooks themselves are FSDP's
  public extension, looked for by ``FSDPParam._init_extensions`` at init and lazy init, which
  :func:`fsdp2_init_extensions` calls once more after wrapping; and the
  ``k``-rank group of ``reshard_after_forward=k`` (:func:`fsdp2_post_forward_group`:
  ``post_forward_mesh_info`` / ``mesh_info`` with ``shard_mesh_size``, ``shard_process_group``).

:func:`check` lists what the installed torch no longer has; ``tests/test_fsdp_private.py`` runs it
and fails loudly, where flatcomm itself would quietly key residuals by size instead.
"""
from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["check", "fsdp1_flat_param", "fsdp1_param_ranges", "fsdp1_unit", "fsdp2_param_groups",
           "fsdp2_init_extensions", "fsdp2_post_forward_group", "fsdp2_state", "fsdp2_weight_problem", "param_piece",
           "reduce_call_params"]
_FLAT_PARAM_FIELDS = ("_numels_with_padding", "_is_padding_mask", "_fqns", "_shapes", "_params")

# How far up the stack the caller of a comm / hook may be: FSDP calls it directly, flatcomm adds
# two or three frames of its own between the entry point and this module.
_DEPTH = 6
FOREACH_REDUCE = "foreach_reduce"  # FSDP2: torch.distributed.fsdp._fully_shard._fsdp_collectives
FSDP1_HOOK_CALLERS = ("_reduce_grad", "_reduce_grad_no_shard")  # FSDP1: torch.distributed.fsdp._runtime_utils


def _frames(skip: int) -> Iterator[FrameType]:
    frame: Optional[FrameType] = sys._getframe(skip + 1)
    for _ in range(_DEPTH):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def reduce_call_params(skip: int = 1) -> Optional[Sequence[Any]]:
    """FSDP2: the ``FSDPParam`` list of the ``foreach_reduce`` call above us (``skip`` frames of
    the caller's own not counted), or None outside one."""
    for frame in _frames(skip):
        if frame.f_code.co_name == FOREACH_REDUCE:
            return frame.f_locals.get("fsdp_params")
    return None


def param_piece(fp: Any) -> Tuple[Optional[torch.Tensor], Optional[str], Optional[int]]:
    """FSDP2: (sharded parameter, root-relative name, values per rank) of one ``FSDPParam``."""
    size = getattr(fp, "padded_sharded_param_size", None)
    numel = None if size is None else int(torch.Size(size).numel())
    return getattr(fp, "sharded_param", None), getattr(fp, "_param_fqn", None), numel


def fsdp2_param_groups(module: torch.nn.Module) -> List[List[Any]]:
    """FSDP2: the ``FSDPParam`` lists of a module's parameter groups, in FSDP's order."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined,operator]
    return [list(pg.fsdp_params) for pg in state._fsdp_param_groups]


def fsdp1_unit(skip: int = 1) -> Optional[Tuple[torch.Tensor, Any]]:
    """FSDP1: (the unit's flat parameter, its process group) of the hook call above us, or None."""
    for frame in _frames(skip):
        handle = frame.f_locals.get("handle")
        if handle is not None and hasattr(handle, "flat_param"):
            st = frame.f_locals.get("state")
            return handle.flat_param, getattr(st, "process_group", None)
    return None


def fsdp1_flat_param(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """FSDP1: a unit's flat parameter (None for a unit without parameters)."""
    handle = getattr(module, "_handle", None)
    return None if handle is None else handle.flat_param


def fsdp1_param_ranges(flat_param: Any) -> Optional[List[Tuple[Optional[torch.Tensor], str, int, int, torch.Size]]]:
    """FSDP1: (original parameter or None, unit-relative name, offset, numel, shape) of each
    parameter in the unsharded flat parameter (alignment padding skipped), or None if unknown."""
    try:
        numels, padding = flat_param._numels_with_padding, flat_param._is_padding_mask
        fqns, shapes = flat_param._fqns, flat_param._shapes
    except AttributeError:
        return None
    params = getattr(flat_param, "_params", None) or [None] * len(fqns)  # use_orig_params only
    out, off, i = [], 0, 0
    for n, is_pad in zip(numels, padding):
        if not is_pad:
            out.append((params[i], fqns[i], off, int(n), shapes[i]))
            i += 1
        off += int(n)
    return out


def _names_used(cls: type) -> set:
    """Attribute and local names the methods of ``cls`` use (from their code objects)."""
    used: set = set()
    for v in vars(cls).values():
        code = getattr(getattr(v, "fget", v), "__code__", None)
        if code is not None:
            used |= set(code.co_names) | set(code.co_varnames)
    return used


def check() -> List[str]:
    """What of the above the installed torch lacks (empty when all is there)."""
    problems: List[str] = []
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as e:
        return [f"FSDP2 internals moved: {e}"]
    fn = getattr(coll, FOREACH_REDUCE, None)
    fn = inspect.unwrap(fn) if fn is not None else None  # it is wrapped in torch.no_grad()
    if fn is None:
        problems.append(f"_fsdp_collectives.{FOREACH_REDUCE} is gone")
    elif fn.__code__.co_name != FOREACH_REDUCE or fn.__code__.co_varnames[:1] != ("fsdp_params",):
        problems.append(f"{FOREACH_REDUCE}'s first argument is {fn.__code__.co_varnames[:1]}, not fsdp_params")
    fields = _names_used(FSDPParam)
    problems += [f"FSDPParam no longer sets {a}" for a in ("sharded_param", "_param_fqn", "padded_sharded_param_size")
                 if a not in fields]
    if "_fsdp_param_groups" not in _names_used(FSDPState):
        problems.append("FSDPState has no _fsdp_param_groups")
    problems += _check_weights(FSDPParam)
    try:
        from torch.distributed.fsdp import _runtime_utils as rt
        from torch.distributed.fsdp._flat_param import FlatParamHandle
    except ImportError as e:
        return problems + [f"FSDP1 internals moved: {e}"]
    for name in FSDP1_HOOK_CALLERS:
        f = getattr(rt, name, None)
        if f is None:
            problems.append(f"FSDP1 _runtime_utils.{name} is gone")
        elif not {"handle", "state"} <= set(f.__code__.co_varnames):
            problems.append(f"FSDP1 _runtime_utils.{name} has no 'handle'/'state' locals")
    if "flat_param" not in _names_used(FlatParamHandle):
        problems.append("FSDP1 FlatParamHandle has no flat_param")
    from torch.distributed.fsdp._flat_param import FlatParameter

    fields = set(getattr(FlatParameter, "__annotations__", {})) | _names_used(FlatParameter)
    problems += [f"FSDP1 FlatParameter no longer has {a}" for a in _FLAT_PARAM_FIELDS if a not in fields]
    return problems


# ---- FSDP2 weight all-gathers (flatcomm.fsdp.weights) ----------------------------------------------


def _check_weights(fsdp_param_cls: type) -> List[str]:
    """What :func:`fsdp2_weight_problem` and :func:`fsdp2_post_forward_group` read that torch lacks."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    problems = [f"FSDPParam no longer has {a}" for a in ("_unsharded_param", "all_gather_outputs", "offload_to_cpu",
                                                          "is_dtensor", "_init_extensions")
                if a not in _names_used(fsdp_param_cls) and not hasattr(fsdp_param_cls, a)]
    group_names = _names_used(FSDPParamGroup)
    problems += [f"FSDPParamGroup no longer uses {a}" for a in ("post_forward_mesh_info", "mesh_info", "_init_extensions")
                 if a not in group_names]
    mesh_names = _names_used(FSDPMeshInfo)
    problems += [f"FSDPMeshInfo no longer sets {a}" for a in ("shard_mesh_size", "shard_process_group")
                 if a not in mesh_names]
    return problems


def fsdp2_weight_problem(module: torch.nn.Module) -> Optional[str]:
    """FSDP2: why ``module``'s weight gathers cannot be quantized (None: they can). The hooks are
    picked up by FSDP's lazy init and its gather buffers are sized on the first gather; CPU
    offload moves the local tensor (a plain copy) before the hook would run."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined,operator]
    groups = list(state._fsdp_param_groups)
    if len(groups) > 1:
        return "several parameter groups (shard_placement_fn meshes): one all-gather comm per module"
    for fp in (fp for pg in groups for fp in pg.fsdp_params):
        if hasattr(fp, "_unsharded_param") or getattr(fp, "all_gather_outputs", None):
            return "it has gathered its parameters already: call flatcomm.fsdp.apply before the first forward"
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload (OffloadPolicy) is not supported with quantized weights"
        if getattr(fp, "is_dtensor", False):
            return "DTensor parameters (tensor parallel) are not supported with quantized weights"
    return None


def fsdp2_state(module: torch.nn.Module) -> Any:
    """FSDP2: the module's FSDP state (shared by the modules of one ``fully_shard([a, b])``)."""
    return module._get_fsdp_state()  # type: ignore[attr-defined,operator]


def fsdp2_init_extensions(module: torch.nn.Module) -> None:
    """FSDP2: look for all-gather hooks on the local tensors again, as FSDP's lazy init does."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined,operator]
    for pg in state._fsdp_param_groups:
        for fp in pg.fsdp_params:
            fp._init_extensions()


def fsdp2_post_forward_group(module: torch.nn.Module) -> Optional[Tuple[Any, int]]:
    """FSDP2: (process group, k) of ``fully_shard(reshard_after_forward=k)`` (k smaller than the
    shard group), or None: the ``k``-rank group the backward all-gather would run in."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined,operator]
    for pg in state._fsdp_param_groups:
        post, mesh = pg.post_forward_mesh_info, pg.mesh_info
        if post is not None and post is not mesh and post.shard_mesh_size < mesh.shard_mesh_size:
            return post.shard_process_group, int(post.shard_mesh_size)
    return None
