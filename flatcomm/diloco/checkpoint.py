"""Checkpoints of :class:`flatcomm.diloco.DiLoCo`: everything the next sync needs, bit for bit.

The state holds the replica it belongs to (rank in the outer group, number of replicas: another
replica's state is refused), the step counters, the configuration's fingerprint, per fragment the fp32 master,
the outer momentum and the error-feedback residuals, and a sync in flight: its all-reduce is
waited for (drained) and its result saved, to be applied at the same inner step after a resume.
Plain tensors, ints and strings (``torch.load(weights_only=True)``). The model's and the inner
optimizer's states are the caller's to save beside it.

A load is checked in full (keys, configuration, shapes, dtypes, finiteness, the schedule of the
sync in flight) on every replica, the replicas agree (:func:`flatcomm.diloco.replicas.agree`:
same step and same masters everywhere), and only then is anything changed: a load that fails on
any replica changes nothing on any replica.
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .._training import checks as check
from . import auto, replicas, sync

__all__ = ["STATE_DICT_VERSION", "check_state_dict", "load_state_dict", "state_dict"]

STATE_DICT_VERSION = 2  # 2: records the replica it belongs to; 1 (no replica) still loads, unchecked


def replica_of(outer) -> Dict[str, int]:
    """This replica's place: its rank in the outer group and the number of replicas."""
    rank = dist.get_rank(outer.group) if dist.is_available() and dist.is_initialized() else 0
    return {"rank": rank, "world_size": outer.config.plan.world}


def _check_replica(outer, sd: Dict[str, Any], version: int, replica: Optional[int]) -> None:
    """A replica's residuals (and, between syncs, weights) are its own: refuse another's state."""
    mine = replica_of(outer) if replica is None else {"rank": replica, "world_size": outer.config.plan.world}
    if version == 1:
        warnings.warn("flatcomm.diloco: this checkpoint (version 1) does not record the replica it belongs to; "
                      f"it is loaded as replica {mine['rank']}'s own, unchecked", UserWarning, stacklevel=4)
        return
    saved = check.field(sd, "replica", dict)
    if saved != mine:
        raise ValueError(
            f"flatcomm.diloco: this checkpoint belongs to replica {saved.get('rank')!r} of {saved.get('world_size')!r} "
            f"and this is replica {mine['rank']} of {mine['world_size']}: each replica's error-feedback residuals "
            f"are its own, so another replica's state would change the next syncs. Load each rank's own file "
            f"(name it by rank, e.g. f'diloco.rank{{rank}}.pt'), or save every replica's part in one object "
            f"with flatcomm.rank_states.gathered_state_dict(outer)")


def state_dict(outer) -> Dict[str, Any]:
    """The state of ``outer`` (a DiLoCo); drains a sync in flight (its result is kept and saved)."""
    outer.drain()
    p = outer.pending
    return {
        "version": STATE_DICT_VERSION,
        "replica": replica_of(outer),
        "config": f"{outer.config.fingerprint(with_verify=False):016x}",
        "options": outer.config.options(),
        "step": outer.step,
        "syncs": outer.syncs,
        "finished_at": outer.finished_at,
        "auto": outer.auto_choice.as_dict() if outer.auto_choice is not None else None,  # codec="auto"'s choice
        "fragments": [{"names": list(f.names), "master": f.master.detach().cpu().clone(),
                       "momentum": f.momentum.detach().cpu().clone(),
                       "residuals": [r.detach().cpu().clone() for r in f.residuals]} for f in outer.fragments],
        "in_flight": None if p is None else {
            "fragment": p.fragment, "started": p.started,
            "delta": p.wait(outer.config.plan.world).detach().cpu().clone(),
            "residuals": [r.detach().cpu().clone() for r in p.residuals]},
    }


def _tensor(t: Any, what: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flatcomm.diloco: checkpoint {what} is a {type(t).__name__}, not a tensor")
    if t.dtype != dtype:
        raise TypeError(f"flatcomm.diloco: checkpoint {what} is {t.dtype}; this run keeps it in {dtype}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"flatcomm.diloco: checkpoint {what} has shape {tuple(t.shape)}, this run needs ({n},) "
                         f"(the model, the fragments or the replicas differ from the saved run)")
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"flatcomm.diloco: checkpoint {what} holds {bad} inf/NaN values")
    return t.detach()


def _differing(saved: Any, now: Dict[str, str]) -> str:
    """Which options differ between a checkpoint and this run, for the message."""
    if not isinstance(saved, dict):  # (version 1 did not record them)
        return ("one of sync_every, fragments, fragment_sync_delay, codec, mode, outer optimizer, replicas, "
                "verify_every or the model layout differs (a version-1 checkpoint does not say which)")
    diff = [f"{k} saved {saved.get(k, '?')}, now {v}" for k, v in now.items() if saved.get(k) != v]
    return "; ".join(diff) if diff else "the options agree but the fingerprint does not (another flatcomm?)"


def _int(sd: Dict[str, Any], key: str) -> int:
    v = check.field(sd, key, int)
    if isinstance(v, bool) or v < 0:
        raise ValueError(f"flatcomm.diloco: checkpoint field {key!r} must be an int >= 0, got {v!r}")
    return v


def _prepare(outer, sd: Dict[str, Any], replica: Optional[int] = None) -> Dict[str, Any]:
    """Every tensor of ``sd`` checked and copied to where it lives in this run (changes nothing);
    ``replica``: check ``sd`` as that replica's (default: this one's)."""
    version = check.field(sd, "version", int)
    if version not in (1, STATE_DICT_VERSION):
        raise ValueError(f"flatcomm.diloco: checkpoint version {version}, this flatcomm reads 1 to {STATE_DICT_VERSION}")
    _check_replica(outer, sd, version, replica)
    cfg = outer.config
    want = f"{cfg.fingerprint(with_verify=version == 1):016x}"  # version 1 hashed verify_every too
    if check.field(sd, "config", str) != want:
        raise ValueError(f"flatcomm.diloco: the checkpoint was saved with another DiLoCo configuration: "
                         f"{_differing(sd.get('options'), cfg.options())}. Resume with the options it was saved "
                         f"with (verify_every may change)")
    step, syncs = _int(sd, "step"), _int(sd, "syncs")
    saved = check.field(sd, "fragments", list)
    if len(saved) != len(outer.fragments):
        raise ValueError(f"flatcomm.diloco: checkpoint has {len(saved)} fragments, this run {len(outer.fragments)}")
    frags: List[Dict[str, Any]] = []
    for i, (f, s) in enumerate(zip(outer.fragments, saved)):
        if check.field(s, "names", list) != f.names:
            raise ValueError(f"flatcomm.diloco: checkpoint fragment {i} holds other parameters than this model's")
        res = check.field(s, "residuals", list)
        if len(res) != len(f.residuals):
            raise ValueError(f"flatcomm.diloco: checkpoint fragment {i} has {len(res)} residuals, this run needs "
                             f"{len(f.residuals)}")
        frags.append({
            "master": _tensor(s.get("master"), f"fragment {i} master", f.numel, torch.float32).to(f.state_device),
            "momentum": _tensor(s.get("momentum"), f"fragment {i} momentum", f.numel, torch.float32).to(f.state_device),
            "residuals": [_tensor(r, f"fragment {i} residual {j}", mine.numel(), mine.dtype).to(f.device)
                          for j, (r, mine) in enumerate(zip(res, f.residuals))]})
    finished = _int(sd, "finished_at") if "finished_at" in sd else 0  # (absent before finish() existed)
    if finished > step:
        raise ValueError(f"flatcomm.diloco: checkpoint's finish() at inner step {finished} is after its step {step}")
    choice = _auto(outer, sd)
    plan = outer.config.plan
    feedback = plan.feedback if plan.auto is None else \
        plan.error_feedback and not (choice.to_codec() if choice is not None else auto.PLACEHOLDER).lossless
    return {"step": step, "syncs": syncs, "fragments": frags, "finished_at": finished,
            "in_flight": _in_flight(outer, sd, step, finished, feedback), "auto": choice}


def _auto(outer, sd: Dict[str, Any]) -> Optional[auto.Choice]:
    """The saved choice of ``codec="auto"`` (None: not made yet, or not an auto run)."""
    saved = sd.get("auto")  # (absent before codec="auto" existed)
    if saved is None:
        return None
    if outer.config.plan.auto is None:
        raise ValueError("flatcomm.diloco: the checkpoint records a codec='auto' choice; this run names its codec")
    return auto.Choice.from_dict(saved)


def _in_flight(outer, sd: Dict[str, Any], step: int, finished: int, feedback: bool) -> Optional[sync.Pending]:
    """The saved sync in flight as a finished :class:`Pending`, checked against the schedule (a
    finish() at or after its start applied it early)."""
    if "in_flight" not in sd:
        raise KeyError("flatcomm.diloco: checkpoint has no 'in_flight' field")
    s, sch = sd["in_flight"], outer.config.schedule
    due = next((t for t in range(max(step - sch.delay + 1, finished + 1), step + 1)
                if sch.delay and sch.starts(t) is not None), None)
    if s is None:
        if due is not None:
            raise ValueError(f"flatcomm.diloco: checkpoint at inner step {step} lacks the sync started at step {due}")
        return None
    i, started = check.field(s, "fragment", int), check.field(s, "started", int)
    if due is None or started != due or sch.starts(started) != i:
        raise ValueError(f"flatcomm.diloco: checkpoint's sync in flight (fragment {i}, started at step {started}) "
                         f"does not fit the schedule at inner step {step}")
    f = outer.fragments[i]
    delta = _tensor(s.get("delta"), f"in-flight fragment {i} delta", f.numel, torch.float32).to(f.device)
    res, want = check.field(s, "residuals", list), len(f.residuals) if feedback else 0
    if len(res) != want:
        raise ValueError(f"flatcomm.diloco: checkpoint's sync in flight has {len(res)} residuals, this run needs "
                         f"{want}")
    work = [_tensor(r, f"in-flight fragment {i} residual {j}", mine.numel(), torch.float32).to(f.device)
            for j, (r, mine) in enumerate(zip(res, f.residuals))]
    return sync.Pending.done(i, started, delta.clone(), [w.clone() for w in work])


def _fingerprint(prepared: Dict[str, Any]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((prepared["step"], prepared["syncs"], prepared["finished_at"], prepared["auto"])).encode())
    h.update(replicas.master_hash([f["master"] for f in prepared["fragments"]]).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def check_state_dict(outer, sd: Dict[str, Any], replica: Optional[int] = None) -> None:
    """Raise as :func:`load_state_dict` would for ``sd`` on this replica (or on replica
    ``replica``: :mod:`flatcomm.rank_states` checks every replica's part on every rank); no
    communication, changes nothing."""
    _prepare(outer, sd, replica)


def load_state_dict(outer, sd: Dict[str, Any]) -> None:
    """Load ``sd`` into ``outer`` on every replica of the outer group, or on none (a collective)."""
    outer.drain()  # a sync in flight from before is a collective every replica started: finish it
    prepared = replicas.agree(outer.group, outer.device, lambda: _prepare(outer, sd), _fingerprint,
                              "the loaded checkpoint (inner step, syncs and fp32 master)")
    for f, s in zip(outer.fragments, prepared["fragments"]):
        f.commit(s["master"], s["momentum"], s["residuals"])
    outer.step, outer.syncs, outer.pending = prepared["step"], prepared["syncs"], prepared["in_flight"]
    outer.finished_at = prepared["finished_at"]
    if outer.config.plan.auto is not None:  # the codec the saved run chose (or none yet: chosen at the next sync)
        outer.take_choice(prepared["auto"])
