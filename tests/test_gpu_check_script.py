"""Keep the prepared GPU check runnable: its CPU self-test exercises every comparison path."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# slow: a fresh interpreter that also starts gloo ranks (~35 s); the CPU paths it compares are
# checked by tests/test_encode_decode.py, test_cupy_emulated.py and test_collectives.py, the script
# itself in make test (and its shell wrapper below, in the fast loop).
@pytest.mark.slow
def test_gpu_check_self_test_passes():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--self-test"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " 0 failed" in r.stdout
    # the cupy / NVRTC section runs too (CPU against CPU here: its harness, not the NVRTC kernels)
    assert "sweep, NVRTC vs cpu:" in r.stdout and " 0 failed (" in r.stdout
    assert "encode+EF and decode of every codec: bitwise equal" in r.stdout
    # the collectives section runs too (gloo on CPU in place of NCCL: its harness and the CPU path)
    line = next((x for x in r.stdout.splitlines() if "collectives, cpu over gloo" in x), "")
    assert " 0 failed, 0 skipped" in line and " 30 passed" in line, line or r.stdout[-3000:]


def test_gpu_check_shell_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


# slow: two spawned island processes that import torch and torchft (~80 s on the shared box); what
# they check on CPU parameters is covered by tests/test_islands.py, the CUDA placement only on a GPU.
@pytest.mark.slow
def test_gpu_check_islands_harness_passes_on_cpu():
    pytest.importorskip("torchft")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check_islands.py"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "islands: 2 passed, 0 failed" in r.stdout
