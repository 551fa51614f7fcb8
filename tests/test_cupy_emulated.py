"""The cupy path end to end without a GPU: its ops (flatcomm/cupy_backend.py) launch the real CUDA
kernels of csrc/cuda/device.cuh on the CPU emulator (tests/cuda_emu) and must match the CPU ops.

What this adds to test_cupy_backend.py (launch shapes recorded, nothing run) and test_nvrtc.py
(parameter sizes from the PTX): the Python host side's argument structs, flags, scratch layout and
memsets drive the kernels and produce the right bits. Compared like benchmarks/gpu_check.py:
bitwise, except that any NaN equals any NaN in values (csrc/cuda/README.md). Needs g++ (the
emulated kernels are compiled once into build/cuda_emu_py/, about a minute).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flatcomm
from flatcomm.ops import cupy_backend as cb
from flatcomm.ops.codecs import CODECS, STOCHASTIC, Codec

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"
sys.path.insert(0, str(EMU))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check_common as gpu_check  # noqa: E402  (bits / _both_nan: the GPU check's comparison)
import translate  # noqa: E402

ops = torch.ops.flatcomm
REENCODE = tuple(c for c in CODECS if Codec(c).reencodes_fused)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _build_inputs():
    csrc = ROOT / "csrc"
    files = [EMU / f for f in ("cuda_emu.h", "cuda_emu.cpp", "launch_by_name.cpp", "translate.py")]
    files += sorted((csrc / "core").glob("*.h")) + [csrc / "cuda" / "device.cuh", csrc / "cuda" / "kernels.cuh",
                                                     csrc / "cpu" / "kernels.h"]
    return files


@pytest.fixture(scope="module")
def emu_lib():
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the emulated kernels cannot be built")
    names = cb.kernel_names()
    h = hashlib.sha256("\n".join(names).encode())
    for f in _build_inputs():
        h.update(f.read_bytes())
    out = ROOT / "build" / "cuda_emu_py" / h.hexdigest()[:16]
    lib_path = out / "libfc_emu.so"
    if not lib_path.exists():
        translate.main(str(ROOT / "csrc"), str(out))
        (out / "kernel_table.inc").write_text("".join(f'FC_EMU_KERNEL("{n}", {n})\n' for n in names))
        tmp = out / "libfc_emu.so.tmp"
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-w", f"-I{EMU}",
               f"-I{out}", f"-I{ROOT / 'csrc'}", str(EMU / "launch_by_name.cpp"), str(EMU / "cuda_emu.cpp"),
               "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        tmp.rename(lib_path)
    lib = ctypes.CDLL(str(lib_path))
    lib.fc_emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    lib.fc_emu_seed(ctypes.c_ulonglong(int(torch.randint(0, 2**62, (1,)))))
    assert lib.fc_emu_kernel_count() == len(names) == 133
    return lib


class EmuLauncher:
    """Stands in for CupyLauncher: each launch runs the named kernel on the emulator, with the
    arguments' bytes exactly as cupy would pass them (numpy scalars and structured arrays)."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self.launched = set()

    def run(self, name, grid, threads, smem, args):
        raw = [np.ascontiguousarray(np.asarray(a)).tobytes() for a in args]
        bufs = [ctypes.create_string_buffer(b, len(b)) for b in raw]  # malloc'd: 16-byte aligned
        argv = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        sizes = (ctypes.c_size_t * len(bufs))(*[len(b) for b in raw])
        rc = self.lib.fc_emu_launch(name.encode(), grid, threads, smem, argv, sizes, len(bufs))
        assert rc == 0, f"{name}: emulated launch returned {rc} (see cuda_emu's message above)"
        self.launched.add(name)

    def memset(self, ptr, nbytes):
        ctypes.memset(ptr, 0, nbytes)


@pytest.fixture(scope="module")
def emu(emu_lib):
    return cb.make_ops(EmuLauncher(emu_lib))


def values(n, g, dtype=torch.float32, specials=True):
    """Normal values at a random scale; with specials an all-zero run, +-inf, NaN, a huge value."""
    x = torch.randn(n, generator=g) * float(10.0 ** torch.randint(-3, 4, (1,), generator=g))
    if specials and n > 8:
        s = int(torch.randint(0, n - 8, (1,), generator=g))
        x[s:s + min(300, n - s)] = 0.0
        for v in (math.inf, -math.inf, math.nan, 3e38):
            x[int(torch.randint(0, n, (1,), generator=g))] = v
    return x.to(dtype)


def same(ref, got, layout=None):
    """gpu_check's comparison: bitwise, any NaN equal to any NaN in values."""
    assert ref.dtype == got.dtype and ref.shape == got.shape
    differ = (gpu_check.bits(ref) != gpu_check.bits(got)).reshape(-1) & ~gpu_check._both_nan(ref, got, layout)
    return not bool(differ.any())


def k_of(codec, n, block):
    return flatcomm.resolve(codec, block, 0.3).k(n)  # topk: kept count; sparse: per chunk; else 0


@pytest.fixture
def gen():
    seed = int(torch.randint(0, 2**62, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_encode_and_decode(emu, gen, codec, dtype):
    for i, n in enumerate((1, 97, 4099)):
        block = (32, 256, 96)[i]
        k = k_of(codec, n, block)
        x = values(n, gen, dtype)
        r0 = values(n, gen, specials=False) * 0.01
        stoch = codec in STOCHASTIC and i % 2 == 1
        ra, rb = r0.clone(), r0.clone()
        pa = ops.encode(x, codec, block, k, ra, stoch, 7 + i)
        pb = emu.encode(x, codec, block, k, rb, stoch, 7 + i)
        lay = (n, codec, block, k)
        assert same(pa, pb, lay), f"payload n={n}"
        assert same(ra, rb), f"residual n={n}"
        for odt in DTYPES:
            da, db = ops.decode(pa, codec, n, block, k, odt), emu.decode(pa, codec, n, block, k, odt)
            assert same(da, db), f"decode n={n} -> {odt}"
    # the out variants, into poisoned buffers, with x, residual and out one element off 16-byte
    # alignment (the kernels' scalar paths)
    n, block = 1031, 64
    k = k_of(codec, n, block)
    x = misaligned(values(n, gen, dtype))
    r0 = values(n, gen, specials=False) * 0.01
    ra, rb = r0.clone(), misaligned(r0)
    pa = ops.encode(x, codec, block, k, ra, False, 0)
    pb = torch.full_like(pa, 0xFF)
    emu.encode_into(x, codec, block, k, rb, False, 0, pb)
    assert same(pa, pb, (n, codec, block, k)) and same(ra, rb)
    out = misaligned(torch.full((n,), math.nan, dtype=dtype))
    emu.decode_into(pa, codec, n, block, k, out)
    assert same(ops.decode(pa, codec, n, block, k, dtype), out)


# encode_kernel's register paths (int8 / int4 from x or decoded rows, sign from x) take blocks up to
# 512; 544 takes the shared-memory path. Both must give the CPU's bits at and around the boundary.
REGISTER_CODECS = ("int8", "int4", "sign")


@pytest.mark.parametrize("codec", REGISTER_CODECS)
@pytest.mark.parametrize("block", [32, 256, 512, 544])
def test_register_path_blocks(emu, gen, codec, block):
    for i, n in enumerate((1, 5, block - 1, block + 3, 3 * block + 1, 8 * block)):
        dtype = DTYPES[i % len(DTYPES)]
        x0 = values(n + 1, gen, dtype, specials=i % 2 == 0)
        r0 = values(n + 1, gen, specials=False) * 0.01
        for mis in (False, True):
            x = x0[1:] if mis else x0[:n]
            for with_res in (True, False):
                stoch = codec in STOCHASTIC and (i + with_res) % 2 == 1
                ra, rb = (r0[1:] if mis else r0[:n]).clone(), r0.clone()[1:] if mis else r0.clone()[:n]
                pa = ops.encode(x, codec, block, 0, ra if with_res else None, stoch, 11 + i)
                pb = emu.encode(x, codec, block, 0, rb if with_res else None, stoch, 11 + i)
                assert same(pa, pb, (n, codec, block, 0)), (n, dtype, mis, with_res, stoch)
                assert same(ra, rb), (n, dtype, mis, with_res, stoch)


@pytest.mark.parametrize("out_codec", REGISTER_CODECS)
@pytest.mark.parametrize("block", [256, 512, 544])
def test_register_path_reencode(emu, gen, out_codec, block):
    for src in ("int8", "fp32", "topk", "sign"):
        n, rows = 2 * block + 7, 3
        k = k_of(src, n, block)
        P = torch.stack([ops.encode(values(n, gen), src, block, k, None, False, 0) for _ in range(rows)])
        ra = values(n, gen, specials=False) * 0.01
        rb = ra.clone()
        a = ops.decode_sum_encode(P, src, n, block, k, 0.25, out_codec, block, ra, False, 3)
        b = emu.decode_sum_encode(P, src, n, block, k, 0.25, out_codec, block, rb, False, 3)
        assert same(a, b, (n, out_codec, block, 0)) and same(ra, rb), (src, out_codec)


def misaligned(t):
    """A copy of t one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:]
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.parametrize("codec", REENCODE)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_decode_rows(emu, gen, codec, dtype):
    """Rows into one output, the last one cut short, into a view of a poisoned buffer whose tail
    (past out's end) must stay untouched; aligned rows (vector path) and odd ones."""
    for rows, m, block, cut in ((1, 1, 32, 0), (3, 97, 32, 40), (4, 1024, 256, 5), (2, 1000, 64, 999)):
        P = torch.stack([ops.encode(values(m, gen), codec, block, 0, None, False, 0) for _ in range(rows)])
        n = rows * m - cut
        for offset in (0, 1):
            buf = torch.full((n + 8 + offset,), math.nan, dtype=dtype)
            out = buf[offset:offset + n]
            emu.decode_rows_into(P, codec, m, block, out)
            ref = torch.full_like(out, math.nan)
            ops.decode_rows_into(P, codec, m, block, ref)
            assert same(ref, out), f"rows={rows} m={m} offset={offset}"
            assert torch.isnan(buf[offset + n:].float()).all() and (offset == 0 or torch.isnan(buf[0]))


@pytest.mark.parametrize("codec", CODECS)
def test_decode_sum_and_reencode(emu, gen, codec):
    for n, rows, block in ((33, 1, 32), (4099, 3, 256)):
        k = k_of(codec, n, block)
        P = torch.stack([ops.encode(values(n, gen), codec, block, k, None, False, 0) for _ in range(rows)])
        assert same(ops.decode_sum(P, codec, n, block, k, 0.5), emu.decode_sum(P, codec, n, block, k, 0.5))
        out = torch.full((n,), math.nan)
        emu.decode_sum_into(P, codec, n, block, k, 1.0, out)
        assert same(ops.decode_sum(P, codec, n, block, k, 1.0), out)
        for j, oc in enumerate(REENCODE if not Codec(codec).chunked else ()):  # chunked rows: not fused
            ob = (32, 64, 256)[j % 3]
            r0 = values(n, gen, specials=False) * 0.01
            ra, rb = r0.clone(), r0.clone()
            stoch = oc in STOCHASTIC and j % 2 == 0
            a = ops.decode_sum_encode(P, codec, n, block, k, 0.25, oc, ob, ra, stoch, 3)
            b = emu.decode_sum_encode(P, codec, n, block, k, 0.25, oc, ob, rb, stoch, 3)
            assert same(a, b, (n, oc, ob, 0)), f"{codec} -> {oc} n={n}"
            assert same(ra, rb), f"{codec} -> {oc} residual n={n}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_sums_and_exact(emu, gen, dtype):
    for n, rows, block in ((1, 2, 7), (4099, 3, 256), (1000, 5, 1)):
        X = torch.stack([values(n, gen, dtype) for _ in range(rows)])
        assert same(ops.ordered_sum(X), emu.ordered_sum(X))
        assert torch.equal(ops.exact_exponents(X, block), emu.exact_exponents(X, block))
        for headroom in (12, 3):
            assert same(ops.exact_sum(X, block, headroom), emu.exact_sum(X, block, headroom))
        Xf = torch.stack([values(n, gen, dtype, specials=False) for _ in range(rows)])
        E = ops.exact_exponents(Xf, block)
        E = E.amax(0) if E.dim() > 1 else E  # per row, or already the max over the rows
        acc = ops.to_exact(Xf[0], E, block, 12)
        assert torch.equal(acc, emu.to_exact(Xf[0], E, block, 12))
        assert same(ops.from_exact(acc, E, block, 12), emu.from_exact(acc, E, block, 12))


def test_every_kernel_ran(emu):
    """Runs last in this module: the cases above launched every one of the 133 kernels."""
    missing = set(cb.kernel_names()) - emu.k.run.__self__.launched
    assert not missing, sorted(missing)
