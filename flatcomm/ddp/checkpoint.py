"""Checkpoints of the DDP hook's :class:`flatcomm.ddp.State`: save, reshard, load, all checked.

Two forms (``STATE_DICT_VERSION`` 2). ``per_rank`` (:func:`state_dict`, no communication): this
rank's client and server residual per parameter name, the bucket layout (the first step after a
load replays it, so the run continues bit for bit), the ``auto`` decisions, the step count and the
GradScaler scale last seen. ``total`` (:func:`resharded_state_dict`, a collective, or
:func:`reshard` of every rank's per-rank dict): per parameter the total ``T`` that the next step
adds to the averaged gradient, loadable at any world size (see :mod:`flatcomm.ddp`). Every load
checks keys, shapes, dtype, finiteness, codec and world size, naming the parameter. Plain tensors,
strings and numbers (``torch.load(weights_only=True)``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .._training import checks as check
from .. import collectives as C
from ..autotune import BACKEND
from ..ops.codecs import CODECS, Codec

__all__ = ["STATE_DICT_VERSION", "check_state_dict", "load_state_dict", "reshard", "resharded_state_dict", "state_dict"]

STATE_DICT_VERSION = 2


def _params(state) -> Dict[str, torch.nn.Parameter]:
    if state.model is None:
        state.name_map()  # raises with the how-to
    mod = getattr(state.model, "module", state.model)
    return dict(mod.named_parameters())


def _world_rank(state) -> Tuple[int, int]:
    g = state.group if state.group is not None else state.ddp_group()
    return dist.get_world_size(g), dist.get_rank(g)


def _meta(state) -> dict:
    return {"codec": "auto" if state.auto else state.codec.name, "block_size": state.codec.block_size,
            "mode": state.mode, "error_feedback": state.error_feedback, "step": state.step,
            "tiered": state.tiered(),
            "scale_seen": state.scale_seen}


def state_dict(state) -> dict:
    """:meth:`flatcomm.ddp.State.state_dict`."""
    state.wait()
    if state.model is None and (state.residuals.bufs or state.decisions):
        raise ValueError(
            "flatcomm: this State holds error-feedback residuals or auto decisions of its DDP buckets but "
            "knows no model to name their parameters, so state_dict() cannot save them (they would be "
            "lost on restart). Give it the model: state.attach(ddp_model) (before or after training "
            "started), State(codec, model=ddp_model), or flatcomm.ddp.register(ddp_model, codec)")
    world, rank = _world_rank(state)
    client: Dict[str, torch.Tensor] = {}
    server: Dict[str, torch.Tensor] = {}
    buckets: List[List[str]] = []
    decisions: List[list] = []
    if state.model is not None:
        names = state.name_map()
        for n, p in _params(state).items():
            c, s = state.residuals.of(n, p)
            client[n] = c.reshape(p.shape).cpu().clone()
            server[n] = s.reshape(p.shape).cpu().clone()
        buckets = state.residuals.bucket_names(names)
        decisions = [_decision_entry([names[pid] for pid in key], d) for key, d in state.decisions.items()
                     if all(pid in names for pid in key)]
    out = {"version": STATE_DICT_VERSION, "form": "per_rank", **_meta(state), "world_size": world,
           "rank": rank, "buckets": buckets, "decisions": decisions, "client": client, "server": server}
    if state.model is not None and state.backend_sent:  # (only then: older files stay as they were)
        last = [key for key, step in state.backend_sent.items() if step == state.step - 1]
        out["backend_buckets"] = [[names[pid] for pid in key] for key in last if all(pid in names for pid in key)]
    if state.accordion is not None and state.model is not None:  # its intervals (the same on every rank)
        out["accordion"] = state.accordion.state_dict(state.name_map())
    return out


def resharded_state_dict(state) -> dict:
    """:meth:`flatcomm.ddp.State.resharded_state_dict` (a collective)."""
    state.wait()
    world, _ = _world_rank(state)
    residual: Dict[str, torch.Tensor] = {}
    if state.model is not None:
        params = _params(state)
        parts = []
        for n, p in params.items():
            c, s = state.residuals.of(n, p)
            # what this rank adds to T (see ddp_tiers for the hierarchical form)
            parts.append((c + s) * (1.0 / world) if state.tiered() else c * (1.0 / world) + s)
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if flat.numel():
            C.all_reduce(flat, codec="fp32", op="sum", mode="ordered", group=state.ensure_group())
        for (n, p), t in zip(params.items(), torch.split(flat, [p.numel() for p in params.values()])):
            residual[n] = t.reshape(p.shape).cpu().clone()
    return {"version": STATE_DICT_VERSION, "form": "total", **_meta(state), "world_size": world,
            "residual": residual}


def load_state_dict(state, sd, *, allow_codec_change: bool = False) -> None:
    """:meth:`flatcomm.ddp.State.load_state_dict`. Transactional: every field is read and checked
    first (:func:`_read`), then installed by steps that cannot fail, so a load that raises leaves
    the State exactly as it was."""
    if isinstance(sd, (list, tuple)):
        sd = reshard(sd)
    state.wait()
    loaded = _read(state, sd, allow_codec_change)
    if state.accordion is not None and sd.get("accordion") is not None:
        state.accordion.load_state_dict(sd["accordion"], loaded.params)  # checks all, then replaces its tracks
    _restore(state, loaded.params, loaded.client, loaded.server, loaded.buckets, loaded.world, loaded.tiered)
    if loaded.decisions is not None and loaded.backend_buckets:  # replayed as sent (see State.backend_sent)
        keys = [tuple(id(loaded.params[n]) for n in names) for names in loaded.backend_buckets]
        state.buckets.restore_backend(keys, loaded.step - 1)
    if loaded.decisions is not None:
        state.buckets.restore_decisions(loaded.decisions)
    state.step = loaded.step
    state.scale_seen = loaded.scale_seen


@dataclasses.dataclass
class _Loaded:
    params: Dict[str, torch.nn.Parameter]
    client: Dict[str, torch.Tensor]
    server: Dict[str, torch.Tensor]
    buckets: List[List[str]]
    world: int
    tiered: bool
    step: int
    scale_seen: Optional[float]
    decisions: Optional[dict]
    backend_buckets: List[List[str]] = dataclasses.field(default_factory=list)


def check_state_dict(state, sd, *, rank: int, allow_codec_change: bool = False) -> None:
    """Every check :meth:`State.load_state_dict` makes of ``sd``, as if this were rank ``rank``
    (the DDP model is the same on every rank), changing nothing: a loader holding every rank's
    dict checks them all before any rank loads its own (:mod:`flatcomm.rank_states`)."""
    _read(state, sd, allow_codec_change, rank)


def _read(state, sd, allow_codec_change: bool, as_rank: Optional[int] = None) -> _Loaded:
    """Everything a load installs, read from ``sd`` and checked; changes nothing."""
    version = _count(sd, "version")
    if version != STATE_DICT_VERSION:
        raise ValueError(f"flatcomm: DDP state version {version} is not supported (this flatcomm "
                         f"reads version {STATE_DICT_VERSION})")
    form = check.field(sd, "form", str)
    if form not in ("per_rank", "total"):
        raise ValueError(f"flatcomm: unknown DDP state form {form!r} (per_rank or total)")
    changed = _check_codec(state, sd, allow_codec_change)
    # A per-rank dict always has these; the total form may be written by hand, without them.
    if form == "per_rank" or "error_feedback" in sd:
        _flag(sd, "error_feedback")
    params = _params(state)
    world, rank = _world_rank(state)
    rank = rank if as_rank is None else as_rank
    buckets: List[List[str]] = []
    tiered = _flag(sd, "tiered") if form == "per_rank" or "tiered" in sd else False
    if form == "per_rank":
        sw, sr = _count(sd, "world_size", 1), _count(sd, "rank")
        if sw != world:
            raise ValueError(
                f"flatcomm: this DDP state was saved by rank {sr} of {sw} ranks and this run has {world}: "
                f"a per-rank state_dict() loads only at the world size it was saved at. To change the "
                f"world size, pass the list of every rank's state_dict() to load_state_dict (or save "
                f"state.resharded_state_dict(), a collective, instead)")
        if sr != rank:
            raise ValueError(f"flatcomm: this DDP state is rank {sr}'s and this is rank {rank}: each rank "
                             f"loads the state_dict() its own rank saved")
        client = _checked(state, sd, "client", params)
        server = _checked(state, sd, "server", params)
        if not client:
            _refuse_missing_residuals(state, sd)
        buckets = _buckets(check.field(sd, "buckets", list), client)
        saved_decisions = check.field(sd, "decisions", list)
        backend_buckets = _backend_buckets(sd, params, buckets)
    else:
        _count(sd, "world_size", 1)
        # every rank's client = T / (scale * W): the next step adds scale * sum_r client_r = T
        client = {n: t / (_scale_for(world) * world)
                  for n, t in _checked(state, sd, "residual", params).items()}
        server = {}
        saved_decisions, backend_buckets = [], []
    decisions: Optional[dict] = _decisions(params, saved_decisions)  # checked whether or not this State uses them
    if not (state.auto and not changed and form == "per_rank"):
        decisions = None
    elif decisions is not None and not state.backend_allowed and any(d.codec == BACKEND for d in decisions.values()):
        if not allow_codec_change:
            raise ValueError("flatcomm: this DDP state was saved by codec='auto' without a mode, which handed "
                             "buckets to the backend's own all-reduce; this State asked for determinism (mode="
                             f"{state.mode!r}) and cannot use that decision. Create the State without mode=, or "
                             "pass allow_codec_change=True to decide those buckets again")
        decisions = None
    return _Loaded(params, client, server, buckets, world, tiered, _count(sd, "step"),
                   _scale_seen(sd.get("scale_seen")), decisions, backend_buckets)


def _count(sd, name: str, lo: int = 0) -> int:
    """An int field >= ``lo`` (bools refused: ``True`` is no step count)."""
    v = check.field(sd, name, int)
    if isinstance(v, bool) or v < lo:
        raise ValueError(f"flatcomm: checkpoint field {name!r} must be an int >= {lo}, got {v!r}")
    return v


def _flag(sd, name: str) -> bool:
    return check.field(sd, name, bool)


def _scale_seen(v) -> Optional[float]:
    """The GradScaler scale last seen: None, or a finite number > 0 (a NaN, inf, zero or negative
    scale would turn every residual NaN, zero it or flip its sign at the next step)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"flatcomm: checkpoint field 'scale_seen' (the GradScaler scale) must be None or a "
                         f"finite number > 0, got {v!r}")
    return float(v)


def _buckets(saved: list, client: Mapping[str, Optional[torch.Tensor]]) -> List[List[str]]:
    """The saved bucket layout: lists of parameter names, each name once and holding residuals."""
    placed: set = set()
    out = []
    for names in saved:
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"flatcomm: checkpoint 'buckets' entry {names!r} is not a list of parameter names")
        for n in names:
            if n not in client or n in placed:
                raise ValueError(f"flatcomm: checkpoint bucket lists {n!r} "
                                 f"{'twice' if n in placed else 'without its residuals'}")
            placed.add(n)
        out.append(list(names))
    return out


def _backend_buckets(sd: dict, params, buckets: List[List[str]]) -> List[List[str]]:
    """The optional ``backend_buckets``: the last step's buckets that ``auto`` handed to the
    backend, parameter names each once, none also in a residual bucket."""
    saved = sd.get("backend_buckets", [])
    if not isinstance(saved, list):
        raise TypeError(f"flatcomm: checkpoint field 'backend_buckets' is a {type(saved).__name__}, not a list")
    out = _buckets(saved, {n: None for n in params})
    twice = {n for b in buckets for n in b} & {n for b in out for n in b}
    if twice:
        raise ValueError(f"flatcomm: checkpoint bucket lists {sorted(twice)[0]!r} twice (residual and backend buckets)")
    return out


def _refuse_missing_residuals(state, sd: dict) -> None:
    """A per-rank dict without residuals: fine from a State that had none, refused where residuals
    must have existed (or exist here), since loading it would drop them silently."""
    held = any(b.ef.client.any() or b.ef.server.any() for b in state.residuals.bufs.values())
    saved_lossy = (sd.get("error_feedback") is True and sd.get("codec") != "auto"
                   and not (sd.get("codec") in CODECS and Codec(sd["codec"]).lossless)
                   and isinstance(sd.get("step"), int) and sd["step"] > state.start_step)
    if held or saved_lossy:
        why = ("this State holds residuals that loading it would wipe" if held else
               f"it was saved after {sd['step']} steps of {sd['codec']} with error feedback, by a State "
               f"without a model (earlier flatcomm versions saved nothing then)")
        raise ValueError(f"flatcomm: this DDP state_dict() has no residuals but {why}. Load a checkpoint "
                         f"saved with the residuals (State(..., model=ddp_model) or state.attach(ddp_model) "
                         f"before saving), or start error feedback over with a new State on purpose")


def _scale_for(world: int) -> float:
    return 1.0 / world  # the hook averages


def _check_codec(state, sd: dict, allow: bool) -> bool:
    saved = (check.field(sd, "codec", str), check.field(sd, "block_size", int), check.field(sd, "mode", str))
    mine = ("auto" if state.auto else state.codec.name, state.codec.block_size, state.mode)
    if saved == mine:
        return False
    if not allow:
        raise ValueError(f"flatcomm: the DDP state was saved with codec={saved[0]!r}, block_size={saved[1]}, "
                         f"mode={saved[2]!r}; this State has codec={mine[0]!r}, block_size={mine[1]}, "
                         f"mode={mine[2]!r}. Create the State with the saved settings, or pass "
                         f"allow_codec_change=True to send the saved residuals with the new codec")
    return True


def _checked(state, sd: dict, field: str, params) -> Dict[str, torch.Tensor]:
    """sd[field] checked against the model; an empty dict (saved without error feedback) is zeros."""
    d = check.field(sd, field, dict)
    if not d:
        return {}
    check.keys(d, params, f"{field} residuals")
    out = {n: check.residual(n, d[n], params[n].shape, f"{field} residual") for n in params}
    held = [n for n, t in out.items() if t.any()]
    if held and not (state.error_feedback or (state.codec.lossless and state.mode == "ordered")):
        raise ValueError(f"flatcomm: the checkpoint holds residuals (e.g. for {held[0]!r}) but this State "
                         f"cannot send them (codec={state.codec.name!r}, error_feedback={state.error_feedback}, "
                         f"mode={state.mode!r}); they would be dropped. Use error feedback or an ordered "
                         f"fp32 State, or zero them yourself to discard them on purpose")
    return out


def _restore(state, params, client, server, buckets, world: int, tiered: bool = False) -> None:
    state.buckets.restore(params, client, server, buckets, world, tiered)


def _decision_entry(names: List[str], d) -> list:
    """``[names, codec, chunks]`` (codec: a codec name or ``"backend"``), plus the raced pair
    ``[candidate, safe]`` when a race made the decision, so that it is raced again on schedule."""
    return [names, d.codec, d.chunks] + ([list(d.raced)] if d.raced else [])


def _choice(c) -> bool:
    return isinstance(c, str) and (c in CODECS or c == BACKEND)


def _decisions(params, saved: list) -> dict:
    """The ``auto`` decisions saved by :func:`_decision_entry`, checked, keyed by parameters."""
    from ..autotune import Decision

    out = {}
    for entry in saved:
        if not (isinstance(entry, (list, tuple)) and len(entry) in (3, 4) and isinstance(entry[0], (list, tuple))):
            raise ValueError(f"flatcomm: checkpoint 'decisions' entry {entry!r} is not [names, codec, chunks]")
        names, codec, chunks = entry[:3]
        raced = entry[3] if len(entry) == 4 else ()
        if not all(isinstance(n, str) for n in names) or not _choice(codec) or isinstance(chunks, bool) \
                or not isinstance(chunks, int) or chunks < 1 \
                or not (isinstance(raced, (list, tuple)) and len(raced) in (0, 2) and all(map(_choice, raced))):
            raise ValueError(f"flatcomm: checkpoint 'decisions' entry {entry!r} is not [parameter names, "
                             f"a codec name or 'backend', chunks >= 1(, the raced pair)]")
        key = tuple(id(params[n]) for n in names if n in params)
        out[key] = Decision(codec, chunks, "restored from a checkpoint", {},
                            path=BACKEND if codec == BACKEND else "flat", raced=tuple(raced))
    return out


def reshard(states) -> dict:
    """Every rank's :meth:`State.state_dict` (one save, any order) combined into the
    world-size-independent form of :meth:`State.resharded_state_dict`, with the same bits, without
    communication: ``T = sum over ranks r, in rank order, of client_r / W + server_r``."""
    states = list(states)
    if not states or not all(isinstance(s, dict) and s.get("form") == "per_rank" for s in states):
        raise ValueError("flatcomm: reshard takes the list of every rank's state_dict() (per-rank form)")
    world = len(states)
    by_rank = {check.field(s, "rank", int): s for s in states}
    if sorted(by_rank) != list(range(world)) or any(s.get("world_size") != world for s in states):
        raise ValueError(f"flatcomm: reshard needs the state_dict() of every rank of one save: got ranks "
                         f"{sorted(s.get('rank') for s in states)} of world sizes "
                         f"{sorted({s.get('world_size') for s in states})}")
    meta = ("codec", "block_size", "mode", "step")
    for s in states:
        if any(s.get(k) != states[0].get(k) for k in meta):
            raise ValueError(f"flatcomm: reshard: the ranks' states disagree on {meta} (not one save)")
    first = by_rank[0]
    names = list(first["client"])
    residual = {}
    for n in names:
        acc = None
        for r in range(world):
            s = by_rank[r]
            if n not in s["client"] or n not in s["server"]:
                raise KeyError(f"flatcomm: reshard: rank {r}'s state has no residual for {n!r}")
            shape = getattr(first["client"][n], "shape", ())
            c = check.residual(n, s["client"][n], shape, f"rank {r} client residual")
            srv = check.residual(n, s["server"][n], c.shape, f"rank {r} server residual")
            v = (c + srv) * (1.0 / world) if first.get("tiered") else c * (1.0 / world) + srv
            acc = v if acc is None else acc + v
        residual[n] = acc
    out = {k: first[k] for k in ("version", "codec", "block_size", "mode", "error_feedback", "step", "scale_seen")}
    return {**out, "form": "total", "world_size": world, "residual": residual}
