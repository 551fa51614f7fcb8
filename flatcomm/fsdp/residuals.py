"""The FSDP backend's error-feedback residuals: flat fp32 buffers per parameter group, keyed by
parameter name (:class:`flatcomm._training.residual_store.Store`), with their checkpoint entries."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._training import checks as check
from .._training.residual_store import Store

__all__ = ["Pieces", "Residuals"]

Pieces = List[Tuple[str, int]]  # (name, values per rank) in the input's row layout


@dataclasses.dataclass
class _Group:
    """One parameter group's residuals: ``buf[r]`` is this rank's residual of rank r's chunk."""
    buf: torch.Tensor  # [world, values per rank of the group]
    layout: List[Tuple[Any, int, int]]  # (name, offset, values per rank)


class Residuals:
    """Flat fp32 residual buffers, one per distinct parameter group (a :class:`flatcomm._training.residual_store.Store`
    keyed by parameter name), addressable per parameter, plus the model's sizes when known."""

    def __init__(self) -> None:
        self._store: Store[_Group] = Store()
        self.templates: Dict[str, int] = {}  # name -> padded unsharded numel (known in advance)

    def view(self, name: str) -> Optional[torch.Tensor]:
        """This rank's residual of ``name`` as a [world, c] view (None if never seen)."""
        loc = self._store.locate(name)
        if loc is None:
            return None
        group, off, c = loc
        return group.buf[:, off:off + c]

    def holds(self, pieces: Pieces) -> bool:
        """Whether any of these parameters has a residual (placed or loaded)."""
        names = [n for n, _ in pieces]
        return self._store.holds(names, names)

    def get(self, pieces: Pieces, world: int, device: torch.device) -> torch.Tensor:
        key = tuple(n for n, _ in pieces)
        total = sum(c for _, c in pieces)
        hit = self._store.get(key)
        if hit is not None and hit.buf.shape == (world, total) and hit.buf.device == device:
            return hit.buf.view(-1)
        buf = torch.zeros(world, total, dtype=torch.float32, device=device)
        layout, off = [], 0
        for name, c in pieces:
            layout.append((name, off, c))
            off += c

        def move(old: _Group, ooff: int, oc: int, off: int, c: int) -> None:
            if oc == c and old.buf.shape[0] == world:  # else another world size: nothing carries over
                buf[:, off:off + c].copy_(old.buf[:, ooff:ooff + oc])

        def load(src: torch.Tensor, name: str, off: int, c: int) -> None:
            if src.numel() != world * c:
                raise ValueError(
                    f"flatcomm: loaded residual for {name!r} has {src.numel()} values but this "
                    f"run needs {world} x {c} (residuals load at the world size they were saved at)")
            buf[:, off:off + c].copy_(src.view(world, c))

        self._store.place(key, _Group(buf, layout), move, load, name_of=str)
        return buf.view(-1)

    def names(self) -> List[str]:
        return sorted({str(n) for n in self._store.ids()} | set(self._store.pending) | set(self.templates))

    def state_dict(self, prefix: str) -> Dict[str, torch.Tensor]:
        out = {}
        for name in self.names():
            v = self.view(name)
            if v is not None:
                t = v.reshape(-1).clone()
            elif name in self._store.pending:
                t = self._store.pending[name].clone()
            else:
                t = torch.zeros(self.templates[name], dtype=torch.float32)
            out[prefix + name] = t
        return out

    def load_state_dict(self, sd: Dict[str, torch.Tensor], prefix: str) -> None:
        loaded = {}
        for k, v in sd.items():
            if not k.startswith(prefix):
                continue
            name = k[len(prefix):]
            n = self.templates.get(name)
            shape = (n,) if n is not None else tuple(getattr(v, "shape", ()))
            if n is not None and isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() != n:
                raise ValueError(f"flatcomm: loaded residual for {name!r} has {v.numel()} values, "
                                 f"this model needs {n} (same world size required)")
            loaded[name] = check.residual(name, v, shape).reshape(-1).clone()
        if self.templates:  # the model is known: every parameter must come back
            check.keys([n for n in loaded if n in self.templates], self.templates, f"{prefix[:-1]} residuals")
        self._store.clear(loaded)
