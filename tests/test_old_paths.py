"""The module paths of the flat package (``flatcomm.codecs``, ...) still import, for one release, as
the moved modules themselves with a DeprecationWarning naming the new path; nothing in the package,
its tests, docs or examples uses them, nor a ``flatcomm.<name>`` that does not exist."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import flatcomm
from flatcomm._compat import MOVED

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flatcomm"
# `flatcomm.<name>` as written in code, docstrings and comments (not `x.flatcomm.<name>`).
DOTTED = re.compile(r"(?<![\w.])flatcomm\.([A-Za-z_]\w*)")
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _top_level_names() -> set:
    """What ``flatcomm.<name>`` may name: a module or subpackage on disk, a public name of the
    package, a lazily imported subpackage, the package's dunders."""
    on_disk = {p.name.split(".")[0] for p in PKG.iterdir() if p.suffix in (".py", ".so", ".pyi") or p.is_dir()}
    return (on_disk | set(flatcomm.__all__) | set(flatcomm._SUBMODULES) | set(dir(flatcomm))) - set(MOVED)


def _sources() -> List[Path]:
    files = [p for d in ("flatcomm", "tests", "examples", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p.name != "_compat.py" and p != Path(__file__).resolve()]


def _docs_code() -> List[tuple]:
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    return [(p, block) for p in docs if p.exists() for block in PYTHON_BLOCK.findall(p.read_text())]


def bad_references(path: Path, text: str, known: set) -> List[str]:
    """`flatcomm.<name>` with an unknown or old name, and `from flatcomm import <old name>`."""
    bad = [f"{path.relative_to(ROOT)}: flatcomm.{m.group(1)}" for m in DOTTED.finditer(text)
           if m.group(1) not in known]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return bad
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "flatcomm" and not node.level:
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: from flatcomm import {a.name}"
                    for a in node.names if a.name in MOVED]
    return bad


def test_nothing_uses_an_old_or_unknown_path():
    known = _top_level_names()
    bad = [b for p in _sources() for b in bad_references(p, p.read_text(), known)]
    bad += [b for p, block in _docs_code() for b in bad_references(p, block, known)]
    assert not bad, "old or unknown module paths (new paths: flatcomm/_compat.py MOVED):\n" + "\n".join(bad)


def test_the_scan_finds_old_and_stale_paths(tmp_path):
    """The scan is not vacuous: each kind of bad reference is reported, a good one is not."""
    known = _top_level_names()
    src = tmp_path / "m.py"
    text = ("import flatcomm.codecs\nfrom flatcomm import fsdp1, ddp\n"
            "# see flatcomm.fsdp_weights\nimport flatcomm.ops.codecs\nflatcomm.ddp.State\n")
    bad = bad_references(ROOT / "tests" / "m.py", text, known)
    assert bad == ["tests/m.py: flatcomm.codecs", "tests/m.py: flatcomm.fsdp_weights",
                   "tests/m.py:2: from flatcomm import fsdp1"]


def test_old_paths_import_the_moved_modules_with_a_warning():
    """In a fresh interpreter (nothing imported yet): each old path gives the very module of its new
    path, warns once with the new path in the message, and leaves the module's own spec alone."""
    code = (
        "import importlib, warnings, flatcomm, flatcomm._compat as c\n"
        "for old, new in c.MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as w:\n"
        "        warnings.simplefilter('always')\n"
        "        a = importlib.import_module('flatcomm.' + old)\n"
        "    m = importlib.import_module('flatcomm.' + new)\n"
        "    assert a is m, old\n"
        "    assert m.__spec__.name == m.__name__ == 'flatcomm.' + new, (old, m.__spec__.name)\n"
        "    msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
        "    assert len(msgs) == 1 and ('flatcomm.' + new) in msgs[0] and ('flatcomm.' + old) in msgs[0], msgs\n"
        "print('ok', len(c.MOVED))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith(f"ok {len(MOVED)}"), p.stdout[-2000:] + p.stderr[-3000:]


def test_the_warning_points_at_the_importing_line(tmp_path):
    script = tmp_path / "user.py"
    script.write_text("import warnings\nwarnings.simplefilter('error')\nimport flatcomm\nimport flatcomm.sums\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # a script's sys.path starts at its own folder
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert 'user.py", line 4' in p.stderr and "DeprecationWarning" in p.stderr, p.stderr[-3000:]
