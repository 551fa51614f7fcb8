"""One fragment's outer state: fp32 master of the last synced weights, Nesterov momentum, and the
error-feedback residuals of its compressed all-reduce, each one flat buffer over the fragment.

The parameters a fragment holds are this rank's *local* tensors: the parameter itself, or the
local shard of a DTensor (an FSDP2 replica syncs each shard with the same shard of the other
replicas). The master and the momentum live on the CPU when the parameters are on a GPU (pinned:
the copies overlap), else beside them; the residuals live beside the parameters (the collective
reads them there), in ``residual_dtype`` (bf16 halves their memory; the collective works on fp32
copies). Every update is computed into new tensors first and committed only when all of it
succeeded (:meth:`Fragment.commit`): a failed sync leaves master, momentum and residuals as before.

Those new tensors are views of one :class:`Workspace`, reused by every sync (one is in flight at a
time): a fresh fragment-sized tensor costs its page faults on first touch (~30 ms for 27 MB here,
eight of them per sync), which the training loop pays between two inner steps.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .schedule import Piece, local_tensor

__all__ = ["Fragment", "Workspace", "local_tensor", "outer_step"]


class Workspace:
    """fp32 buffers kept for the sync in flight, one per role and device, grown to the largest
    fragment; :meth:`take` hands out a view of the first ``n`` values (contents undefined)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, torch.device], torch.Tensor] = {}

    def take(self, role: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        buf = self._buffers.get((role, device))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32, device=device, pin_memory=pin)
            self._buffers[(role, device)] = buf
        return buf[:n]


def outer_step(master: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float,
               nesterov: bool, out_master: Optional[torch.Tensor] = None,
               out_momentum: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(new master, new momentum) of torch.optim.SGD's update with the averaged pseudo-gradient
    ``delta`` as the gradient (same operations: buf = mu * buf + g; g + mu * buf with Nesterov),
    written into ``out_master`` / ``out_momentum`` when given; ``delta`` is overwritten."""
    buf = torch.mul(momentum, mu, out=out_momentum) if out_momentum is not None else momentum.mul(mu)
    buf.add_(delta)
    step = delta.add_(buf, alpha=mu) if nesterov else buf
    new = torch.add(master, step, alpha=-lr, out=out_master) if out_master is not None else master.add(step, alpha=-lr)
    return new, buf


class Fragment:
    """The values of one fragment (pieces of this rank's local tensors) and their outer state."""

    def __init__(self, index: int, pieces: Sequence[Piece], residual_shapes: Sequence[int],
                 residual_dtype: torch.dtype, state_device: Optional[torch.device] = None,
                 residual_device: Optional[torch.device] = None) -> None:
        self.index = index
        self.names = [p.label for p in pieces]
        self.tensors = [local_tensor(p.param) for p in pieces]
        self.ranges = [(p.start, p.stop) for p in pieces]
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(f"flatcomm.diloco: fragment {index} has parameters on {sorted(map(str, devices))}; "
                             f"one device per fragment")
        self.device = devices.pop()
        # master and momentum: on the host for GPU parameters unless ``state_device`` says otherwise;
        # residuals: beside the parameters unless ``residual_device`` says otherwise (where the
        # collective that reads them runs: flatcomm.elastic's gloo exchange runs from the host)
        if state_device is None:
            state_device = torch.device("cpu") if self.device.type == "cuda" else self.device
        self.state_device = torch.device(state_device)
        self.sizes = [b - a for a, b in self.ranges]
        self.numel = sum(self.sizes)
        pin = self.state_device.type == "cpu" and self.device.type == "cuda"
        self.master = torch.empty(self.numel, dtype=torch.float32, device=self.state_device, pin_memory=pin)
        self.momentum = torch.zeros(self.numel, dtype=torch.float32, device=self.state_device, pin_memory=pin)
        self.residual_dtype = residual_dtype
        res_device = torch.device(residual_device) if residual_device is not None else self.device
        self.residuals: List[torch.Tensor] = [
            torch.zeros(n, dtype=residual_dtype, device=res_device,
                        pin_memory=res_device.type == "cpu" and self.device.type == "cuda")
            for n in residual_shapes]
        self.save_master()

    # ---- weights <-> flat buffers -------------------------------------------------------------------

    def _values(self) -> List[torch.Tensor]:
        """Each piece's current values, flat (views, written in place: a cut parameter is
        contiguous, see :func:`flatcomm.diloco.split`; a whole non-contiguous one is a copy)."""
        return [t.detach().reshape(-1)[a:b] for t, (a, b) in zip(self.tensors, self.ranges)]

    def gather(self) -> torch.Tensor:
        """The fragment's current local weights as one flat fp32 tensor on the parameters' device."""
        flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for now, piece in zip(self._values(), flat.split(self.sizes)):
            piece.copy_(now)
        return flat

    def save_master(self) -> None:
        """Master := the weights as they are now (construction, or a replica joining)."""
        self.master.copy_(self.gather())

    def pseudo_gradient(self, out: torch.Tensor) -> torch.Tensor:
        """Into ``out`` (fp32, flat, on the parameters' device): the start weights - the current
        weights, where the start weights are what the parameters were set to at the last sync: the
        master rounded to the parameters' dtypes (so a bf16 model's pseudo-gradient holds its inner
        steps only, not the rounding of the master)."""
        m = self.master.to(self.device, non_blocking=True)
        for now, src, dst in zip(self._values(), m.split(self.sizes), out.split(self.sizes)):
            if now.dtype != torch.float32:
                dst.copy_(src.to(now.dtype)).sub_(now)
            else:
                torch.sub(src, now, out=dst)
        return out

    def set_weights(self, master: torch.Tensor, alpha: float) -> None:
        """Parameters := the new master, mixed with the local weights by ``alpha`` (torchft's
        ``fragment_update_alpha``: ``p = master + alpha * (local - master)``)."""
        m = master.to(self.device, non_blocking=True)
        for t, now, src in zip(self.tensors, self._values(), m.split(self.sizes)):
            if alpha:
                src = src.lerp(now.float(), alpha)
            with torch.no_grad():
                if t.is_contiguous():
                    now.copy_(src)  # a view of the parameter
                else:  # whole (never cut): write through its shape
                    t.copy_(src.view(t.shape))

    # ---- residuals ----------------------------------------------------------------------------------

    def residual_copies(self, work: Workspace) -> List[torch.Tensor]:
        """fp32 working copies of the residuals for one collective, in ``work`` (the stored ones
        stay as they are until :meth:`commit`)."""
        return [work.take(f"residual{i}", r.numel(), r.device).copy_(r) for i, r in enumerate(self.residuals)]

    def commit(self, master: torch.Tensor, momentum: torch.Tensor, residuals: Optional[List[torch.Tensor]]) -> None:
        """Store the results of a sync that fully succeeded."""
        self.master.copy_(master)
        self.momentum.copy_(momentum)
        if residuals is not None:
            for dst, src in zip(self.residuals, residuals):
                dst.copy_(src)
