"""The markers that `make test-fast` selects on: every test that starts processes is marked
``multiprocess`` (tests/conftest.py finds them from the source), and the smoke set names tests that
exist."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _support import markers

ROOT = Path(__file__).resolve().parents[1]


def test_spawning_functions_follow_the_call_graph():
    src = (
        "def _rank_main(rank, world):\n    return rank\n"
        "def _results(world):\n    return spawn.run(world, _rank_main)\n"
        "def ranks():\n    return _results(2)\n"
        "def any_world(request):\n    return request.getfixturevalue('ranks')\n"
        "def test_a(ranks):\n    assert ranks\n"
        "def test_b():\n    assert _results(3)\n"
        "def test_single():\n    assert 1\n"
        "def test_link():\n    with Link(2, '1gbit') as link:\n        pass\n"
        "def test_cli():\n    subprocess.run([sys.executable, '-m', \"flatcomm.bench\", 'ddp'])\n"
        "def test_torchrun():\n    subprocess.run(['torchrun', '--standalone', 'train.py'])\n"
        "def test_cli_in_process():\n    from flatcomm.tools.bench import main\n    main(['ddp'])\n"
    )
    found = markers.spawning_functions(src)
    assert found == {"_results", "ranks", "any_world", "test_b", "test_link", "test_cli", "test_torchrun",
                     "test_cli_in_process"}
    # A module that starts nothing has no spawning functions, getfixturevalue or not.
    assert markers.spawning_functions("def f(request):\n    request.getfixturevalue('x')\n") == set()


def _collected(*args: str) -> dict:
    """{"KEPT"/"DROPPED": {node id: markers}} of one ``--collect-only`` run (tests/_support/collected.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "-p", "_support.collected", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out: dict = {"KEPT": {}, "DROPPED": {}}
    for line in p.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in out:
            node, _, marks = rest.rpartition(" ")
            out[tag][node] = set(marks.split(",")) - {""}
    return out


def test_the_fast_loop_keeps_the_smoke_set_and_drops_the_spawning_tests():
    files = ["tests/test_ddp.py", "tests/test_collectives.py", "tests/test_encode_decode.py", "tests/test_diloco.py",
             "tests/test_backend_exact.py"]
    got = _collected(*files, "-m", "not multiprocess and not slow or smoke")  # make test-fast's selection
    fast, dropped = set(got["KEPT"]), set(got["DROPPED"])
    everything = fast | dropped
    smoke = {t for t, marks in got["KEPT"].items() if "smoke" in marks}
    assert smoke and dropped and not smoke & dropped
    assert all("multiprocess" in got["DROPPED"][t] for t in dropped)
    assert all(t.startswith(("tests/test_ddp.py", "tests/test_collectives.py", "tests/test_diloco.py",
                             "tests/test_backend_exact.py")) for t in dropped)
    # make test-fast runs a DiLoCo sync and a flatcomm backend reduction
    assert "tests/test_diloco.py::test_syncs_match_float64_outer_nesterov_with_fragments_delay_alpha" in smoke
    assert "tests/test_backend_exact.py::test_exact_same_bits_with_ranks_permuted" in smoke
    assert {t for t in everything if t.startswith("tests/test_encode_decode.py")} <= fast
    assert "tests/test_ddp.py::test_fp32_matches_float64_average_and_is_bitwise_reproducible[2]" in smoke
    assert "tests/test_ddp.py::test_fp32_matches_float64_average_and_is_bitwise_reproducible[3]" in dropped
    assert sum(t.startswith("tests/test_collectives.py") for t in smoke) == len(
        [t for t in everything if t.startswith("tests/test_collectives.py::test_collectives[2-")])
