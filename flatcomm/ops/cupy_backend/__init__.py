"""Optional CUDA path without a CUDA build: the same kernels, compiled at run time by NVRTC via cupy.

When flatcomm._C was built without CUDA (a CPU build of the extension, or no nvcc at install time)
but torch has CUDA and cupy is installed (``pip install "flatcomm[cupy-cuda12]"`` or ``cupy-cuda13``), ``import flatcomm`` calls
:func:`auto_register`, which (with ``FLATCOMM_CUPY=1``: the path is opt-in until a GPU run has
passed) calls :func:`register`, which registers a CUDA implementation of every flatcomm op with torch. Each one
does what csrc/ops_impl.h does (same argument checks, same error messages, same allocations), then
launches the kernels of csrc/cuda/device.cuh, compiled by NVRTC through cupy's compiler:

* the source is device.cuh with its quoted includes inlined (:func:`nvrtc_source`): the very file
  nvcc compiles through kernels.cu, so the two paths share every kernel body; the kernels are
  template instances picked by name (:func:`kernel_names`), never copies;
* options :data:`NVRTC_OPTIONS` keep the numerics contract (``--fmad=false``, IEEE division, no
  flush-to-zero), so results are bitwise equal to the compiled kernels and to the CPU; they reach
  NVRTC as given (not through ``cupy.RawModule``, which adds ``-ftz=true``: :mod:`.nvrtc_cache`);
* kernels compile lazily, a few related instances per module (:func:`module_of`); the binaries are
  cached on disk (:func:`.nvrtc_cache.cache_dir`), keyed by the whole source, so a changed header
  recompiles;
* launches go to torch's current stream (``cupy.cuda.ExternalStream``) with raw data pointers of
  the torch tensors (zero copy), the launch shapes of csrc/cuda/kernels.cu (:class:`Launches`).

Nothing here needs a GPU until a kernel is launched: tests/test_cupy_backend.py runs the argument
checks and launch plans on the CPU with a recording launcher, tests/test_nvrtc.py compiles the
source with NVRTC, and benchmarks/gpu_check.py compares this path bit for bit with the compiled one.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

# Every name of the submodules, for callers and tests that reach them through this package.
from .kernels import *  # noqa: F401,F403
from .launches import *  # noqa: F401,F403
from .ops import *  # noqa: F401,F403
from .kernels import NVRTC_OPTIONS, module_of, modules, nvrtc_source
from .launches import Launches
from .nvrtc_cache import compile_group
from .ops import OP_NAMES, Ops, _check

# The entry points; the constants and helpers of the submodules are re-exported for the tests.
__all__ = ["CupyLauncher", "LaunchError", "Launches", "Ops", "auto_register", "csrc_dir", "cuda_path",
           "kernel_names", "make_ops", "modules", "nvrtc_source", "register", "should_register", "smoke_test"]

# ---- the cupy launcher ----------------------------------------------------------------------------

class CupyLauncher:
    """Compiles (lazily, per module_of group and device) and launches on torch's current stream."""

    def __init__(self, root: Optional[Path] = None) -> None:
        import cupy  # noqa: F401  (fail early with ImportError when cupy is missing)
        import cupy.cuda.compiler  # noqa: F401  (compile_group's NVRTC entry)
        import cupy.cuda.function  # noqa: F401  (Module)

        self.cupy = cupy
        self.root = root
        self._source: Optional[str] = None
        self._modules: Dict[Tuple[int, str], Tuple[Any, Dict[str, str]]] = {}  # (module, lowered names)
        self._functions: Dict[Tuple[int, str], object] = {}
        self._streams: Dict[Tuple[int, int], object] = {}
        self._lock = threading.Lock()
        self._groups = modules()

    def source(self) -> str:
        if self._source is None:
            self._source = nvrtc_source(self.root)
        return self._source

    def function(self, name: str, device: int):
        key = (device, name)
        f = self._functions.get(key)
        if f is None:
            with self._lock:
                group = module_of(name)
                entry = self._modules.get((device, group))
                if entry is None:
                    with self.cupy.cuda.Device(device):
                        arch = self.cupy.cuda.Device(device).compute_capability
                        binary, lowered = compile_group(self.cupy, self.source(), NVRTC_OPTIONS, arch,
                                                        self._groups[group])
                        module = self.cupy.cuda.function.Module()
                        module.load(binary)
                    entry = self._modules[(device, group)] = (module, lowered)
                module, lowered = entry
                with self.cupy.cuda.Device(device):
                    f = module.get_function(lowered[name])
                self._functions[key] = f
        return f

    def _stream(self):
        s = torch.cuda.current_stream()
        key = (s.device.index, s.cuda_stream)
        cs = self._streams.get(key)
        if cs is None:
            cs = self.cupy.cuda.ExternalStream(s.cuda_stream, s.device.index)
            self._streams[key] = cs
        return s.device.index, cs

    def run(self, name: str, grid: int, threads: int, smem: int, args: Tuple[object, ...]) -> None:
        device, cs = self._stream()
        f = self.function(name, device)
        with self.cupy.cuda.Device(device), cs:
            f((grid,), (threads,), args, shared_mem=smem)

    def memset(self, ptr: int, nbytes: int) -> None:
        """cudaMemsetAsync on torch's current stream."""
        self.cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, torch.cuda.current_stream().cuda_stream)

    def precompile(self, device: int = 0) -> int:
        """Compile every module now (e.g. before timing); returns the number of kernels."""
        for names in self._groups.values():
            for n in names:
                self.function(n, device)
        return sum(len(v) for v in self._groups.values())


# ---- registration ---------------------------------------------------------------------------------

_state: Dict[str, Any] = {"path": None, "lib": None, "ops": None, "reason": "not checked", "warned": False}


def should_register(build_devices: Sequence[str], torch_cuda: Optional[str], cupy_found: bool,
                    env: Optional[str]) -> Tuple[bool, str]:
    """Whether the cupy path takes the CUDA ops, and why (or why not). env: $FLATCOMM_CUPY."""
    if "cuda" in build_devices:
        return False, "compiled CUDA kernels present"
    if torch_cuda is None:
        return False, "torch has no CUDA"
    if not cupy_found:
        return False, "cupy is not installed (pip install \"flatcomm[cupy-cuda12]\" or \"flatcomm[cupy-cuda13]\", torch's CUDA)"
    if env is None or env.strip() != "1":
        # Opt-in until benchmarks/gpu_check.sh has passed on a GPU with this path.
        return False, "the NVRTC path is opt-in until a GPU run has checked it: set FLATCOMM_CUPY=1"
    return True, "nvrtc (cupy)"


def env_warning(env: Optional[str], ok: bool, reason: str) -> Optional[str]:
    """Why ``FLATCOMM_CUPY=env`` is not honoured and what runs instead; None when it is (or asks nothing).

    Args:
        env: the variable's value (None: unset).
        ok, reason: :func:`should_register`'s answer.
    """
    value = (env or "").strip()
    if ok or value in ("", "0"):
        return None
    if value != "1":
        return f"flatcomm: FLATCOMM_CUPY={value!r} is neither 1 (on) nor 0 (off): the cupy path stays off"
    if reason.startswith("compiled"):
        instead = "the compiled CUDA kernels run instead"
    elif reason.startswith("torch has no CUDA"):
        instead = f"this torch ({torch.__version__}) is a CPU build, so flatcomm runs on the CPU only"
    else:
        instead = "CUDA tensors get no flatcomm kernels (CPU tensors run as before)"
    return f"flatcomm: FLATCOMM_CUPY=1 is ignored ({reason}): {instead}"


def make_ops(launcher=None) -> Ops:
    launcher = launcher if launcher is not None else CupyLauncher()
    return Ops(Launches(launcher.run, launcher.memset))


def register(ops: Optional[Ops] = None, key: str = "CUDA"):
    """Register `ops` (default: the cupy launcher's) for every flatcomm op under dispatch `key`.
    Returns the torch.library.Library holding the registrations: it stays registered while that
    object lives; `lib._destroy()` removes them again (a kernel it overrode comes back)."""
    ops = ops if ops is not None else make_ops()
    lib = torch.library.Library("flatcomm", "IMPL")
    for name in OP_NAMES:
        lib.impl(name, getattr(ops, name), key)
    return lib


def _lazy_ops() -> Ops:
    if _state["ops"] is None:
        _state["ops"] = make_ops()
    return _state["ops"]


class _LazyOps:
    """Forwards each op to the cupy Ops created on first use (cupy imports only then)."""

    def __getattr__(self, name: str):
        if name not in OP_NAMES:
            raise AttributeError(name)
        return lambda *args: getattr(_lazy_ops(), name)(*args)


def auto_register(build_devices: Sequence[str]) -> str:
    """Called by ``import flatcomm`` (the package facade, above the ops): registers the cupy path when it should. Returns the CUDA
    path in use: 'compiled', 'nvrtc (cupy)' or 'none (<reason>)'."""
    import importlib.util

    if "cuda" in build_devices:
        _state.update(path="compiled", reason="compiled CUDA kernels present")
        return "compiled"
    env = os.environ.get("FLATCOMM_CUPY")
    ok, reason = should_register(build_devices, torch.version.cuda, importlib.util.find_spec("cupy") is not None, env)
    ignored = env_warning(env, ok, reason)
    if ignored and not _state["warned"]:  # once per process
        _state["warned"] = True
        warnings.warn(ignored, RuntimeWarning, stacklevel=2)
    if ok:
        _state.update(path="nvrtc (cupy)", lib=register(_LazyOps()), reason=reason)  # type: ignore[arg-type]  # an Ops by duck typing
    else:
        _state.update(path=f"none ({reason})", reason=reason)
    return _state["path"]


def cuda_path() -> str:
    return _state["path"] or "none"


def smoke_test() -> str:
    """For benchmarks/gpu_check.sh: one int8 encode + decode through this path on cuda:0, compared
    with the CPU kernels bit for bit. Raises on a mismatch."""
    torch_ops = torch.ops.flatcomm  # the CPU kernels

    ops = make_ops()
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    r = torch.zeros_like(x)
    ref = torch_ops.encode(x, "int8", 256, 0, r, False, 0)
    rd = r.new_zeros(r.shape).cuda()
    got = ops.encode(x.cuda(), "int8", 256, 0, rd, False, 0)
    _check(torch.equal(ref, got.cpu()) and torch.equal(r.view(torch.int32), rd.cpu().view(torch.int32)),
           "flatcomm: cupy int8 encode differs from the CPU")
    return "int8 encode + EF bitwise equal to the CPU"
