"""How tests/conftest.py finds the tests that start processes (the ``multiprocess`` marker)."""
from __future__ import annotations

import ast

# Source that starts processes: gloo ranks (flatcomm.tools.spawn), torchrun, network namespaces, the
# hardening runs, torchft replica processes (tests/_support/elastic_cluster.py), and the command-line tools that start ranks, run as subprocesses (as ast.unparse
# writes them: single quotes) or in process (their main imported).
_STARTS_PROCESSES = ("spawn.run(", "TORCHRUN", "'torchrun'", "'torch.distributed.run'", "Link(", "Cluster(", "hardening.fuzz(", "hardening.kills(",
                     "'flatcomm.bench'", "'flatcomm.tune'", "flatcomm.tools.bench import main",
                     "flatcomm.tools.tune import main", "conv.main(")  # (the convergence bench, imported as conv)


def spawning_functions(source: str) -> set:
    """Names of a test module's functions (tests, helpers and fixtures) that start processes,
    directly or through another function of the module; ``source`` is the module's text."""
    tree = ast.parse(source)
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
