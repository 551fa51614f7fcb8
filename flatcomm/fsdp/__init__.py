"""FSDP reduce backends built on :func:`flatcomm.collectives.reduce_scatter`: FSDP2 (``fsdp2``),
FSDP1 (``fsdp1``), HSDP and two-level FSDP (``hybrid``), on a shared backend (``backend``).

FSDP2 (``fully_shard``)::

    model = ...; fully_shard(block) for each block; fully_shard(model)
    rs = flatcomm.fsdp.apply(model, codec="int8")     # every FSDPModule (the setter is not recursive)
    ...                                               # train as usual
    rs.stats.wire_bytes                               # bytes this rank sent
    dcp.save({"model": ..., "flatcomm": rs.state_dict()}, checkpoint_id=path)

or by hand: ``module.set_custom_reduce_scatter(flatcomm.fsdp.ReduceScatter("int8"))`` on each
``FSDPModule`` (one instance may serve several modules).

FSDP1::

    fsdp = FullyShardedDataParallel(model, ...)
    state = flatcomm.fsdp.FSDP1State("int8", model=fsdp)
    fsdp.register_comm_hook(state, flatcomm.fsdp.fsdp1_hook)

**Ops.** FSDP2 passes ``AVG`` (fp32/bf16 reduce), ``SUM`` (fp16 reduce, or forced sum; FSDP then
divides before/after itself) or ``PREMUL_SUM`` carrying ``op.factor`` (a gradient divide factor other
than the world size). ``PREMUL_SUM(f)`` follows NCCL's rule, read by the one translation of torch's ops
(:func:`flatcomm.comm.args.reduce_op`) that the ``flatcomm`` torch backend uses too: each rank's input
is multiplied by ``f`` in its own dtype first, then summed; so an FSDP2 step with a divide factor
gives the same bits through ``flatcomm.fsdp.apply`` and through ``init_process_group("flatcomm")``
(an error-feedback residual then holds pre-multiplied values: keep the factor fixed). FSDP1 hooks average (FSDP1 divides only on its default path).

**Dtypes.** Inputs may be fp32, bf16 or fp16 (``MixedPrecisionPolicy.reduce_dtype``); sums run in
fp32 and the output is written in its own dtype. With the lossless ``fp32`` codec a bf16/fp16 input
is sent as bf16/fp16 (exact for such values, half the bytes).

**Error-feedback residuals, keyed by parameter name.** A residual is what this rank's encoding of its
reduce-scatter input did not send (fp32, input-sized, different on every rank). FSDP2 calls the comm
once per parameter group per backward with ``input = concat over ranks r of (concat over the group's
parameters p of chunk r of p's dim-0-padded gradient)``; the group holds only the parameters that
received a gradient this step, so the input size alone is not a stable key, and two identical layers
have equal sizes. :func:`apply` therefore sets on each module its own
:class:`ModuleReduceScatter` (:meth:`ReduceScatter.for_module`), which knows the module's parameters
in FSDP's order and, from their DTensor placements (public API), the values each holds per rank:
``c = ceil(rows / world) * (values per row)``. When every parameter got a gradient (the input
size says so) that is the call's layout; otherwise, or for a ``ReduceScatter`` set by hand, the
group is FSDP's own list (a private frame, kept in :mod:`flatcomm.fsdp.frames` with a test that
fails when torch changes it), and if even that fails, the key falls back to the input size.
``layout_sources`` counts which way each call went. Each parameter's name (from the model given to
:func:`apply`, else FSDP's root-relative ``_param_fqn``) owns its slice of ``c`` values per rank. Residuals are
kept as one flat buffer per distinct group (so encoding is one pass over one tensor); when a new
group appears (a parameter without a gradient, a different wrapping) its buffer is assembled once
from the old ones parameter by parameter (zeros for parameters never seen) and old buffers are freed
when no parameter refers to them. (The store, :class:`flatcomm._training.residual_store.Store`, is the one the DDP hook
uses.) Names are stable across steps, processes and re-wrapping (a new
``fully_shard`` of the same model), so residuals survive re-sharding at the same world size; a
different world size changes the padding and the owner of every value: loading then raises.

``state_dict()`` maps ``"rank{r}.{param name}"`` to that rank's residual for the parameter (a plain
fp32 tensor of the padded unsharded numel). Every rank saves different values, so the rank is part
of the key: DCP would otherwise de-duplicate equal keys as replicated tensors and keep only one
rank's values. When the backend knows the model (:func:`apply`), ``state_dict()`` lists every
parameter (zeros before the first step), so ``dcp.load`` can fill it in place before training.
``keep_fp32=`` and the ``auto`` backoff (``backoff=``, decisions saved as
``"rank{r}.__decisions__"``): :mod:`flatcomm.fsdp.adapt`.
FSDP1 residuals are keyed by FSDP unit (module name when ``model`` is given, else the order in which
units first reduce) and live in the same kind of dict.
"""
from __future__ import annotations

from .backend import Stats
from .fsdp1 import FSDP1State, fsdp1_hook
from .fsdp2 import ModuleReduceScatter, ReduceScatter, apply

__all__ = ["FSDP1State", "ModuleReduceScatter", "ReduceScatter", "Stats", "apply", "fsdp1_hook"]
