"""A setting that cannot be honoured warns once, naming what runs instead (never a silent fallback):
$FLATCOMM_SIMD naming kernels that do not run, $FLATCOMM_CUPY=1 without CUDA torch or cupy, a float64
sum on the flatcomm backend (it passes through to gloo, not the same-bits sum)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import flatcomm
from flatcomm.ops import cupy_backend as cb
from flatcomm.ops import native
from flatcomm.tools import spawn

ROOT = Path(__file__).resolve().parents[1]


def _caught(fn, times: int = 2) -> list:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(times):
            fn()
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_simd_name_not_built_warns_once_naming_the_kernels_that_run(monkeypatch):
    monkeypatch.setenv("FLATCOMM_SIMD", "neon")
    monkeypatch.setattr(native, "_simd_warned", False)
    got = _caught(native.warn_ignored_simd)
    in_use = flatcomm.build_info()["simd"]
    assert len(got) == 1, got
    assert "FLATCOMM_SIMD='neon'" in got[0] and f"the {in_use!r} kernels run instead" in got[0]


def test_simd_setting_messages():
    info = {"simd": "avx2", "simd_supported": "baseline,avx2"}  # an AVX2 CPU
    msg = native.simd_setting_warning("avx512", info)
    assert "not supported by this CPU" in msg and "baseline, avx2" in msg and "'avx2' kernels run instead" in msg
    assert "did you mean 'avx2'" in native.simd_setting_warning("AVX2", info)
    for honoured in (None, "", "  ", "avx2"):
        assert native.simd_setting_warning(honoured, info) is None
    assert native.simd_setting_warning("baseline", {"simd": "baseline", "simd_supported": "baseline"}) is None


def test_simd_warning_at_import_once():
    env = dict(os.environ, FLATCOMM_SIMD="sse9", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import flatcomm, flatcomm.ops.native as n; n.warn_ignored_simd(); print(flatcomm.build_info()['simd'])"
    p = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("FLATCOMM_SIMD='sse9'") == 1, p.stderr
    assert f"the {p.stdout.strip()!r} kernels run instead" in p.stderr


def test_cupy_on_a_cpu_torch_warns_once(monkeypatch):
    monkeypatch.setenv("FLATCOMM_CUPY", "1")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(cb, "_state", dict(cb._state, warned=False))  # restored after the test
    got = _caught(lambda: cb.auto_register(["cpu"]))
    assert len(got) == 1, got
    assert "FLATCOMM_CUPY=1 is ignored (torch has no CUDA)" in got[0] and "CPU only" in got[0]
    assert cb.cuda_path().startswith("none")


def test_cupy_setting_messages():
    ok, reason = cb.should_register(["cpu"], "13.0", False, "1")
    msg = cb.env_warning("1", ok, reason)
    assert "cupy is not installed" in msg and "CUDA tensors get no flatcomm kernels" in msg
    assert "neither 1 (on) nor 0 (off)" in cb.env_warning("yes", *cb.should_register(["cpu"], "13.0", True, "yes"))
    assert "compiled CUDA kernels run instead" in cb.env_warning("1", *cb.should_register(["cpu", "cuda"], "13.0",
                                                                                          True, "1"))
    for env in (None, "", "0"):  # nothing asked
        assert cb.env_warning(env, *cb.should_register(["cpu"], None, False, env)) is None
    assert cb.env_warning("1", *cb.should_register(["cpu"], "13.0", True, "1")) is None  # honoured


def _float64_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import flatcomm.backend.reduce as fr

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.all_reduce(torch.ones(3, dtype=torch.int64))  # integer: exact anyway, no warning
        dist.all_reduce(torch.ones(3, dtype=torch.float64), op=dist.ReduceOp.MAX)  # not a sum
        quiet = len(seen)
        x = torch.full((5,), 0.5, dtype=torch.float64)
        dist.all_reduce(x)
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(2, dtype=torch.float32))
    msgs = [str(w.message) for w in seen[quiet:]]
    return {"quiet": quiet, "msgs": msgs, "x": x.tolist(), "warned": fr._float64_warned}


def test_float64_sum_on_the_backend_warns_once():
    for r in spawn.run(2, _float64_rank, backend="flatcomm", timeout_s=60):
        assert r["quiet"] == 0 and len(r["msgs"]) == 1, r
        assert "float64 sums run on the inner backend" in r["msgs"][0] and "not flatcomm's same-bits sum" in r["msgs"][0]
        assert r["x"] == [2.0] * 5 and r["warned"]
