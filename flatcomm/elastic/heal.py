"""What a joining or lagging replica fetches from a healthy peer through torchft's healing.

The donor serves its *last committed* outer state: the fp32 master and outer momentum as they were
after its last committed sync (never its weights mid-interval), the inner step of the sync it is
in (the schedule position) and the count of syncs applied. No residual travels: the healed replica
starts with zero residuals (its own error feedback is gone with the process that held it, and the
donor's belongs to the donor). No inner optimizer state travels either: the joiner keeps its own.
A fingerprint of the configuration travels too, and a load that does not match changes nothing.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["KEY", "VERSION", "check", "state"]

KEY = "flatcomm.elastic"  # the torchft state_dict key (Manager.register_state_dict_fn)
VERSION = 1
_FIELDS = ("version", "fingerprint", "master", "momentum", "step", "syncs")


def state(master: torch.Tensor, momentum: torch.Tensor, step: int, syncs: int, fingerprint: int) -> Dict[str, Any]:
    """The heal state (copies: torchft's transport serves them while training goes on)."""
    return {"version": VERSION, "fingerprint": int(fingerprint), "master": master.detach().clone(),
            "momentum": momentum.detach().clone(), "step": int(step), "syncs": int(syncs)}


def check(sd: Any, fingerprint: int, numel: int) -> None:
    """Raise ValueError naming the problem unless ``sd`` is a heal state this replica can load."""
    if not isinstance(sd, dict) or sorted(sd) != sorted(_FIELDS):
        got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"flatcomm.elastic: a heal state has the keys {sorted(_FIELDS)}, got {got}")
    if sd["version"] != VERSION:
        raise ValueError(f"flatcomm.elastic: heal state version {sd['version']!r}, this flatcomm reads {VERSION}")
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
