"""flatcomm: fast and exact gradient communication for PyTorch data parallelism.

Kernels (this module): codecs with fused error feedback, fused decode-and-sum in a fixed order,
ordered sums and exact (order-independent) sums. See README.md for the whole picture.
"""
from __future__ import annotations

from . import _ops
from ._version import __version__
from ._ops import _C
from .codecs import (
    CODECS,
    Codec,
    decode,
    decode_sum,
    encode,
    resolve,
    wire_bytes,
)
from .sums import exact_exponents, exact_sum, from_exact, ordered_sum, to_exact
from .collectives import CommStats, ErrorFeedback, all_gather, all_reduce, reduce_scatter
from .topology import Topology
from . import autotune  # noqa: F401,E402  (registers the default tuner of codec="auto")
from . import hierarchical  # noqa: F401,E402  (registers the two-level path of topology=)


def build_info() -> dict:
    """What this build was compiled with and uses: devices, CPU SIMD level, threads, compiler."""
    import torch

    info = dict(_C.build_info())
    info["threads"] = torch.get_num_threads()
    info["torch"] = torch.__version__
    info["version"] = __version__
    info["cuda_path"] = _ops.cuda_path()  # "compiled", "nvrtc (cupy)" or "none (reason)"
    return info


_SUBMODULES = ("ddp", "fsdp", "fsdp_hybrid", "reproducible", "reference", "optim")


def __getattr__(name: str):
    """Import the integrations on first use (``flatcomm.ddp.register(...)`` after ``import
    flatcomm``), so that importing the kernels stays light."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flatcomm' has no attribute {name!r}")


__all__ = [
    "__version__",
    "CODECS",
    "CommStats",
    "ErrorFeedback",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "Codec",
    "Topology",
    "build_info",
    "decode",
    "decode_sum",
    "encode",
    "exact_exponents",
    "exact_sum",
    "from_exact",
    "ordered_sum",
    "resolve",
    "to_exact",
    "wire_bytes",
]
