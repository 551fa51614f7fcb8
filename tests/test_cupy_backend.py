"""The cupy (NVRTC) path's Python side, without a GPU and without cupy.

The ops run on CPU tensors with a recording launcher in place of cupy: nothing is launched, but the
argument checks, allocations, padding, launch shapes and kernel arguments are all exercised. Error
messages are compared with the C++ ops' (the same checks, csrc/ops_common.h); the launch shapes with
those of csrc/cuda/kernels.cu; the RNG key with csrc/core/rng.h compiled by g++.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import flatcomm
from flatcomm.ops import cupy_backend as cb

from _support.cupy import CODECS, k_of, make, payloads, record_all_launches, Recorder

ROOT = Path(__file__).resolve().parents[1]
ops = torch.ops.flatcomm


def test_every_kernel_is_launched_and_every_launched_kernel_is_compiled():
    names = {l[0] for l in record_all_launches()}
    assert names == set(cb.kernel_names())
    assert all(cb.module_of(n) in cb.modules() for n in names)


# ---- launch shapes (csrc/cuda/kernels.cu) --------------------------------------------------------

# Blocks up to 512 take encode_kernel's register path: a warp per block, no shared memory.
@pytest.mark.parametrize("block,wpg,groups,regs", [(32, 1, 8, True), (96, 1, 8, True), (256, 1, 8, True),
                                                   (512, 1, 8, True), (544, 8, 1, False), (4096, 8, 1, False)])
def test_blockwise_encode_shape(block, wpg, groups, regs):
    o, rec = make()
    n = 100_003
    x, r = torch.randn(n), torch.zeros(n)
    o.encode(x, "int8", block, 0, r, True, 5)
    (name, grid, threads, smem, (p, src)), = rec.launches
    assert name == cb.k_encode(cb.INT8, cb.F32)
    assert (threads, smem) == (256, 0 if regs else groups * block * 4)
    assert grid == -(-(-(-n // block)) // groups)
    assert p["warps_per_group"][0] == wpg and p["groups"][0] == groups and p["block"][0] == block
    assert p["n"][0] == n and p["codes_offset"][0] == cb.layout(cb.INT8, n, block, 0)[1]
    assert p["stochastic"][0] and p["key"][0] == cb.seed_key(5)
    assert src["x"][0] == x.data_ptr() and p["residual"][0] == r.data_ptr()


@pytest.mark.parametrize("codec,rows,regs", [("sign", None, True), ("sign", "int8", True), ("int4", "int8", True),
                                             ("int8", "topk", False), ("sign", "topk", False)])
def test_register_path_by_source(codec, rows, regs):
    """int8 / int4 / sign take the register path from x and from decoded rows, but not from topk
    rows (decoded a window at a time)."""
    o, rec = make()
    n, block = 10_001, 256
    if rows is None:
        o.encode(torch.randn(n), codec, block, 0, None, False, 0)
    else:
        k = flatcomm.resolve(rows, block, 0.3).k(n)
        payloads = torch.stack([torch.ops.flatcomm.encode(torch.randn(n), rows, block, k, None, False, 0)] * 2)
        rec.launches.clear()
        o.decode_sum_encode(payloads, rows, n, block, k, 0.5, codec, block, None, False, 0)
    name, grid, threads, smem, (p, _) = rec.launches[-1]
    assert name.startswith(cb.NS + "encode_kernel")
    assert (smem == 0) == regs and p["warps_per_group"][0] == (1 if regs else 8)


def test_cast_encode_shape_and_flags():
    o, rec = make()
    n = 5000
    o.encode(torch.randn(n).half(), "fp16", 0, 0, None, False, 0)
    (name, grid, threads, smem, (p, _)), = rec.launches
    assert name == cb.k_encode(2, cb.F16)
    assert (grid, threads, smem) == (5, 256, 1024 * 4)
    assert p["block"][0] == 1024 and p["groups"][0] == 1 and p["residual"][0] == 0
    assert not p["stochastic"][0]  # only int8 / int4 / bf16 round stochastically


def test_misaligned_input_turns_vector_access_off():
    o, rec = make()
    buf = torch.randn(1001)
    o.encode(buf[1:], "int8", 256, 0, None, False, 0)  # 4-byte offset: not 16-byte aligned
    o.encode(buf[:1000], "int8", 256, 0, None, False, 0)
    (_, _, _, _, (p1, _)), (_, _, _, _, (p2, _)) = rec.launches
    assert not p1["vec"][0]
    assert p2["vec"][0] == (buf.data_ptr() % 16 == 0)


def test_topk_encode_pipeline():
    o, rec = make()
    n = 10_000
    k = 3000
    x, r = torch.randn(n), torch.zeros(n)
    p = o.encode(x, "topk", 0, k, r, False, 0)
    names = [l[0].split("::")[-1].split("<")[0] for l in rec.launches]
    assert names == ["topk_fill_kernel", "topk_select_kernel", "topk_compact_kernel", "topk_select_kernel",
                     "topk_cand_hist_kernel", "topk_select_kernel", "topk_cand_count_kernel", "topk_scan_kernel",
                     "topk_write_kernel"]
    sl = cb.topk_scratch_layout(n)
    (ptr, nbytes), = rec.memsets
    assert nbytes == sl["counts"] - sl["hist"] == 3 * 2048 * 8 + 256
    fill = rec.launches[0]
    scratch = fill[4][3]
    assert fill[1] == min(-(-n // 1024), 1024) and ptr == scratch + sl["hist"]
    write = rec.launches[-1]
    assert write[1] == -(-n // 4096) and write[4][4] == p.data_ptr()
    assert write[4][5] == p.data_ptr() + cb.layout(cb.TOPK, n, 0, k)[1]
    assert rec.launches[7][2] == 1024  # the scan runs on one 1024-thread CTA


def test_topk_scratch_layout_matches_cuh():
    """kernels.cuh topk_scratch_layout, compiled by g++."""
    out = _gxx('#include "cuda/kernels.cuh"\n#include <cstdio>\n#include <initializer_list>\nint main(){for(long long n: {1LL, 4096LL, '
               '4097LL, 1000003LL}){auto l=flatcomm::gpu::topk_scratch_layout(n);std::printf("%lld %lld %lld '
               '%lld %lld %lld\\n",(long long)l.v,(long long)l.hist,(long long)l.state,(long long)l.counts,'
               '(long long)l.cand,(long long)l.total);}}')
    for line, n in zip(out.splitlines(), (1, 4096, 4097, 1000003)):
        s = cb.topk_scratch_layout(n)
        assert [int(v) for v in line.split()] == [s["v"], s["hist"], s["state"], s["counts"], s["cand"], s["total"]]


def test_decode_and_sum_shapes():
    o, rec = make()
    n = 5000
    P = payloads("int4", n, rows=3)
    o.decode(P[0], "int4", n, 256, 0, torch.bfloat16)
    o.decode_sum(P, "int4", n, 256, 0, 0.25)
    o.decode_sum(payloads("topk", n, rows=2), "topk", n, 256, k_of("topk", n), 1.0)
    (n1, g1, _, _, a1), (n2, g2, _, _, a2), (n3, g3, _, _, a3) = rec.launches
    assert n1 == cb.k_t("decode_kernel", cb.INT4, cb.BF16) and g1 == 2  # 16 elements per thread
    assert a1[1] == cb.layout(cb.INT4, n, 256, 0)[1] and a1[2] == 256 and a1[3] == n
    assert n2 == cb.k_t("decode_sum_kernel", cb.INT4) and g2 == 2
    args = a2[0]
    assert (args["rows"][0], args["row_stride"][0], args["scale"][0]) == (3, P.shape[1], np.float32(0.25))
    assert n3 == cb.k_t("topk_decode_kernel", cb.F32) and g3 == 3 and a3[2] == 2


@pytest.mark.parametrize("m,dtype,vec", [(1024, torch.float32, True), (1000, torch.bfloat16, True),
                                         (1004, torch.bfloat16, False), (97, torch.float32, False)])
def test_decode_rows_shape(m, dtype, vec):
    """kernels.cu decode_rows: one launch, 4-element chunks per row, vector access only when every
    output row starts 16-byte aligned."""
    o, rec = make()
    P = payloads("int8", m, rows=5, block=32)
    out = torch.empty(5 * m - 3, dtype=dtype)
    o.decode_rows_into(P, "int8", m, 32, out)
    (name, grid, threads, smem, a), = rec.launches
    assert name == cb.k_t("decode_rows_kernel", cb.INT8, cb.ops._DT_CODE[dtype]) and (threads, smem) == (256, 0)
    assert grid == -(-5 * (-(-m // 4)) // 256)
    assert [int(v) for v in a[:7]] == [P.data_ptr(), P.shape[1], 5, m, 5 * m - 3, cb.layout(cb.INT8, m, 32, 0)[1], 32]
    assert int(a[7]) == out.data_ptr() and bool(a[8]) == vec


def test_exact_shapes():
    o, rec = make()
    X = torch.randn(3, 1000)
    o.exact_exponents(X, 7)
    o.exact_sum(X, 7, 12)
    (n1, g1, _, _, a1), (n2, g2, _, _, a2) = rec.launches
    assert g1 == g2 == -(-(-(-1000 // 7)) // 8)
    assert not a1[1]  # block 7: blocked reads are not 16-byte aligned
    assert a2[0]["precision"][0] == 50 and a2[0]["rows"][0] == 3


def test_seed_key_matches_core_rng():
    seeds = [0, 1, 12345, (1 << 63) + 5, (1 << 64) - 1]
    out = _gxx('#include "core/rng.h"\n#include <cstdio>\nint main(){unsigned long long s[]={' +
               ",".join(f"{s}ull" for s in seeds) +
               '};for(auto v: s) std::printf("%llu\\n",(unsigned long long)flatcomm::core::seed_key(v));}')
    assert [int(v) for v in out.split()] == [cb.seed_key(s) for s in seeds]


def _gxx(code: str) -> str:
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "p.cpp", Path(d) / "p"
        src.write_text(code)
        subprocess.run([gxx, "-std=c++17", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)], check=True)
        return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


# ---- padding: the same bytes zeroed as by the C++ op -----------------------------------------------

@pytest.mark.parametrize("codec", CODECS)
def test_padding_is_zeroed_like_the_cpu_op(codec):
    n = 1001
    k = k_of(codec, n)
    x = torch.randn(n)
    block = 96 if codec in ("int8", "int4", "sign") or flatcomm.resolve(codec).chunked else 0
    ref = ops.encode(x, codec, block, k, None, False, 0)
    buf = torch.full_like(ref, 0xFF)
    o, _ = make()
    o.encode_into(x, codec, block, k, None, False, 0, buf)
    zeroed = buf == 0
    # every byte the Python op zeroed is a padding byte, which the CPU op leaves zero too
    assert torch.all(ref[zeroed] == 0)
    nb, co, total = cb.layout(cb.CODEC_IDS[codec], n, 96, k)
    assert int(zeroed.sum()) > 0 or total == co + (n * 4 if codec == "fp32" else 0) or codec in ("fp32",)


# ---- argument checks: the C++ ops' errors, word for word -----------------------------------------

def _bad_cases():
    x = torch.randn(100)
    p8 = ops.encode(x, "int8", 32, 0, None, False, 0)
    P = p8.unsqueeze(0).repeat(2, 1)
    E = ops.exact_exponents(x, 32)
    return [
        ("encode", (x, "int9", 32, 0, None, False, 0)),
        ("encode", (x.double(), "int8", 32, 0, None, False, 0)),
        ("encode", (x, "int8", 48, 0, None, False, 0)),
        ("encode", (x, "int8", 8192, 0, None, False, 0)),
        ("encode", (x, "topk", 0, 0, None, False, 0)),
        ("encode", (x, "topk", 0, 101, None, False, 0)),
        ("encode", (x, "int8", 32, 0, torch.zeros(99), False, 0)),
        ("encode", (x, "int8", 32, 0, torch.zeros(100).half(), False, 0)),
        ("encode", (x, "int8", 32, 0, torch.zeros(200)[::2], False, 0)),
        ("encode", (x, "sign", 32, 0, None, True, 0)),
        ("encode", (torch.randn(10, 10).t(), "int8", 32, 0, None, False, 0)),
        ("encode_into", (x, "int8", 32, 0, None, False, 0, torch.zeros(5, dtype=torch.uint8))),
        ("encode_into", (x, "int8", 32, 0, None, False, 0, torch.zeros(p8.numel()))),
        ("encode_into", (x, "int8", 32, 0, None, False, 0, P)),
        ("decode", (p8, "int8", 100, 32, 0, torch.int32)),
        ("decode", (p8, "int8", -1, 32, 0, torch.float32)),
        ("decode", (p8, "int8", 10, 32, 0, torch.float32)),
        ("decode_into", (p8, "int8", 100, 32, 0, torch.empty(99))),
        ("decode_into", (p8, "int8", 100, 32, 0, torch.empty(200)[::2])),
        ("decode_rows_into", (P, "topk", 100, 32, torch.empty(200))),
        ("decode_rows_into", (P, "int8", 0, 32, torch.empty(200))),
        ("decode_rows_into", (P, "int8", 100, 48, torch.empty(200))),
        ("decode_rows_into", (P, "int4", 100, 32, torch.empty(200))),
        ("decode_rows_into", (p8, "int8", 100, 32, torch.empty(100))),
        ("decode_rows_into", (P[:0], "int8", 100, 32, torch.empty(100))),
        ("decode_rows_into", (P, "int8", 100, 32, torch.empty(100))),
        ("decode_rows_into", (P, "int8", 100, 32, torch.empty(201))),
        ("decode_rows_into", (P, "int8", 100, 32, torch.empty(200).double())),
        ("decode_rows_into", (P, "int8", 100, 32, torch.empty(400)[::2])),
        ("decode_rows_into", (P.t().contiguous().t(), "int8", 100, 32, torch.empty(200))),
        ("decode_sum", (p8, "int8", 100, 32, 0, 1.0)),
        ("decode_sum", (P, "fp32", 100, 32, 0, 1.0)),
        ("decode_sum_into", (P, "int8", 100, 32, 0, 1.0, torch.empty(100).half())),
        ("decode_sum_encode", (P, "int8", 100, 32, 0, 1.0, "topk", 32, None, False, 0)),
        ("decode_sum_encode", (P, "int8", 100, 32, 0, 1.0, "sign", 32, None, True, 0)),
        ("decode_sum_encode", (P, "int8", 100, 32, 0, 1.0, "int8", 32, torch.zeros(100).half(), False, 0)),
        ("decode_sum_encode", (P, "int8", 100, 32, 0, 1.0, "int8", 32, torch.zeros(7), False, 0)),
        ("decode_sum_encode_into", (P, "int8", 100, 32, 0, 1.0, "int4", 64, None, False, 0, p8)),
        ("ordered_sum", (x,)),
        ("ordered_sum", (torch.randn(2, 4).int(),)),
        ("ordered_sum", (torch.randn(4, 2).t(),)),
        ("exact_exponents", (x, 0)),
        ("exact_exponents", (torch.randn(2, 2, 2), 32)),
        ("to_exact", (x.reshape(10, 10), E, 32, 12)),
        ("to_exact", (x, E, 32, 39)),
        ("to_exact", (x, E.long(), 32, 12)),
        ("to_exact", (x, E[:-1], 32, 12)),
        ("from_exact", (torch.zeros(100), E, 32, 12)),
        ("from_exact", (torch.zeros(100, dtype=torch.int64), E, 5000, 12)),
        ("exact_sum", (x, 32, 12)),
        ("exact_sum", (torch.randn(5, 10), 32, 2)),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_errors_match_the_cpp_ops(i):
    op, args = _bad_cases()[i]
    with pytest.raises(RuntimeError) as cpp:
        getattr(ops, op)(*args)
    o, rec = make()
    with pytest.raises(RuntimeError) as py:
        getattr(o, op)(*args)
    assert str(py.value) == str(cpp.value).splitlines()[0], (str(py.value), str(cpp.value))
    assert not rec.launches


def test_launch_preconditions_raise_before_launching():
    rec = Recorder()
    L = cb.Launches(rec.run, rec.memset)
    with pytest.raises(cb.LaunchError):
        L.encode(dict(x=0, x_dtype=7, residual=0, payload=0, n=10, codec=3, block=32, k=0, stochastic=False,
                      seed=0, scratch=0))
    with pytest.raises(cb.LaunchError):
        L.encode_topk(dict(x=16, x_dtype=0, residual=0, payload=16, n=10, codec=6, block=0, k=3,
                           stochastic=False, seed=0, scratch=8))  # scratch not 16-byte aligned
    assert not rec.launches


# ---- registration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("devices,cuda,found,env,ok", [
    (["cpu", "cuda"], "13.0", True, "1", False),
    (["cpu"], "13.0", True, None, False),  # opt-in until a GPU run has passed
    (["cpu"], "13.0", True, "1", True),
    (["cpu"], "13.0", True, "0", False),
    (["cpu"], None, True, "1", False),
    (["cpu"], "13.0", False, "1", False),
])
def test_should_register(devices, cuda, found, env, ok):
    got, reason = cb.should_register(devices, cuda, found, env)
    assert got == ok and reason


def test_cuda_path_reported():

    path = flatcomm.cuda_path()
    assert flatcomm.build_info()["cuda_path"] == path
    if "cuda" in flatcomm.build_info()["devices"]:
        assert path == "compiled"
    elif torch.version.cuda is None:
        assert path.startswith("none")


def test_registered_ops_take_over_the_dispatch_key_and_give_it_back():
    """The mechanism of register() (and of gpu_check's NVRTC-vs-compiled comparison), shown on the
    CPU key: the Python ops take every flatcomm op over, and the compiled kernels return after."""
    o, rec = make()
    x = torch.randn(3, 50)
    ref = ops.ordered_sum(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib = cb.register(o, key="CPU")
    try:
        ops.ordered_sum(x)  # the recorder does not compute: only check that it was called
        ops.encode(x[0], "int8", 32, 0, None, False, 0)
        assert [l[0][len(cb.NS):].split("<")[0] for l in rec.launches] == ["ordered_sum_kernel",
                                                                                "encode_kernel"]
    finally:
        lib._destroy()
    assert torch.equal(ops.ordered_sum(x), ref)
    assert len(rec.launches) == 2


def test_installed_packages_ship_the_kernel_sources(tmp_path):
    """setup.py's build_py copies the headers into flatcomm/_csrc, so an installed wheel (no source
    checkout) gives NVRTC exactly the source a checkout gives, and csrc_dir() finds them there."""
    import sys

    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    shipped = tmp_path / "flatcomm" / "_csrc"
    assert cb.nvrtc_source(shipped) == cb.nvrtc_source(ROOT / "csrc")
    spec_file = tmp_path / "flatcomm" / "ops" / "cupy_backend" / "kernels.py"
    assert spec_file.is_file()  # the installed module resolves _csrc next to itself
    # Loaded as a module of the flatcomm package (it imports flatcomm._C), from the installed file.
    code = ("import sys, importlib.util, flatcomm; "
            "s = importlib.util.spec_from_file_location('flatcomm.ops.cupy_backend._installed_cb', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print(m.csrc_dir())")
    out = subprocess.run([sys.executable, "-c", code, str(spec_file)], capture_output=True, text=True, cwd=ROOT,
                         env={k: v for k, v in __import__("os").environ.items() if k != "FLATCOMM_CSRC"})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == shipped


# ---- constants and layouts: from flatcomm._C, equal to the C++ sources ---------------------------

def test_constants_are_the_cpp_headers():
    """cupy_backend takes its launch shapes and limits from _C; g++ reads the headers themselves."""
    out = _gxx('#include "cuda/kernels.cuh"\n#include "core/codec.h"\n#include <cstdio>\nusing namespace flatcomm;\n'
               'int main(){std::printf("%d %d %d %lld %d %lld %lld %lld %lld %lld %lld %d %d %d %lld\\n", gpu::kThreads, '
               'gpu::kWarps, gpu::kScanThreads, (long long)gpu::kCastTile, gpu::kTopkTile, (long long)gpu::kMaxGrid, '
               '(long long)gpu::kTopkChunk, (long long)gpu::kTopkBins, (long long)core::kMinBlock, '
               '(long long)core::kMaxBlock, (long long)core::kMaxTopkNumel, (int)core::kF32, (int)core::kBF16, '
               '(int)core::kF16, (long long)gpu::kRegMaxBlock);for(int b=32;b<=4096;b+=32) std::printf(" %d", gpu::sparse_threads(b));std::printf("\\n");for(int c=0;c<=core::kCodecTopK;++c) std::printf("%d ", (int)core::is_blockwise(c));}')
    first, sparse, blockwise = out.splitlines()
    assert [int(v) for v in sparse.split()] == [cb.sparse_threads(b) for b in range(32, 4097, 32)]
    assert [int(v) for v in first.split()] == [
        cb.K_THREADS, cb.K_WARPS, cb.K_SCAN_THREADS, cb.K_CAST_TILE, cb.K_TOPK_TILE, cb.K_MAX_GRID, cb.K_TOPK_CHUNK,
        cb.K_TOPK_BINS, cb.MIN_BLOCK, cb.MAX_BLOCK, cb.MAX_TOPK_NUMEL, cb.F32, cb.BF16, cb.F16, cb.K_REG_MAX_BLOCK]
    assert [c for c, b in enumerate(blockwise.split()) if b == "1"] == list(cb.BLOCKWISE)
    assert list(cb.CODEC_IDS) == list(CODECS) and list(cb.CODEC_IDS.values()) == list(range(len(CODECS)))
    assert [cb.parse_codec(c) for c in CODECS] == list(range(len(CODECS)))
    assert cb.MAX_BLOCK == flatcomm._C.max_block_size()


ODD_SIZES = (1, 31, 33, 255, 1001, 4097, 65537)


@pytest.mark.parametrize("codec", CODECS)
def test_layouts_match_the_payloads_the_ops_write(codec):
    """For every codec and odd sizes: the sizes the cupy path allocates are the C++ ops' payloads, the
    bytes it zeroes are the bytes the C++ op leaves zero, and they carry no data."""
    g = torch.Generator().manual_seed(hash(codec) % 1000)
    c = cb.CODEC_IDS[codec]
    for n in ODD_SIZES:
        for block in ((32, 96, 4096) if c in cb.BLOCKWISE or c in cb.CHUNKED else (0,)):
            k = k_of(codec, n, block) if c in cb.CHUNKED else k_of(codec, n)
            x = torch.randn(n, generator=g)
            ref = ops.encode(x, codec, block, k, None, False, 0)
            nb, co, total = cb.layout(c, n, block, k)
            assert total == ref.numel() == cb.wire_bytes(c, n, block, k)
            assert total == flatcomm._C.wire_bytes(codec, n, block, k)
            lay = flatcomm._C.wire_layout(c, n, block, k)
            assert lay["head_end"] <= co <= lay["data_end"] <= total and total % 16 == 0
            assert nb == (-(-n // block) if c in cb.BLOCKWISE or c in cb.CHUNKED else 0)
            buf = torch.full_like(ref, 0xFF)
            cb.Ops.zero_padding(buf, c, n, block, k)
            padding = buf == 0
            assert int(padding.sum()) == (co - lay["head_end"]) + (total - lay["data_end"]), (n, block)
            assert torch.all(ref[padding] == 0)
            noisy = ref.clone()
            noisy[padding] = 0xA5  # padding carries nothing: the decode does not change
            a = ops.decode(ref, codec, n, block, k, torch.float32)
            b = ops.decode(noisy, codec, n, block, k, torch.float32)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_layout_helpers_reject_what_no_launch_accepts():
    for args in ((7, 10, 0, 0), (-1, 10, 0, 0), (cb.INT8, 10, 48, 0), (cb.INT8, -1, 32, 0),
                 (cb.TOPK, 10, 0, 11), (cb.TOPK, 1 << 32, 0, 1), (cb.F32, (1 << 56) + 1, 0, 0)):
        with pytest.raises(ValueError, match="no payload layout"):
            cb.layout(*args)
    assert cb.layout(cb.TOPK, 10, 0, 0) == (0, 0, 0)  # a launch accepts k = 0 (kernels.cu valid_topk)
    for n in (-1, 1 << 32):
        with pytest.raises(ValueError, match="topk scratch"):
            cb.topk_scratch_layout(n)
    with pytest.raises(RuntimeError, match=f"unknown codec id {len(cb.CODEC_IDS)}"):
        cb.wire_bytes(len(cb.CODEC_IDS), 10, 0, 0)
    for bad in ((cb.INT8, 10, 48, 0, "int8"), (cb.TOPK, 10, 0, 0, "topk"), (cb.F32, -1, 0, 0, "fp32")):
        with pytest.raises(RuntimeError) as by_id:
            cb.wire_bytes(*bad[:4])
        with pytest.raises(RuntimeError) as by_name:
            flatcomm._C.wire_bytes(bad[4], *bad[1:4])
        assert str(by_id.value) == str(by_name.value)
    assert cb.seed_key((1 << 64) - 1) == flatcomm._C.seed_key((1 << 64) - 1)
    with pytest.raises(RuntimeError, match=r"headroom must be in \[1, 38\]"):
        cb.precision_of(39)


def test_flatcomm_imports_without_numpy():
    """numpy is optional (the cupy path needs it): an installed flatcomm without it imports and runs."""
    code = ("import sys; sys.modules['numpy'] = None\n"
            "import torch, flatcomm\n"
            "x = torch.randn(1000)\n"
            "assert flatcomm.decode(flatcomm.encode(x, 'fp32'), 'fp32', 1000).equal(x)\n"
            "print(flatcomm.cuda_path())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
