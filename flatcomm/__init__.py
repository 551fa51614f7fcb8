"""flatcomm: fast and exact gradient communication for PyTorch data parallelism.

The package is built in layers, each importing only those below it (``docs/architecture.md``):

* :mod:`flatcomm.ops`: the kernels (codecs with fused error feedback, fused decode-and-sum in a fixed
  order, ordered and exact sums), re-exported here;
* :mod:`flatcomm.comm`: the machinery (private groups, workers, call headers, the chunk pipeline,
  the flat and two-level paths);
* :mod:`flatcomm.autotune`: ``codec="auto"``;
* :mod:`flatcomm.collectives`: the public collectives, re-exported here;
* the parallel layer: :mod:`flatcomm.ddp`, :mod:`flatcomm.fsdp`, :mod:`flatcomm.optim`,
  :mod:`flatcomm.reproducible`, :mod:`flatcomm.stats`,
  :mod:`flatcomm.diloco` (imported on first use);
* :mod:`flatcomm.rank_states`: every rank's state in one dict, for frameworks that save from rank 0;
* :mod:`flatcomm.integrations`: adapters for Lightning, Accelerate and transformers (never imported
  by the library); :mod:`flatcomm.tools`: benchmarks, tuner and demo.
"""
from __future__ import annotations

from . import _compat
from ._version import __version__
from .ops import (
    CODECS,
    Codec,
    decode,
    decode_rows,
    decode_sum,
    encode,
    exact_exponents,
    exact_sum,
    from_exact,
    ordered_sum,
    resolve,
    to_exact,
    wire_bytes,
)
from .ops import cupy_backend as _cupy_backend
from .ops.native import extension as _C
from .collectives import CommStats, ErrorFeedback, all_gather, all_reduce, reduce_scatter
from .comm.topology import Topology

# The NVRTC path for the CUDA ops, when the extension was built without CUDA (a plugin of the ops,
# registered from here, above them; opt-in with FLATCOMM_CUPY=1 until a GPU run has passed).
_CUDA_PATH = _cupy_backend.auto_register(list(_C.build_info()["devices"]))
_compat.install()


def _create_backend(*args, **kwargs):
    """The creator of the ``flatcomm`` torch.distributed backend, registered by a plain ``import flatcomm``
    so that ``init_process_group("flatcomm")`` works without ``import flatcomm.backend``; the backend
    itself (:mod:`flatcomm.backend`, the parallel layer) imports on the first group it creates."""
    from .backend.group import create

    return create(*args, **kwargs)


def _register_backend_name() -> None:
    import torch.distributed as dist

    # "flatcomm" is flatcomm.backend.NAME; flatcomm.backend registers its own creator unless this ran first.
    if dist.is_available() and "FLATCOMM" not in dist.Backend._plugins:
        dist.Backend.register_backend("flatcomm", _create_backend, extended_api=True, devices=["cpu", "cuda"])


_register_backend_name()


def cuda_path() -> str:
    """Which CUDA implementation the flatcomm ops use: 'compiled', 'nvrtc (cupy)' or 'none (why)'."""
    return _CUDA_PATH


def build_info() -> dict:
    """What this build was compiled with and uses: devices, CPU SIMD level, threads, compiler."""
    import torch

    info = dict(_C.build_info())
    info["threads"] = torch.get_num_threads()
    info["torch"] = torch.__version__
    info["version"] = __version__
    info["cuda_path"] = cuda_path()  # "compiled", "nvrtc (cupy)" or "none (reason)"
    return info


_SUBMODULES = ("ddp", "fsdp", "hierarchical", "reproducible", "optim", "stats", "diloco",
               "autotune", "rank_states", "integrations")


def __getattr__(name: str):
    """Import the parallel layer and above on first use (``flatcomm.ddp.register(...)`` after
    ``import flatcomm``), so that importing the kernels stays light. An old module name
    (``_compat.MOVED``) imports its new module with a ``DeprecationWarning``."""
    if name in _SUBMODULES or name in _compat.MOVED:
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
    "cuda_path",
    "decode",
    "decode_rows",
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
