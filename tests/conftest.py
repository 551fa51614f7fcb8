"""Shared fixtures of the flatcomm test-suite (shared helpers: tests/_support/).

Every test gets its own torch.Generator seeded from the test's node id: inputs are fresh per test
(and per parameter set) but reproducible run to run.
"""
from __future__ import annotations

import inspect
import re
import zlib

import pytest
import torch

import flatcomm

from _support.markers import spawning_functions


@pytest.fixture
def gen(request) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def restore_simd():
    default = flatcomm.build_info()["simd"]
    yield default
    assert flatcomm._C.set_simd(default)


# ---- markers (registered in pyproject.toml; `make test-fast` deselects multiprocess and slow) ------

# The multi-rank smoke set that `make test-fast` keeps (test ids; * matches any text): one spawn
# each, the flat collectives, DDP and FSDP2 at 2 ranks, a DiLoCo sync against its float64
# reference, and the flatcomm backend's reductions (exact and ordered, flat and two-level).
SMOKE = (
    "test_collectives.py::test_collectives[2-*]",
    "test_ddp.py::test_fp32_matches_float64_average_and_is_bitwise_reproducible[2]",
    "test_fsdp.py::test_fp32_matches_default_and_is_deterministic[w2]",
    "test_diloco.py::test_syncs_match_float64_outer_nesterov_with_fragments_delay_alpha",
    "test_backend_exact.py::test_exact_same_bits_with_ranks_permuted",
)


def pytest_collection_modifyitems(config, items):
    """Mark a test ``multiprocess`` when it or a fixture of its module starts processes (found from
    the source, so a new test is marked without anyone remembering to), and ``smoke`` when
    :data:`SMOKE` lists it; ``slow`` is written on the tests themselves."""
    cache: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module.__name__ not in cache:
            cache[module.__name__] = spawning_functions(inspect.getsource(module))
        spawning = cache[module.__name__]
        func = getattr(item, "originalname", item.name)
        if func in spawning or spawning & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
        test_id = item.nodeid.rpartition("/")[2]
        if any(re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), test_id) for pattern in SMOKE):
            item.add_marker(pytest.mark.smoke)
