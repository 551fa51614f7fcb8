"""The cupy path's kernel source compiles with NVRTC, exactly as flatcomm/cupy_backend.py compiles it.

No GPU needed: NVRTC only compiles (to PTX). libnvrtc comes from $FLATCOMM_NVRTC, the
nvidia-cuda-nvrtc wheel (`make cuda-check` installs it into .venv) or the CUDA toolkit; without it
these tests skip. Checked: every kernel instance the launches use compiles for compute_80 and
compute_90 (cupy compiles the same source with subsets of these names); the kernel parameter structs have the sizes and
offsets the Python side packs; every launch's argument sizes match the kernel's PTX parameters.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from flatcomm.ops import cupy_backend as cb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support.cupy import record_all_launches  # noqa: E402


def _candidates():
    env = os.environ.get("FLATCOMM_NVRTC")
    if env:
        yield env
    for sp in sys.path + [str(ROOT / ".venv")]:
        for pat in ("nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*",
                    "lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.*"):
            yield from sorted(glob.glob(os.path.join(sp, pat)))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            yield from sorted(glob.glob(os.path.join(home, "lib*", "libnvrtc.so*")))


def load_nvrtc():
    """(library, path) or (None, reason)."""
    tried = []
    for path in _candidates():
        if "builtins" in path or "alt" in os.path.basename(path) or not os.path.isfile(path):
            continue
        tried.append(path)
        d = os.path.dirname(path)
        try:
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.*"))):  # NVRTC dlopens it
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                    break
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"({e})")
    return None, "libnvrtc not found (pip install nvidia-cuda-nvrtc, or `make cuda-check`); tried: " + \
        (", ".join(tried) or "nothing")


LIB, WHERE = load_nvrtc()
pytestmark = pytest.mark.skipif(LIB is None, reason=str(WHERE))


def nvrtc_compile(src: str, options, names=()):
    """(ok, log, ptx, {name expression: lowered name})."""
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"flatcomm_rtc.cu", 0, None, None) == 0
    try:
        for n in names:
            assert LIB.nvrtcAddNameExpression(prog, n.encode()) == 0, n
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = LIB.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        LIB.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        LIB.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            return False, log.value.decode(errors="replace"), "", {}
        LIB.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        LIB.nvrtcGetPTX(prog, ptx)
        lowered = {}
        for n in names:
            p = ctypes.c_char_p()
            assert LIB.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(p)) == 0, n
            lowered[n] = p.value.decode()
        return True, log.value.decode(errors="replace"), ptx.value.decode(), lowered
    finally:
        LIB.nvrtcDestroyProgram(ctypes.byref(prog))


def ptx_params(ptx: str):
    """{entry: [param byte sizes]} from the PTX of a program."""
    sizes = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4, "f32": 4,
             "u64": 8, "s64": 8, "b64": 8, "f64": 8}
    out = {}
    for m in re.finditer(r"\.entry (\S+)\((.*?)\)", ptx, re.S):
        ps = []
        for p in re.finditer(r"\.param (?:\.align \d+ )?\.(\w+) \S+?(?:\[(\d+)\])?\s*(?:,|$)", m.group(2)):
            ps.append(sizes[p.group(1)] * (int(p.group(2)) if p.group(2) else 1))
        out[m.group(1)] = ps
    return out


@pytest.fixture(scope="module")
def source():
    return cb.nvrtc_source()


def test_source_is_self_contained(source):
    assert "#include" not in re.sub(r"//.*", "", source)
    assert "flatcomm::gpu::kern" not in source or "namespace kern" in source


@pytest.fixture(scope="module")
def compiled_90(source):
    """Every kernel instance compiled for compute_90 in one program. (cupy compiles the same source
    per module group, with a subset of these name expressions: if the whole compiles, each does.)"""
    ok, log, ptx, lowered = nvrtc_compile(source, cb.NVRTC_OPTIONS + ("--gpu-architecture=compute_90",),
                                          cb.kernel_names())
    assert ok, f"NVRTC failed:\n{log[-4000:]}"
    assert "error" not in log.lower(), log[-4000:]
    return ptx, lowered


def test_every_kernel_compiles_for_compute_90(compiled_90):
    ptx, lowered = compiled_90
    entries = ptx_params(ptx)
    for name in cb.kernel_names():
        assert lowered[name] in entries, f"{name} ({lowered[name]}) missing from the PTX"
    assert len(lowered) == len(cb.kernel_names()) == 133
    assert sorted(n for names in cb.modules().values() for n in names) == sorted(cb.kernel_names())


def test_all_kernels_compile_for_compute_80(source):
    ok, log, ptx, lowered = nvrtc_compile(source, cb.NVRTC_OPTIONS + ("--gpu-architecture=compute_80",),
                                          cb.kernel_names())
    assert ok, log[-4000:]
    assert all(lowered[n] in ptx_params(ptx) for n in cb.kernel_names())


def test_numerics_options_are_there():
    opts = " ".join(cb.NVRTC_OPTIONS)
    for o in ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "-std=c++17"):
        assert o in opts


STRUCT_TYPES = {"EncodeParams": "flatcomm::gpu::kern::EncodeParams", "DecodeSumArgs": "flatcomm::DecodeSumArgs",
                "OrderedSumArgs": "flatcomm::OrderedSumArgs", "ExactArgs": "flatcomm::ExactArgs",
                "XSource<0>": "flatcomm::gpu::kern::XSource<0>", "SumSource<0>": "flatcomm::gpu::kern::SumSource<0>"}


def _fields():
    """(struct key, dotted field, offset the Python side packs at) for every field."""
    for key, dt in cb.STRUCTS.items():
        for f in dt.names:
            sub, off = dt.fields[f][0], dt.fields[f][1]
            if sub.names:
                for g in sub.names:
                    yield key, f"{f}.{g}", off + sub.fields[g][1]
            else:
                yield key, f, off


def _probes():
    """One tiny kernel per field that reads only that field of a by-value struct parameter: NVRTC has
    no offsetof, but the PTX load names the field's byte offset in the parameter ([param_0+OFF])."""
    lines = []
    for i, (key, f, _) in enumerate(_fields()):
        lines.append(f"extern \"C\" __global__ void fc_probe_{i}({STRUCT_TYPES[key]} p, unsigned long long* o) "
                     f"{{ *o = (unsigned long long)(p.{f}); }}")
    return "\n".join(lines)


def _probed_offset(body: str, name: str) -> int:
    """Byte offset in param_0 of the one value the probe reads (a vector load reads neighbours too:
    the register used afterwards is the field)."""
    sizes = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4,
             "f32": 4, "u64": 8, "s64": 8, "b64": 8}
    found = []
    for m in re.finditer(r"ld\.param(?:\.v(\d))?\.(\w+)\s+(\{[^}]*\}|%\w+), \[" + name +
                         r"_param_0(?:\+(\d+))?\];", body):
        regs = [r.strip() for r in m.group(3).strip("{}").split(",")]
        rest = body[m.end():]
        used = [i for i, r in enumerate(regs) if re.search(re.escape(r) + r"\b", rest)]
        for i in used:
            found.append(int(m.group(4) or 0) + i * sizes[m.group(2)])
    assert len(found) == 1, body
    return found[0]


def test_struct_layouts_match_the_device(source):
    ok, log, ptx, _ = nvrtc_compile(source + "\n" + _probes() + "\n",
                                    cb.NVRTC_OPTIONS + ("--gpu-architecture=compute_90",))
    assert ok, log[-4000:]
    entries = ptx_params(ptx)
    for i, (key, f, off) in enumerate(_fields()):
        name = f"fc_probe_{i}"
        assert entries[name][0] == cb.STRUCTS[key].itemsize, f"sizeof {key}"
        body = ptx[ptx.index(f".entry {name}("):]
        body = body[:body.index("\n}")]
        assert _probed_offset(body, name) == off, f"{key}.{f}: Python packs it at byte {off}"


def _arg_size(a) -> int:
    return a.dtype.itemsize if isinstance(a, np.ndarray) else np.asarray(a).dtype.itemsize


def test_launch_arguments_match_kernel_parameters(compiled_90):
    ptx, lowered = compiled_90
    entries = ptx_params(ptx)
    params = {name: entries[low] for name, low in lowered.items()}
    launches = record_all_launches()
    seen = set()
    for name, grid, threads, smem, args in launches:
        got = [_arg_size(a) for a in args]
        assert got == params[name], f"{name}: launch passes {got} bytes, kernel takes {params[name]}"
        # 256 (most), 1024 (the topk scan), whole warps up to 256 (chunked sparse: sparse_threads)
        assert 1 <= grid <= 0x7FFFFFFF and (threads in (256, 1024) or ("sparse_" in name and threads % 32 == 0
                                                                  and 32 <= threads <= 256)) and 0 <= smem <= 16384
        seen.add(name)
    assert seen == set(cb.kernel_names())


# ---- no flush-to-zero ------------------------------------------------------------------------------
# The first GPU run found the NVRTC kernels flushing subnormals: cupy.RawModule appends -ftz=true
# after the caller's options. The PTX says which: an f32 instruction with .ftz flushes.

def test_no_kernel_flushes_subnormals(compiled_90):
    ptx, _ = compiled_90
    assert "add.rn.f32" in ptx and "mul.rn.f32" in ptx
    assert ".ftz" not in ptx, sorted({line.split()[0] for line in ptx.splitlines() if ".ftz" in line})


@pytest.fixture
def cupy_compiler(monkeypatch, tmp_path):
    """cupy's compiler (from `make cuda-check`'s build/cupy-site), compiling to PTX for compute_90.
    With no GPU driver here its architecture lookup (which asks the current device) is replaced;
    everything else is cupy's own route."""
    cupy = pytest.importorskip("cupy", reason="cupy not installed (`make cuda-check` puts it in build/cupy-site)")
    from cupy.cuda import compiler
    if not hasattr(compiler, "_get_arch_for_options_for_nvrtc"):
        pytest.skip(f"cupy {cupy.__version__} has no _get_arch_for_options_for_nvrtc to redirect")
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=compute_{arch}", "ptx"))
    monkeypatch.setenv("FLATCOMM_KERNEL_CACHE", str(tmp_path))
    return cupy


def test_cupy_route_compiles_with_our_options_only(cupy_compiler, source):
    from flatcomm.ops.cupy_backend import nvrtc_cache
    names = cb.modules()["sums_0"]
    ptx, lowered = nvrtc_cache.compile_group(cupy_compiler, source, cb.NVRTC_OPTIONS, "90", names)
    ptx = ptx.decode()
    assert set(lowered) == set(names) and all(lowered[n] in ptx for n in names)
    assert "add.rn.f32" in ptx and ".ftz" not in ptx
    # the check sees a flush when one is asked for (RawModule's extra option)
    flushed, _ = nvrtc_cache.compile_group(cupy_compiler, source, cb.NVRTC_OPTIONS + ("-ftz=true",), "90", names)
    assert "add.rn.ftz.f32" in flushed.decode()
