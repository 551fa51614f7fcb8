"""torch's own distributed test suite (``DistributedTest._DistTestBase``, torch 2.13) on the flatcomm backend.

Every gloo process group the suite creates (its world, ``new_group(backend="gloo")``, subgroups) is a
flatcomm one: the suite runs with ``BACKEND=gloo`` (it gates its CPU tests on that name) and
:func:`_gloo_is_flatcomm` turns the backend name "gloo" into "flatcomm" where torch creates a group.
Settings come from the environment (``FLATCOMM_BACKEND_MODE=exact``; ``WORLD_SIZE``: 2 or 3 ranks).

Slow (each test spawns its ranks as fresh interpreters): not part of ``make test``; ``make
test-conformance`` runs it (``FLATCOMM_CONFORMANCE=1``), at 2 and 3 ranks, ordered and exact. Set
``FLATCOMM_CONFORMANCE_GLOO=1`` to run the same selection on plain gloo (the baseline to compare with).

``CANNOT_PASS`` lists the tests that cannot pass on a backend that is not named "gloo", and why;
they run as expected failures, so one that starts passing is reported.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import unittest

import pytest

RUN = os.environ.get("FLATCOMM_CONFORMANCE") == "1"
if not RUN:
    pytest.skip("torch's distributed suite: make test-conformance (FLATCOMM_CONFORMANCE=1)", allow_module_level=True)

os.environ["BACKEND"] = "gloo"  # read by the suite at import: its CPU tests are gated on this name
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # (the fork server imports this module again: it keeps the parent's)
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="flatcomm-conformance-")

import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    Barrier, DistributedTest, TestDistBackend)

import flatcomm.backend  # noqa: E402,F401 - registers the backend

GLOO_BASELINE = os.environ.get("FLATCOMM_CONFORMANCE_GLOO") == "1"

# Tests that cannot pass on flatcomm, and why. They check the backend's *name*, not its behaviour.
CANNOT_PASS = {
    # asserts dist.get_backend() == BACKEND ("gloo"); ours is "flatcomm"
    "test_get_backend": "checks the backend's name",
    # torch.distributed.monitored_barrier refuses any backend not named gloo before calling the group
    # ("monitored_barrier is only implemented for GLOO backend")
    "test_monitored_barrier_allreduce_hang": "monitored_barrier is gated on the name gloo",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "monitored_barrier is gated on the name gloo",
    "test_monitored_barrier_failure_order": "monitored_barrier is gated on the name gloo",
    "test_monitored_barrier_gloo": "monitored_barrier is gated on the name gloo",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is gated on the name gloo",
    "test_monitored_barrier_wait_all_ranks": "monitored_barrier is gated on the name gloo",
    "test_ddp_build_debug_param_to_name_mapping": "monitored_barrier (TORCH_DISTRIBUTED_DEBUG) is gated on gloo",
    "test_ddp_multiple_nested_unused_params_err_ignore_params": "monitored_barrier is gated on the name gloo",
}

_helper = c10d._new_process_group_helper


def _gloo_is_flatcomm(group_size, group_rank, global_ranks, backend, *args, **kwargs):
    """torch's group factory, with the backend "gloo" made "flatcomm" (the suite's every group)."""
    if str(backend).lower() == "gloo" and not GLOO_BASELINE:
        backend = dist.Backend("flatcomm")
    return _helper(group_size, group_rank, global_ranks, backend, *args, **kwargs)


c10d._new_process_group_helper = _gloo_is_flatcomm


class TestTorchSuiteOnFlatcomm(TestDistBackend, DistributedTest._DistTestBase):
    """``_DistTestBase`` as torch's test_distributed_spawn.py runs it, with the ranks forked from a
    server (see :func:`_forkserver`) and one temporary directory for the whole run."""

    def setUp(self):
        MultiProcessTestCase.setUp(self)  # not TestDistBackend's: it makes a new TEMP_DIR per test
        _fresh_temp_dir()
        Barrier.init()
        self.skip_return_code_checks = [self.test_ddp_has_finalized.__wrapped__]
        self._start_processes(_forkserver().Process)

    def tearDown(self):
        MultiProcessTestCase.tearDown(self)


def _fresh_temp_dir() -> None:
    """Empty ``TEMP_DIR`` and lay it out as the suite's ``initialize_temp_directories`` does. The
    directory is fixed for the run: the fork server's ranks see the environment of its start."""
    root = os.environ["TEMP_DIR"]
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(root, sub))


def _forkserver():
    """Ranks forked from one server that imported torch, the suite and flatcomm once (a spawned
    rank would import them again for every test: ~5 s a test on 2 cores)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


if not GLOO_BASELINE:
    for _name in CANNOT_PASS:
        _fn = getattr(TestTorchSuiteOnFlatcomm, _name, None)
        if _fn is not None:
            setattr(TestTorchSuiteOnFlatcomm, _name, unittest.expectedFailure(_fn))
