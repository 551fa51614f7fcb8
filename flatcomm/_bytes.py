"""The bytes of a tensor as a Python ``bytes`` object, without numpy.

numpy is not a run-time dependency of flatcomm (torch does not require it either), so
``tensor.numpy()`` raises ``RuntimeError: Numpy is not available`` on a plain install. Hashes and
relayed payloads read the bytes here instead.
"""
from __future__ import annotations

import ctypes

import torch

__all__ = ["tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A copy of the bytes of ``t``, in row-major order, read on the host.

    Args:
        t: any tensor (any device, dtype, layout of strides); a non-contiguous one is made
            contiguous first, so the result is the same as for ``t.contiguous()``.

    Returns:
        ``t.numel() * t.element_size()`` bytes, the same as ``t.numpy().tobytes()`` would give.
    """
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    size = flat.numel() * flat.element_size()
    if size == 0:
        return b""
    # string_at copies `size` bytes from the tensor's memory; `flat` stays alive during the call.
    return ctypes.string_at(flat.data_ptr(), size)
