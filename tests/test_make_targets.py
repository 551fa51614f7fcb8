"""What the Makefile's quick-start targets install (``make -n``: printed, nothing run), and that the
in-place build is usable from a script outside the checkout the way README.md says."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = ("pytest", "hypothesis", "mypy", "integrations", "lightning", "accelerate", "transformers")


def _dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    # A venv that does not exist: make prints every step of setting it up.
    p = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.replace(str(tmp_path / "venv"), "VENV")  # (tmp_path's name holds "pytest")


def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    out = _dry_run("demo", tmp_path)
    installs = [ln for ln in out.splitlines() if "pip install" in ln]
    assert not [ln for ln in installs if any(w in ln for w in TEST_ONLY)], installs
    assert any("matplotlib" in ln for ln in installs), installs  # the demo draws its curves
    torch_line = next(ln for ln in installs if "torch" in ln)
    assert '"torch==2.13.0+cpu"' in torch_line  # the CPU build
    assert "-m flatcomm.demo" in out


def test_make_test_installs_the_test_tools(tmp_path):
    installs = "\n".join(ln for ln in _dry_run("test-py", tmp_path).splitlines() if "pip install" in ln)
    assert all(w in installs for w in ("pytest", "hypothesis", "numpy", "mypy", "integrations")), installs


def test_a_script_outside_the_checkout_imports_the_in_place_build(tmp_path):
    """README's route for the in-place build (``make build``): PYTHONPATH=<checkout> (or pip install -e)."""
    readme = (ROOT / "README.md").read_text()
    assert "pip install --no-build-isolation -e ." in readme and "PYTHONPATH=" in readme
    assert "No module named 'flatcomm'" in (ROOT / "docs" / "build.md").read_text()
    script = tmp_path / "train.py"
    script.write_text("import flatcomm, torch\n"
                      "print(flatcomm.__file__)\n"
                      "print(flatcomm.wire_bytes('int8', 1000))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(env, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == str(ROOT / "flatcomm" / "__init__.py")
