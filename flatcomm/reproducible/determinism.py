"""PyTorch's switches for deterministic kernels (:func:`configure`), so that a micro-batch gradient
is the same bits on every rank (see :mod:`flatcomm.reproducible`)."""
from __future__ import annotations

import os
from typing import Dict

import torch

__all__ = ["configure"]


def configure(threads: int = 1, *, warn_only: bool = False) -> Dict[str, object]:
    """Make PyTorch's kernels deterministic, so a micro-batch gradient is the same on every rank.

    Call it first thing in every process (before any CUDA work). It sets:

    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set to ``:4096:8`` or ``:16:8``): cuBLAS
      picks its split-K reduction from a workspace pool, and without a fixed configuration
      ``use_deterministic_algorithms`` raises on CUDA matmuls. It is read when cuBLAS creates its
      handle, hence "before any CUDA work";
    * ``torch.use_deterministic_algorithms(True, warn_only=warn_only)``: ops with only a
      nondeterministic kernel (atomic-add scatter and index backward on CUDA, ...) raise instead of
      silently varying run to run;
    * ``torch.backends.cudnn.deterministic = True`` and ``cudnn.benchmark = False``: cuDNN must not
      pick a convolution algorithm by timing (the choice, hence the bits, would vary run to run);
    * ``torch.set_num_threads(threads)`` (default 1): some CPU kernels split a reduction into one
      partial sum per thread, so their bits depend on the intra-op thread count, and the default
      count differs between launches (``torchrun`` sets ``OMP_NUM_THREADS=1`` only when it starts
      more than one process per node; otherwise torch uses every core). Any fixed count works as
      long as it is the same for every run that is compared.

    TF32 settings are left alone: they are deterministic; keep them equal across the runs compared.
    Returns what was set.
    """
    if threads < 1:
        raise ValueError(f"flatcomm.reproducible.configure: threads must be >= 1, got {threads}")
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(threads)
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "deterministic_algorithms": True,
        "warn_only": warn_only,
        "cudnn.deterministic": True,
        "cudnn.benchmark": False,
        "num_threads": threads,
    }
