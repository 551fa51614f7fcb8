"""One fragment's outer state: fp32 master of the last synced weights, Nesterov momentum, and the
error-feedback residuals of its compressed all-reduce, each one flat buffer over the fragment.

The parameters a fragment holds are this rank's *local* tensors: the parameter itself, or the
local shard of a DTensor (an FSDP2 replica syncs each shard with the same shard of the other
replicas). The master and the momentum live on the CPU when the parameters are on a GPU (pinned:
the copies overlap), else beside them; the residuals live beside the parameters (the collective
reads them there), in ``residual_dtype`` (bf16 halves their memory; the collective works on fp32
copies). Every update is computed into new tensors first and committed only when all of it
succeeded (:meth:`Fragment.commit`): a failed sync leaves master, momentum and residuals as before.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["Fragment", "local_tensor", "outer_step"]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: a DTensor's local shard (written in place), else itself."""
    local = getattr(p, "_local_tensor", None)  # torch.distributed.tensor.DTensor
    return local if isinstance(local, torch.Tensor) else p


def outer_step(master: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float,
               nesterov: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(new master, new momentum) of torch.optim.SGD's update with the averaged pseudo-gradient
    ``delta`` as the gradient (same operations: buf = mu * buf + g; g + mu * buf with Nesterov)."""
    buf = momentum.mul(mu).add_(delta)
    step = delta.add(buf, alpha=mu) if nesterov else buf
    return master.add(step, alpha=-lr), buf


class Fragment:
    """The parameters of one fragment (name, local tensor) and their outer state."""

    def __init__(self, index: int, named: Sequence[Tuple[str, torch.Tensor]], residual_shapes: Sequence[int],
                 residual_dtype: torch.dtype) -> None:
        self.index = index
        self.names = [n for n, _ in named]
        self.tensors = [local_tensor(p) for _, p in named]
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(f"flatcomm.diloco: fragment {index} has parameters on {sorted(map(str, devices))}; "
                             f"one device per fragment")
        self.device = devices.pop()
        self.state_device = torch.device("cpu") if self.device.type == "cuda" else self.device
        self.sizes = [t.numel() for t in self.tensors]
        self.numel = sum(self.sizes)
        pin = self.state_device.type == "cpu" and self.device.type == "cuda"
        self.master = torch.empty(self.numel, dtype=torch.float32, device=self.state_device, pin_memory=pin)
        self.momentum = torch.zeros(self.numel, dtype=torch.float32, device=self.state_device, pin_memory=pin)
        self.residual_dtype = residual_dtype
        self.residuals: List[torch.Tensor] = [
            torch.zeros(n, dtype=residual_dtype, device=self.device) for n in residual_shapes]
        self.save_master()

    # ---- weights <-> flat buffers -------------------------------------------------------------------

    def gather(self) -> torch.Tensor:
        """The fragment's current local weights as one flat fp32 tensor on the parameters' device."""
        flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for t, piece in zip(self.tensors, flat.split(self.sizes)):
            piece.copy_(t.detach().reshape(-1))
        return flat

    def save_master(self) -> None:
        """Master := the weights as they are now (construction, or a replica joining)."""
        self.master.copy_(self.gather())

    def start_weights(self) -> torch.Tensor:
        """What the parameters were set to at the last sync, in fp32: the master rounded to the
        parameters' dtypes (so a bf16 model's pseudo-gradient holds its inner steps only, not
        the rounding of the master)."""
        m = self.master.to(self.device, non_blocking=True)
        out = torch.empty_like(m)
        for t, src, dst in zip(self.tensors, m.split(self.sizes), out.split(self.sizes)):
            dst.copy_(src.to(t.dtype) if t.dtype != torch.float32 else src)
        return out

    def pseudo_gradient(self) -> torch.Tensor:
        """start weights - current weights (fp32, flat, on the parameters' device)."""
        start = self.start_weights()
        return torch.sub(start, self.gather(), out=start)

    def set_weights(self, master: torch.Tensor, alpha: float) -> None:
        """Parameters := the new master, mixed with the local weights by ``alpha`` (torchft's
        ``fragment_update_alpha``: ``p = master + alpha * (local - master)``)."""
        m = master.to(self.device, non_blocking=True)
        for t, src in zip(self.tensors, m.split(self.sizes)):
            src = src.view(t.shape)
            if alpha:
                src = src.lerp(t.detach().float(), alpha)
            with torch.no_grad():
                t.copy_(src)

    # ---- residuals ----------------------------------------------------------------------------------

    def residual_copies(self) -> List[torch.Tensor]:
        """fp32 working copies of the residuals for one collective (the stored ones stay as they
        are until :meth:`commit`)."""
        return [r.to(torch.float32, copy=True) for r in self.residuals]

    def commit(self, master: torch.Tensor, momentum: torch.Tensor, residuals: Optional[List[torch.Tensor]]) -> None:
        """Store the results of a sync that fully succeeded."""
        self.master.copy_(master)
        self.momentum.copy_(momentum)
        if residuals is not None:
            for dst, src in zip(self.residuals, residuals):
                dst.copy_(src)
