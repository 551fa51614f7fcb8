"""A DiLoCo replica's whole training state, for frameworks that save the model and optimizer once.

Between two syncs every replica's weights and inner optimizer state are its own, but Lightning,
Accelerate and the Hugging Face Trainer write the model and the optimizer from rank 0 only and
load rank 0's on every rank. :class:`ReplicaState` holds what a resume then lacks: the DiLoCo
state (:meth:`DiLoCo.state_dict`), this replica's model ``state_dict()`` and its inner optimizer's.
:mod:`flatcomm.rank_states` gathers it from every rank like a DiLoCo state; loaded after the
framework restored rank 0's model and optimizer, each replica continues bit for bit.

A load is checked in full before anything changes (the DiLoCo part as :meth:`DiLoCo.load_state_dict`
checks it; the model's keys, shapes, dtypes and finiteness; the optimizer's groups and the shapes
of its state), then the DiLoCo part loads on every replica or none (a collective of its outer
group), then the model and the optimizer.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from .._training import checks as check

__all__ = ["ReplicaState"]


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


class ReplicaState:
    """``outer`` (a :class:`flatcomm.diloco.DiLoCo`) with the ``model`` and ``inner_optimizer`` it
    syncs, as one checkpointable state (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, outer: Any, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer) -> None:
        self.outer = outer
        self.model = model
        self.inner_optimizer = inner_optimizer

    def state_dict(self) -> Dict[str, Any]:
        """``{"outer", "model", "inner_optimizer"}``; the model and optimizer entries hold references
        to live tensors, as torch's ``state_dict()`` does (save or copy before training on)."""
        return {"outer": self.outer.state_dict(), "model": self.model.state_dict(),
                "inner_optimizer": self.inner_optimizer.state_dict()}

    def check_state_dict(self, sd: Any, replica: Optional[int] = None) -> None:
        """Raise as :meth:`load_state_dict` would for ``sd`` (as replica ``replica``'s own state,
        default this one's); no communication, changes nothing."""
        if not isinstance(sd, Mapping) or set(sd) != {"outer", "model", "inner_optimizer"}:
            fields = sorted(map(str, sd))[:6] if isinstance(sd, Mapping) else type(sd).__name__
            raise ValueError(f"flatcomm.diloco: a replica state has the fields outer, model and inner_optimizer; "
                             f"got {fields} (a DiLoCo state alone? load it with DiLoCo.load_state_dict)")
        self.outer.check_state_dict(sd["outer"], replica)
        self._check_model(sd["model"])
        self._check_optimizer(sd["inner_optimizer"])

    def _check_model(self, saved: Any) -> None:
        if not isinstance(saved, Mapping):
            raise TypeError(f"flatcomm.diloco: the replica state's model entry is a {type(saved).__name__}")
        mine = self.model.state_dict()
        check.keys(saved, mine, "model weights")
        for k, t in mine.items():
            s = saved[k]
            if not isinstance(s, torch.Tensor) or s.dtype != t.dtype or s.shape != t.shape:
                what = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"flatcomm.diloco: the replica state's weight {k!r} is {what}; this model's is "
                                 f"{t.dtype} {tuple(t.shape)}")
            if not _finite(s):
                raise ValueError(f"flatcomm.diloco: the replica state's weight {k!r} holds inf/NaN values")

    def _check_optimizer(self, saved: Any) -> None:
        if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list) \
                or not isinstance(saved.get("state"), Mapping):
            raise TypeError("flatcomm.diloco: the replica state's inner_optimizer entry is not an optimizer "
                            "state_dict() (param_groups and state)")
        mine = self.inner_optimizer.state_dict()
        groups = saved["param_groups"]
        sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
        if sizes != [len(g["params"]) for g in mine["param_groups"]]:
            raise ValueError(f"flatcomm.diloco: the replica state's inner optimizer has parameter groups of sizes "
                             f"{sizes}; this one {[len(g['params']) for g in mine['param_groups']]}")
        ids = {i for g in groups for i in g["params"]}
        for i, entry in saved["state"].items():
            if i not in ids or not isinstance(entry, Mapping):
                raise ValueError(f"flatcomm.diloco: the replica state's inner optimizer holds state for parameter "
                                 f"{i!r}, which none of its groups lists")
            have = mine["state"].get(_position(i, groups, mine["param_groups"]), {})
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and not _finite(v):
                    raise ValueError(f"flatcomm.diloco: the replica state's inner optimizer state {key!r} of "
                                     f"parameter {i} holds inf/NaN values")
                ref = have.get(key)
                if isinstance(ref, torch.Tensor) and (not isinstance(v, torch.Tensor) or v.shape != ref.shape):
                    raise ValueError(f"flatcomm.diloco: the replica state's inner optimizer state {key!r} of "
                                     f"parameter {i} does not have this run's shape {tuple(ref.shape)}")

    def load_state_dict(self, sd: Any) -> None:
        """Load on every replica of the outer group or on none (the DiLoCo part is a collective)."""
        self.check_state_dict(sd)
        self.outer.load_state_dict(sd["outer"])
        self.model.load_state_dict(sd["model"])
        self.inner_optimizer.load_state_dict(sd["inner_optimizer"])


def _position(i: Any, saved_groups: list, my_groups: list) -> Any:
    """The id in this optimizer of the parameter the saved state calls ``i`` (same order of groups)."""
    for s, m in zip(saved_groups, my_groups):
        if i in s["params"]:
            return m["params"][list(s["params"]).index(i)]
    return None
