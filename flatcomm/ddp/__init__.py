"""DistributedDataParallel communication hook built on :func:`flatcomm.collectives.all_reduce`.

Usage::

    ddp = DistributedDataParallel(model)
    state = flatcomm.ddp.register(ddp, "int8")          # or: ddp.register_comm_hook(State("int8"), hook)
    ...
    ckpt["flatcomm"] = state.state_dict()        # this rank's state, no communication (any rank)
    state.load_state_dict(ckpt["flatcomm"])      # same rank, same world size: continues bit for bit
    total = state.resharded_state_dict()         # a collective: loads at any world size

The hook averages like DDP's default hook (``op="avg"``): every rank ends with the same bits.

**Process group.** flatcomm's traffic runs on its private copy of the DDP group (or of ``group=``),
:func:`flatcomm.collectives.private_group`, created at the first hook call (DDP calls the hook in
the same order on every rank, so this is safe) with that group's timeout. Keeping it off DDP's own
group means DDP's collectives (the unused-parameter bitmap, the bucket rebuild broadcast) never
interleave with flatcomm's in a different order on different ranks.

**Ordering.** The hook calls ``all_reduce(bucket.buffer(), ..., async_op=True)`` and returns
``handle.get_future()`` (its value is the bucket buffer, averaged in place). flatcomm runs every
collective of a group on that group's single worker thread in submission order, so all ranks issue
them in the same order; backward computation overlaps communication, and nothing blocks inside a
future callback (the statistics callback only reads norms). Every call's small header (numel,
codec, dtype, ...) is checked on every rank; ``validate=False`` after a bucket layout's first call
only skips that check where it would cost a host sync (NCCL-only groups).

**Error feedback, keyed by parameter.** DDP rebuilds its buckets after the first iteration (and may
differ with ``static_graph``, ``gradient_as_bucket_view`` or unused parameters), so residuals are
not keyed by bucket index: each distinct bucket owns one flat
:class:`~flatcomm.ErrorFeedback` (client + server residual, fp32), assembled once from
its parameters' residuals wherever they lived before (:mod:`flatcomm.ddp.residuals`, on the store
shared with :mod:`flatcomm.fsdp`). The server residual is folded into the client one when a
parameter moves: ``client += server / scale`` (the total that the next step adds is unchanged).

**Where the code lives.** ``state`` holds :class:`State`, :func:`hook` and :func:`register`;
``buckets`` the per-bucket machinery (residuals, decisions, replay, layouts), ``traffic`` the
hook's communication, ``residuals`` the per-bucket error feedback, ``stats`` the
statistics, ``checkpoint`` the state dicts, ``accordion`` the Accordion policy, ``tiers`` the
two-level residuals; the options, exceptions and backoff are shared with FSDP
(``flatcomm._training``).

**What a residual is worth.** With ``scale = 1/W`` (averaging over W ranks) the next step effectively
adds ``T = scale * sum_r client_r + server_owner`` to the averaged gradient, where ``server_owner``
is the server residual of the rank that reduces that shard (other ranks hold zeros there, so it is
``sum_r server_r``). :meth:`State.resharded_state_dict` computes ``T`` per parameter (a SUM
all-reduce of ``scale * client_r + server_r``, flatcomm's ordered fp32 sum, so it is deterministic;
:func:`reshard` gives the same bits from every rank's :meth:`State.state_dict` without
communication); loading it at any world size W' sets ``client = T / (scale' * W') = T`` on every
rank and ``server = 0``, so the next step adds ``scale' * W' * T = T`` again.

**Checkpoints.** :meth:`State.state_dict` is this rank's own state (client and server residual per
parameter, the bucket layout, ``auto`` decisions, the GradScaler scale last seen): no communication.
Loaded on the same rank at the same world size, the run continues bit for bit: DDP's first
iteration after a restart puts every parameter in one bucket, so that step reduces each saved
bucket's values as they were laid out (a copy) and DDP's rebuilt buckets then match the saved ones.
Every load checks keys, shapes, dtype, finiteness, codec and world size, naming the parameter.

**AMP / GradScaler.** A non-finite value in any rank's bucket makes the codec send that block as NaN,
so the averaged gradient is non-finite on every rank (GradScaler skips the step), and the block keeps
its previous residual (residuals stay finite). Finite blocks of the skipped step are lost with the
step, as they are without compression. Residuals are in the units of the scaled gradient: pass
``grad_scaler=`` and the hook multiplies them by new_scale / old_scale when the scale changes.
"""
from __future__ import annotations

from .._training.adapt import Backoff
from .accordion import Accordion
from .checkpoint import STATE_DICT_VERSION, reshard
from .state import CODEC_DEFAULTS, State, hook, register

__all__ = ["Accordion", "Backoff", "CODEC_DEFAULTS", "STATE_DICT_VERSION", "State", "hook", "register", "reshard"]
