"""Layering: the library (every flatcomm module outside flatcomm.tools) never imports the tools, and its
modules import each other without cycles (layers look only down)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flatcomm"
# `python -m flatcomm.bench|tune|demo`: entry modules that import their tool only when run as __main__.
ENTRY_POINTS = {"bench", "tune", "demo"}


def _library_modules() -> Dict[str, Path]:
    """Dotted name -> file of every library module (the package itself and its entry modules included)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "tools" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str, top_level_only: bool = False) -> List[str]:
    """Absolute names of the modules ``path`` imports (lazy imports inside functions included, unless
    top_level_only); ``from X import y`` counts as both X and X.y (y may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _is_tools(name: str) -> bool:
    return name == "flatcomm.tools" or name.startswith("flatcomm.tools.")


def test_no_library_file_imports_the_tools():
    for module, path in _library_modules().items():
        if module.split(".")[-1] in ENTRY_POINTS:
            top = _imports(path, module, top_level_only=True)
            assert not any(_is_tools(n) for n in top), f"{path}: imports a tool at import time"
            continue
        bad = [n for n in _imports(path, module) if _is_tools(n)]
        assert not bad, f"{path} imports {bad}"


def test_importing_the_library_never_imports_the_tools():
    """In a fresh interpreter: import every library module, one by one, and look at sys.modules."""
    modules = sorted(_library_modules())
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:  # a framework adapter without its framework installed\n"
        "        if not (m.startswith('flatcomm.integrations.') and e.name.split('.')[0] in\n"
        "                ('lightning', 'accelerate', 'transformers')):\n"
        "            raise\n"
        "    tools = sorted(k for k in sys.modules if k == 'flatcomm.tools' or k.startswith('flatcomm.tools.'))\n"
        "    assert not tools, f'importing {m} imported {tools}'\n"
        "print('ok', len(sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every cycle found by a depth-first search (each reported once, from where it was entered)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_library_modules_import_without_cycles():
    """Lazy imports inside functions count: a lazy import that closes a circle still ties the two modules
    together. The package's __init__ is the facade over everything and stays out of the graph."""
    mods = {m: p for m, p in _library_modules().items() if m != "flatcomm"}
    graph = {m: {n for n in _imports(p, m) if n in mods and n != m} for m, p in mods.items()}
    assert not _cycles(graph), _cycles(graph)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_examples_import_the_installed_package():
    """An example that puts the checkout first on sys.path hides the installed flatcomm (and fails
    where the checkout is not built)."""
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert "sys.path" not in path.read_text(), f"{path} edits sys.path"
