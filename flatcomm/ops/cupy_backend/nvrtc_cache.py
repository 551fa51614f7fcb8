"""Compile a group of kernel instances with NVRTC, exactly with our options, and cache the binary.

Not ``cupy.RawModule``: RawModule appends ``-ftz=true`` after the caller's options (cupy 14,
cupy/cuda/compiler.py ``_compile_with_cache_cuda``) and NVRTC keeps the last value, so every kernel
flushed subnormals to zero. The first GPU run (H200, cupy 14.2) found 292 checks of this path off
the CPU's bits, each a subnormal (ordered_sum of two subnormals gave 0), while the compiled kernels
matched. ``cupy.cuda.compiler.compile_using_nvrtc`` compiles with the options given, adding only
the target architecture and the device-by-default flag.

The binaries are cached on disk ($FLATCOMM_KERNEL_CACHE, else ~/.cache/flatcomm/nvrtc), keyed by
the whole source, the options, the architecture, the instances and the compiler's version: a
changed header recompiles. A cache that cannot be read or written is only a slower start.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Sequence, Tuple

__all__ = ["CACHE_FORMAT", "cache_dir", "cache_key", "compile_group", "compiler_id"]

CACHE_FORMAT = "1"  # bump when the files' layout changes


def cache_dir() -> Path:
    env = os.environ.get("FLATCOMM_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flatcomm" / "nvrtc"


def compiler_id(cupy) -> str:
    try:
        nvrtc = ".".join(str(v) for v in cupy.cuda.nvrtc.getVersion())
    except Exception:  # an older cupy without the binding: its own version still keys the cache
        nvrtc = "unknown"
    return f"cupy {cupy.__version__} nvrtc {nvrtc}"


def cache_key(source: str, options: Sequence[str], arch: str, names: Sequence[str], compiler: str) -> str:
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, compiler, arch, *options, "|", *names, "|", source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _load(path: Path, names: Sequence[str]):
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        binary = path.read_bytes()
    except (OSError, ValueError):
        return None
    mapping = meta.get("lowered") if isinstance(meta, dict) else None
    if not isinstance(mapping, dict) or set(mapping) != set(names) or \
            hashlib.sha256(binary).hexdigest() != meta.get("sha256"):
        return None  # torn or foreign files: compile again
    return binary, mapping


def _store(path: Path, binary: bytes, mapping: Dict[str, str]) -> None:
    meta = json.dumps({"lowered": mapping, "sha256": hashlib.sha256(binary).hexdigest()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, data in ((path, binary), (path.with_suffix(".json"), meta.encode())):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)  # readers see a whole file or none
    except OSError:
        pass


def compile_group(cupy, source: str, options: Sequence[str], arch: str,
                  names: Sequence[str]) -> Tuple[bytes, Dict[str, str]]:
    """(cubin or PTX, {name expression: lowered name}) of the instances `names` of `source`."""
    path = cache_dir() / (cache_key(source, options, arch, names, compiler_id(cupy)) + ".bin")
    hit = _load(path, names)
    if hit is not None:
        return hit
    binary, mapping = cupy.cuda.compiler.compile_using_nvrtc(
        source, tuple(options), arch, name_expressions=list(names))
    if isinstance(binary, str):
        binary = binary.encode()
    mapping = {name: mapping[name] for name in names}
    _store(path, binary, mapping)
    return binary, mapping
