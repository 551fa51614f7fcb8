"""Shared fixtures of the flatcomm test-suite (shared helpers: tests/_support/).

Every test gets its own torch.Generator seeded from the test's node id: inputs are fresh per test
(and per parameter set) but reproducible run to run.
"""
from __future__ import annotations

import ast
import inspect
import re
import zlib

import pytest
import torch

import flatcomm


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

# Source that starts processes: gloo ranks (flatcomm.tools.spawn), torchrun, network namespaces.
_STARTS_PROCESSES = ("spawn.run(", "TORCHRUN", "Link(", "hardening.fuzz(", "hardening.kills(")


def _spawning_functions(module) -> set:
    """Names of the module's functions (tests, helpers and fixtures) that start processes, directly
    or through another function of the module."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    calls = {name: {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
             for name, f in funcs.items()}
    spawning = {name for name, f in funcs.items() if any(s in ast.unparse(f) for s in _STARTS_PROCESSES)}
    if spawning:  # a fixture that picks another by name (request.getfixturevalue) may pick a spawning one
        spawning |= {name for name, f in funcs.items() if "getfixturevalue" in ast.unparse(f)}
    grew = True
    while grew:  # through the module's own call graph
        more = {name for name, called in calls.items() if name not in spawning and called & spawning}
        spawning |= more
        grew = bool(more)
    return spawning


# The multi-rank smoke set that `make test-fast` keeps (test ids; * matches any text): one spawn
# each, the flat collectives, DDP and FSDP2 at 2 ranks.
SMOKE = (
    "test_collectives.py::test_collectives[*-2]",
    "test_ddp.py::test_fp32_matches_float64_average_and_is_bitwise_reproducible[2]",
    "test_fsdp.py::test_fp32_matches_default_and_is_deterministic[w2]",
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
            cache[module.__name__] = _spawning_functions(module)
        spawning = cache[module.__name__]
        func = getattr(item, "originalname", item.name)
        if func in spawning or spawning & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)
        test_id = item.nodeid.rpartition("/")[2]
        if any(re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), test_id) for pattern in SMOKE):
            item.add_marker(pytest.mark.smoke)
