"""docs/integrations.md as written: each framework section's code lines come, in order, from its
example under examples/, and its two torchrun commands (train with checkpoints; resume from the
step-4 checkpoint) run and end with the same weights digest (2 gloo ranks each, ~8 s a command)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate", "trainer": "transformers"}


def _sections():
    text = DOC.read_text()
    out = []
    for block in re.split(r"\n## ", text)[1:]:
        py = re.findall(r"```python\n(.*?)```", block, re.S)
        sh = re.findall(r"```bash\n(.*?)```", block, re.S)
        if sh and "examples/" in sh[0]:
            out.append((block.splitlines()[0], py[0], [c for c in sh[0].splitlines() if c.strip()]))
    return out


SECTIONS = _sections()


def test_every_framework_has_a_section():
    assert len(SECTIONS) == 3, [s[0] for s in SECTIONS]


@pytest.mark.slow
@pytest.mark.parametrize("title,code,commands", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_snippet_is_the_example_and_runs(tmp_path, title, code, commands):
    example = re.search(r"examples/(\w+)\.py", commands[0]).group(0)
    pytest.importorskip(FRAMEWORKS[Path(example).stem.split("_")[0]])
    lines = [ln.strip() for ln in (ROOT / example).read_text().splitlines()]
    at = 0
    for ln in (x.strip() for x in code.splitlines() if x.strip()):
        assert ln in lines[at:], f"{title}: {ln!r} is not in {example} (after line {at})"
        at = lines.index(ln, at) + 1
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    digests = []
    for cmd in commands:
        argv = shlex.split(cmd.replace("/tmp/", f"{tmp_path}/"))
        assert argv[0] == "torchrun"
        p = subprocess.run([TORCHRUN, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, f"{cmd}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        m = re.search(r"(\d+) flatcomm steps, compression ([\d.]+)x, weights (\w+)", p.stdout)
        assert m, p.stdout[-2000:]
        digests.append((int(m.group(1)), float(m.group(2)), m.group(3)))
    (n0, c0, d0), (n1, _, d1) = digests
    assert (n0, n1) == (8, 4) and c0 > 2, digests  # int8: the hook ran every step of each run
    assert d0 == d1, f"{title}: the resumed run ended with other weights"
