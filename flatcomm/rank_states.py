"""Every rank's flatcomm state in one object, for frameworks that save custom state from rank 0 only.

flatcomm's checkpoint state is per rank: the DDP hook's error-feedback residuals
(:meth:`flatcomm.ddp.State.state_dict`) and the FSDP backends' (:meth:`flatcomm.fsdp.ReduceScatter.state_dict`)
differ on every rank. Lightning (callback state), Accelerate (``register_for_checkpointing``) and the
Hugging Face Trainer write custom state from rank 0 only, so saving ``state.state_dict()`` there
keeps rank 0's residuals and loses the others'. Here that is solved once::

    gathered = flatcomm.rank_states.gathered_state_dict(state)   # a collective: every rank calls it
    ...                                                           # rank 0 saves `gathered`
    flatcomm.rank_states.load_gathered_state_dict(state, gathered)  # every rank, after loading the file

``gathered`` is a plain dict (tensors, strings, numbers, lists: ``torch.save`` / ``torch.load(
weights_only=True)``) holding every rank's own state dict. The loader gives each rank its own part
(same world size: the run continues bit for bit) or, for the DDP hook at another world size, all of
them (:func:`flatcomm.ddp.reshard`: the residual total is kept). FSDP residuals are per shard and
load only at the world size they were saved at: another world size raises.

**Wire.** Each rank serialises its dict with ``torch.save`` (tensors moved to the CPU) and the bytes
are all-gathered (gathered to ``dst`` with ``dst=``) in two steps: a status and length per rank, then
the padded bytes. A rank whose ``state_dict()`` failed sends its error text instead, so every rank
raises the same error naming it instead of waiting for it. Received bytes are another rank's: they
are read with ``torch.load(weights_only=True)`` and checked (a dict, from that rank, of that world
size) before anything is returned. The collectives run on ``group`` (default: the world) with its
timeout; call both functions at the same point on every rank of it.

**A load that fails changes nothing, on any rank.** Every rank holds the whole container, and
:func:`load_gathered_state_dict` checks all of it before it calls the state's ``load_state_dict``:
the format, version, kind and world size, and every part (part ``r`` must be rank ``r``'s, of that
world size and kind; a DDP part also gets every check its own load makes: keys, shapes, dtype,
finiteness, codec). A corrupt part (swapped, duplicated, missing, of another save) therefore makes
every rank raise the same error, and no rank loads. The state's own ``load_state_dict`` checks
everything again before it changes anything.
"""
from __future__ import annotations

import io
import time
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from ._bytes import tensor_bytes
from .comm.header import all_gather_single
from .diloco.replicas import save_key

__all__ = ["FORMAT", "KINDS", "VERSION", "check_gathered", "gathered_state_dict", "kind_of", "load_gathered_state_dict"]

FORMAT = "flatcomm.rank_states"
KINDS = ("ddp", "fsdp", "diloco")
VERSION = 1
_OK, _FAILED = 0, 1
_MAX_BYTES = 1 << 40  # a length beyond this from a peer is garbage, not a state


def kind_of(state: Any) -> str:
    """``"ddp"`` for a :class:`flatcomm.ddp.State`, ``"fsdp"`` for the FSDP backends
    (:class:`flatcomm.fsdp.ReduceScatter`, :class:`flatcomm.fsdp.FSDP1State`), ``"diloco"`` for a
    :class:`flatcomm.diloco.DiLoCo` (its residuals and any sync in flight differ per replica) or a
    :class:`flatcomm.diloco.ReplicaState` (the same with the replica's model and inner optimizer)."""
    from . import ddp, diloco, fsdp

    if isinstance(state, ddp.State):
        return "ddp"
    if isinstance(state, (fsdp.ReduceScatter, fsdp.FSDP1State)):
        return "fsdp"
    if isinstance(state, (diloco.DiLoCo, diloco.ReplicaState)):
        return "diloco"
    raise TypeError(f"flatcomm.rank_states: expected a flatcomm.ddp.State, a flatcomm.fsdp backend, a "
                    f"flatcomm.diloco.DiLoCo or ReplicaState, got {type(state).__name__}")


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, Mapping):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _device(group) -> torch.device:
    # NCCL moves CUDA tensors only; every other backend here takes CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gathered_state_dict(state: Any, group: Optional[dist.ProcessGroup] = None, *,
                        dst: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Every rank's ``state.state_dict()``, in rank order, on every rank (or only on ``dst``, a
    rank of ``group``; the others get None). A collective on ``group`` (default: the world): call it
    on every rank at the same point. ``state``: a :class:`flatcomm.ddp.State`, a flatcomm FSDP
    backend or a :class:`flatcomm.diloco.DiLoCo` (each part then ``{"rank", "world_size", "diloco"}``).
    Returns ``{"format", "version", "kind", "world_size", "ranks": [dict of rank 0, ...]}``.
    """
    if not dist.is_initialized():
        raise RuntimeError("flatcomm.rank_states.gathered_state_dict needs an initialised process group")
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dst is not None and not 0 <= dst < world:
        raise ValueError(f"flatcomm.rank_states: dst={dst} is not a rank of this group of {world}")
    _arrive(group, world)
    try:
        kind = kind_of(state)
        buf = io.BytesIO()
        torch.save({"kind": kind, "rank": rank, "world_size": world, "state": _to_cpu(state.state_dict())}, buf)
        status, payload = _OK, buf.getvalue()
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised here
        status, payload, error = _FAILED, f"{type(e).__name__}: {e}".encode(), e
    parts = _exchange(status, payload, group, world, rank, dst)
    if status == _FAILED:
        raise error
    if parts is None:
        return None
    ranks = [_decode(r, p, world, kind) for r, p in enumerate(parts)]
    if kind == "diloco":  # its state_dict() does not name the replica: the part says whose it is
        ranks = [{"rank": r, "world_size": world, "diloco": sd} for r, sd in enumerate(ranks)]
    return {"format": FORMAT, "version": VERSION, "kind": kind, "world_size": world, "ranks": ranks}


_saves: Dict[str, int] = {}  # store key -> gathers this rank entered on that group


def _timeout(group) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - e.g. an NCCL-only group
        return dist.distributed_c10d.default_pg_timeout


def _arrive(group, world: int) -> None:
    """Wait (up to the group's timeout) until every rank of ``group`` entered this gather; else
    raise naming those that did not: a save called on one rank only (e.g. under
    ``if accelerator.is_main_process``) fails here with that said, not in gloo's send timeout."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the gather itself is the only check
        return
    ranks = dist.get_process_group_ranks(group)
    key = save_key(group, dist.get_rank())
    n = _saves.get(key, 0) + 1
    _saves[key] = n
    store.set(key, str(n))
    limit = _timeout(group)
    deadline = time.monotonic() + limit.total_seconds()
    while True:
        behind = [r for r, g in enumerate(ranks)
                  if not store.check([save_key(group, g)]) or int(store.get(save_key(group, g)).decode()) < n]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"flatcomm.rank_states: rank(s) {behind} of this group of {world} did not enter this checkpoint save "
                f"(save number {n}) within the group's timeout ({limit.total_seconds():g} s): gathering every rank's "
                f"flatcomm state is a collective, so the framework's save must be called on every rank "
                f"(Accelerate: call accelerator.save_state(...) on every rank, not under `if "
                f"accelerator.is_main_process`; it writes from the main process itself)")
        time.sleep(0.05)


def _exchange(status: int, payload: bytes, group, world: int, rank: int, dst: Optional[int]) -> Optional[List[bytes]]:
    """Every rank's (status, bytes) -> the list of bytes (None where this rank is not ``dst``);
    raises on every receiving rank when a rank failed."""
    dev = _device(group)
    head = torch.tensor([status, len(payload)], dtype=torch.int64, device=dev)
    heads = torch.empty(world * 2, dtype=torch.int64, device=dev)
    # Every rank needs the lengths (to pad), so the small header is all-gathered even with dst.
    all_gather_single(heads, head, group=group)
    heads = heads.cpu().view(world, 2)
    lengths = heads[:, 1].tolist()
    if any(n < 0 or n > _MAX_BYTES for n in lengths):
        raise ValueError(f"flatcomm.rank_states: a rank announced an impossible state size: {lengths}")
    width = max(lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    failed = [r for r in range(world) if int(heads[r, 0]) != _OK]
    if dst is None or failed:  # (every rank sees the same heads: a failure's reason goes to all)
        every = torch.empty(world * width, dtype=torch.uint8, device=dev)
        all_gather_single(every, mine, group=group)
    else:
        every_list = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)] if rank == dst else None
        dist.gather(mine, every_list, group_dst=dst, group=group)
        if rank != dst:
            return None
        every = torch.cat(every_list) if every_list else torch.empty(0, dtype=torch.uint8)
    raw = every.cpu().view(world, width) if width else torch.empty(world, 0, dtype=torch.uint8)
    parts = [tensor_bytes(raw[r, :lengths[r]]) for r in range(world)]
    if failed and status == _OK:
        reasons = "; ".join(f"rank {r}: {parts[r].decode(errors='replace')}" for r in failed)
        raise RuntimeError(f"flatcomm.rank_states: the state_dict() of rank(s) {failed} failed ({reasons})")
    return parts


def _decode(r: int, payload: bytes, world: int, kind: str) -> dict:
    try:
        obj = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - bytes from another rank: name the rank
        raise ValueError(f"flatcomm.rank_states: rank {r}'s state could not be read ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("state"), dict):
        raise ValueError(f"flatcomm.rank_states: rank {r} sent a {type(obj).__name__}, not a state")
    if (obj.get("rank"), obj.get("world_size"), obj.get("kind")) != (r, world, kind):
        raise ValueError(f"flatcomm.rank_states: rank {r}'s state says rank {obj.get('rank')!r} of "
                         f"{obj.get('world_size')!r} ({obj.get('kind')!r}); expected rank {r} of {world} ({kind!r})")
    return obj["state"]


def check_gathered(gathered: Any) -> Dict[str, Any]:
    """``gathered`` checked to be what :func:`gathered_state_dict` returns (no communication)."""
    if not isinstance(gathered, Mapping):
        raise TypeError(f"flatcomm.rank_states: a gathered state is a dict, got {type(gathered).__name__}")
    if gathered.get("format") != FORMAT:
        raise ValueError(f"flatcomm.rank_states: not a gathered flatcomm state (format {gathered.get('format')!r}, "
                         f"expected {FORMAT!r}); was it written by gathered_state_dict()?")
    if gathered.get("version") != VERSION:
        raise ValueError(f"flatcomm.rank_states: gathered state version {gathered.get('version')!r} is not "
                         f"supported (this flatcomm reads version {VERSION})")
    world, ranks = gathered.get("world_size"), gathered.get("ranks")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"flatcomm.rank_states: gathered state has world_size {world!r}")
    if not isinstance(ranks, (list, tuple)) or len(ranks) != world or not all(isinstance(s, dict) for s in ranks):
        raise ValueError(f"flatcomm.rank_states: gathered state of {world} ranks must hold {world} state dicts, "
                         f"got {type(ranks).__name__} of {len(ranks) if isinstance(ranks, (list, tuple)) else '?'}")
    if gathered.get("kind") not in KINDS:
        raise ValueError(f"flatcomm.rank_states: gathered state of unknown kind {gathered.get('kind')!r}")
    return dict(gathered)


def load_gathered_state_dict(state: Any, gathered: Any, group: Optional[dist.ProcessGroup] = None, *,
                             allow_codec_change: bool = False) -> None:
    """Load this rank's part of ``gathered`` (from :func:`gathered_state_dict`) into ``state``.

    Same world size: this rank's own dict (the run continues bit for bit). Another world size: the
    DDP hook's state is resharded from every rank's dict (:func:`flatcomm.ddp.reshard`: the total
    residual is kept, not the bits); FSDP and DiLoCo state raise (their residuals are per shard or
    replica). No communication of its own (a DiLoCo's load is a collective of its outer group: call
    this on every rank); ``group`` (default: the world) only gives this rank and the world size.
    Raises before changing anything when the container or a part does not fit.
    """
    g = check_gathered(gathered)
    kind = kind_of(state)
    if g["kind"] != kind:
        raise ValueError(f"flatcomm.rank_states: the gathered state is {g['kind']!r} state and this is a "
                         f"{kind!r} one ({type(state).__name__})")
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    ranks = list(g["ranks"])
    if g["world_size"] == world:
        part: Any = ranks[rank]
    elif kind == "ddp":
        part = ranks  # load_state_dict reshards a list of every rank's dicts
    elif kind == "fsdp":
        raise ValueError(f"flatcomm.rank_states: this FSDP state was saved by {g['world_size']} ranks and this run "
                         f"has {world}: FSDP residuals are per shard and load only at the world size they were "
                         f"saved at. Leave flatcomm's state out of the load to restart error feedback from zero")
    else:
        raise ValueError(f"flatcomm.rank_states: this DiLoCo state was saved by {g['world_size']} replicas and this "
                         f"run has {world}: its residuals are per replica and load only at the replica count "
                         f"they were saved at")
    kwargs = {"allow_codec_change": allow_codec_change} if kind == "ddp" else {}
    if kind != "ddp" and allow_codec_change:
        raise ValueError("flatcomm.rank_states: allow_codec_change applies to DDP state only")
    _check_parts(state, kind, ranks, group, same_world=g["world_size"] == world,
                 allow_codec_change=allow_codec_change)
    state.load_state_dict(part["diloco"] if kind == "diloco" else part, **kwargs)


_NAMES = {"ddp": "DDP state_dict()", "diloco": "DiLoCo"}


def _replica_of_part(state: Any, r: int, group) -> int:
    """The DiLoCo replica (rank in its outer group) that rank ``r`` of the gather's group is."""
    if group is None or not dist.is_initialized():
        return r
    outer = getattr(state, "outer", state)  # a ReplicaState holds its DiLoCo
    replicas = outer.group if outer.group is not None else dist.group.WORLD
    assert replicas is not None  # (initialised above)
    return dist.get_group_rank(replicas, dist.get_global_rank(group, r))


def _check_own_load(state: Any, kind: str, sd: dict, r: int, allow_codec_change: bool, group=None) -> None:
    """The checks part ``r``'s own load makes (the model is the same on every rank)."""
    if kind == "ddp":
        from .ddp import checkpoint

        checkpoint.check_state_dict(state, sd, rank=r, allow_codec_change=allow_codec_change)
    else:
        # a DiLoCo or a ReplicaState: part r checked as the state of the replica that rank r is
        state.check_state_dict(sd["diloco"], replica=_replica_of_part(state, r, group))


def _check_parts(state: Any, kind: str, ranks: List[dict], group, *, same_world: bool,
                 allow_codec_change: bool) -> None:
    """Every part of the container checked on every rank (each rank holds all of it), so that a
    corrupt part makes every rank raise the same error before any rank loads its own: part ``r``
    must be rank ``r``'s, of the container's world size and kind. DDP and DiLoCo parts get every
    check of their load too (the model is the same on every rank); an FSDP part's shard sizes are
    its own rank's, so its own load checks those."""
    world = len(ranks)
    for r, sd in enumerate(ranks):
        where = f"flatcomm.rank_states: the gathered state's part {r} (of {world})"
        if kind in ("ddp", "diloco"):  # parts that name their rank
            fits = sd.get("form") == "per_rank" and "client" in sd if kind == "ddp" else isinstance(sd.get("diloco"), dict)
            if not fits:
                raise ValueError(f"{where} is not a {_NAMES[kind]} part (kind): it has fields {sorted(map(str, sd))[:6]}")
            if sd.get("rank") != r or sd.get("world_size") != world:
                raise ValueError(f"{where} says it is rank {sd.get('rank')!r} of {sd.get('world_size')!r}: the "
                                 f"parts are swapped, duplicated or from another save")
            if same_world:
                try:
                    _check_own_load(state, kind, sd, r, allow_codec_change, group)
                except (ValueError, TypeError, KeyError) as e:
                    raise type(e)(f"{where}: {e}") from None
            continue
        own = f"rank{dist.get_global_rank(group, r) if group is not None else r}."
        stray = [k for k in sd if not (isinstance(k, str) and k.startswith(own))]
        if stray:
            raise ValueError(f"{where} holds {stray[0]!r}, not an FSDP entry of that rank ({own}...): the parts "
                             f"are swapped, duplicated, of another kind or from another save")
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)
               or (v.is_floating_point() and not bool(torch.isfinite(v).all()))]
        if bad:
            raise ValueError(f"{where}: entry {bad[0]!r} is not a tensor or holds inf/NaN values")
    if kind == "fsdp" and len({bool(sd) for sd in ranks}) > 1:
        empty = [r for r, sd in enumerate(ranks) if not sd]
        raise ValueError(f"flatcomm.rank_states: the gathered state's parts {empty} are empty and the others "
                         f"are not: a rank's state is missing")
