"""The framework adapters stay out of the library: importing flatcomm (and every module outside
flatcomm.integrations) imports no framework and no adapter."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def _fresh(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_library_imports_no_framework():
    out = _fresh(
        "import sys, flatcomm, flatcomm.ddp, flatcomm.fsdp, flatcomm.rank_states, flatcomm.integrations\n"
        f"print(sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r} "
        "or k.startswith('flatcomm.integrations.')))\n")
    assert out.strip() == "[]", out


def test_no_library_module_imports_an_adapter_or_framework():
    for path in sorted((ROOT / "flatcomm").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] in ("integrations", "tools"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                     [f"flatcomm.{node.module or ''}"] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert n.split(".")[0] not in FRAMEWORKS and "integrations" not in n, f"{rel} imports {n}"


def test_adapters_do_not_import_each_other():
    # (Lightning itself imports transformers when it is installed, so only the other way is checked.)
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = _fresh("import sys\n"
                 "for a in ('accelerate', 'transformers'):\n"
                 "    __import__('flatcomm.integrations.' + a)\n"
                 f"    print(sorted({{k.split('.')[0] for k in sys.modules}} & set({FRAMEWORKS!r})))\n")
    after_accelerate, after_transformers = (set(eval(line)) for line in out.split("\n")[:2])  # noqa: S307
    assert after_accelerate == {"accelerate"}, after_accelerate
    assert "transformers" in after_transformers and not after_transformers & {"lightning", "pytorch_lightning"}
