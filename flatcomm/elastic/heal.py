"""What a joining or lagging replica fetches from a healthy peer through torchft's healing.

The donor serves its *last committed* outer state: the fp32 master and outer momentum as they were
after its last committed sync (never its weights mid-interval), the inner step of the sync it is
in (the schedule position), the count of syncs applied and the data stream's state at that sync
(:mod:`flatcomm.elastic.data`). With islands of several ranks each rank serves only its *part*
(its FSDP2 shards, or its share of a DDP replica's flat parameters, :mod:`flatcomm.elastic.island`)
to the same rank of the healing island: torchft's transport moves every rank's part in parallel,
and ``part`` ([rank, island size]) says which part it is. No residual travels: the healed replica
starts with zero residuals (its own error feedback is gone with the process that held it, and the
donor's belongs to the donor). No inner optimizer state travels either: the joiner keeps its own.
A fingerprint of the configuration travels too, and a load that does not match changes nothing.

A *checkpoint* (:meth:`ElasticDiLoCo.state_dict`) is the same committed state plus what stays with
the replica: its residuals, the layout they were made in and torchft's step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["KEY", "VERSION", "check", "check_checkpoint", "checkpoint", "state"]

KEY = "flatcomm.elastic"  # the torchft state_dict key (Manager.register_state_dict_fn)
VERSION = 2
_FIELDS = ("version", "fingerprint", "master", "momentum", "step", "syncs", "data", "part")
_FIELDS_V1 = _FIELDS[:6]  # version 1 (no islands, no data position): still read from checkpoints


def copy_state(sd: Any) -> Any:
    """A deep copy of a (nested) state of dicts, lists, tensors and scalars."""
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: copy_state(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(copy_state(v) for v in sd)
    return sd


def state_bytes(sd: Any) -> torch.Tensor:
    """A canonical byte string of a (nested) state, as a uint8 tensor (equal states: equal bytes)."""
    out: List[bytes] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            out.append(f"T{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            out.append(b"{")
            for k in sorted(v, key=repr):
                out.append(repr(k).encode())
                walk(v[k])
            out.append(b"}")
        elif isinstance(v, (list, tuple)):
            out.append(b"[")
            for x in v:
                walk(x)
            out.append(b"]")
        else:
            out.append(repr(v).encode())
    walk(sd)
    return torch.frombuffer(bytearray(b"".join(out) or b"-"), dtype=torch.uint8).clone()  # owns its bytes


def state(master: torch.Tensor, momentum: torch.Tensor, step: int, syncs: int, fingerprint: int,
          data: Optional[Dict[str, Any]] = None, part: Tuple[int, int] = (0, 1)) -> Dict[str, Any]:
    """The heal state (copies: torchft's transport serves them while training goes on)."""
    return {"version": VERSION, "fingerprint": int(fingerprint), "master": master.detach().clone(),
            "momentum": momentum.detach().clone(), "step": int(step), "syncs": int(syncs),
            "data": copy_state(data), "part": [int(part[0]), int(part[1])]}


def check(sd: Any, fingerprint: int, numel: int, part: Tuple[int, int] = (0, 1)) -> None:
    """Raise ValueError naming the problem unless ``sd`` is a heal state this replica (rank
    ``part[0]`` of an island of ``part[1]``) can load."""
    fields = _FIELDS_V1 if isinstance(sd, dict) and sd.get("version") == 1 else _FIELDS
    if not isinstance(sd, dict) or sorted(sd) != sorted(fields):
        got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"flatcomm.elastic: a heal state has the keys {sorted(_FIELDS)}, got {got}")
    if sd["version"] not in (1, VERSION):
        raise ValueError(f"flatcomm.elastic: heal state version {sd['version']!r}, this flatcomm reads {VERSION}")
    if list(sd.get("part", [0, 1])) != list(part):
        raise ValueError(f"flatcomm.elastic: the heal state is the part of rank {sd['part'][0]} of an island of "
                         f"{sd['part'][1]}, this is rank {part[0]} of {part[1]}")
    if sd.get("data") is not None and not isinstance(sd["data"], dict):
        raise ValueError(f"flatcomm.elastic: heal state 'data' must be a dict or None, got {type(sd['data']).__name__}")
    if sd["fingerprint"] != fingerprint:
        raise ValueError(f"flatcomm.elastic: the donor's configuration (fingerprint {sd['fingerprint']:016x}) "
                         f"differs from this replica's ({fingerprint:016x}): every replica needs the same model, "
                         f"codec, mode, sync_every and outer optimizer settings")
    for name in ("master", "momentum"):
        t = sd[name]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (numel,):
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flatcomm.elastic: heal state {name!r} must be float32 ({numel},), got {what}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"flatcomm.elastic: heal state {name!r} is not finite")
    for name in ("step", "syncs"):
        if isinstance(sd[name], bool) or not isinstance(sd[name], int) or sd[name] < 0:
            raise ValueError(f"flatcomm.elastic: heal state {name!r} must be an int >= 0, got {sd[name]!r}")


def checkpoint(heal_state: Dict[str, Any], residuals: List[torch.Tensor], layout: Optional[Tuple[int, int]],
               torchft: Dict[str, Any]) -> Dict[str, Any]:
    """A replica's own committed state to resume from: its heal state, residuals, layout, torchft's."""
    return {**heal_state, "residuals": [r.detach().clone() for r in residuals],
            "layout": None if layout is None else list(layout), "torchft": dict(torchft)}


def check_checkpoint(sd: Any, fingerprint: int, numel: int, residual_numels: List[int],
                     part: Tuple[int, int] = (0, 1)) -> None:
    """Raise ValueError naming the problem unless this replica can resume from ``sd``."""
    if not isinstance(sd, dict):
        raise ValueError(f"flatcomm.elastic: a checkpoint is a dict, got {type(sd).__name__}")
    missing = [k for k in ("residuals", "layout", "torchft") if k not in sd]
    if missing:
        raise ValueError(f"flatcomm.elastic: the checkpoint lacks {missing} (a heal state is not a checkpoint)")
    check({k: v for k, v in sd.items() if k not in ("residuals", "layout", "torchft")}, fingerprint, numel, part)
    res = sd["residuals"]
    shapes = [tuple(r.shape) if isinstance(r, torch.Tensor) else None for r in res] if isinstance(res, list) else None
    if shapes != [(n,) for n in residual_numels] or not all(r.dtype == torch.float32 and bool(torch.isfinite(r).all())
                                                           for r in res):
        raise ValueError(f"flatcomm.elastic: the checkpoint's residuals must be {len(residual_numels)} finite float32 "
                         f"tensors of {residual_numels} values, got {shapes}")
    lay, tft = sd["layout"], sd["torchft"]
    if lay is not None and not (isinstance(lay, list) and len(lay) == 2 and all(type(x) is int for x in lay)):
        raise ValueError(f"flatcomm.elastic: the checkpoint's layout must be None or [rank, size], got {lay!r}")
    if not isinstance(tft, dict) or type(tft.get("step")) is not int:
        raise ValueError(f"flatcomm.elastic: the checkpoint's torchft state must be a dict with an int step, got {tft!r}")
