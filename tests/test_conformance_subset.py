"""A fast selection of torch's own distributed suite (``_DistTestBase``) on the flatcomm backend, in
every CI run (``make test-slow``): the whole suite (tests/test_backend_conformance.py, ``make test-conformance``)
takes hours on a small machine, so CI checks the contract through four of its tests: a float sum
(flatcomm's own, the one-exchange path), a MAX (passed through to gloo after the call header's
check), ``reduce``, and DDP's backward with ``create_graph`` (the reducer waiting on our Work's
future: once a SIGSEGV). Each test starts its 2 ranks: ~20 s a test on the loaded 2-core machine.
A test the suite skips counts as a failure here: it checked nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ("test_all_reduce_sum", "test_all_reduce_max", "test_reduce_sum", "test_ddp_create_graph")


@pytest.mark.slow
def test_torch_suite_selection_passes_on_flatcomm(tmp_path):
    ids = [f"tests/test_backend_conformance.py::TestTorchSuiteOnFlatcomm::{name}" for name in SELECTION]
    env = dict(os.environ, FLATCOMM_CONFORMANCE="1", WORLD_SIZE="2", FLATCOMM_BACKEND_MODE="ordered",
               TEMP_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "pytest", *ids, "-rfEs", "-p", "no:cacheprovider"],  # (-q: addopts)
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = p.stdout[-3000:] + p.stderr[-2000:]
    assert p.returncode == 0, tail
    passed = re.search(r"(\d+) passed", p.stdout)
    assert passed is not None and int(passed.group(1)) == len(SELECTION), tail
