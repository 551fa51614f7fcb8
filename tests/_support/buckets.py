"""A stand-in for torch.distributed.GradBucket: what flatcomm.ddp reads from one."""
from __future__ import annotations

import torch


class _Bucket:
    """What flatcomm.ddp reads from a dist.GradBucket."""

    def __init__(self, index, params, grads, last=True):
        self._index, self._params, self._last = index, list(params), last
        self._buf = torch.cat([g.reshape(-1) for g in grads])
        self._grads, off = [], 0
        for p in self._params:
            self._grads.append(self._buf[off:off + p.numel()].view(p.shape))
            off += p.numel()

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads

    def index(self):
        return self._index

    def is_last(self):
        return self._last
