"""docs/bench holds results a reader uses, not every rep of every run: each JSON file and the
JSON as a whole stay under a size budget (a run's per-rep times belong in the run's own output,
e.g. ``--json /tmp/x.json``, not in the docs), and a doc links only results that exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
FILE_BUDGET = 400_000  # bytes: the largest today is a 3-seed convergence curve set (~355 KB)
TOTAL_BUDGET = 3_500_000  # bytes of JSON and JSON lines in docs/bench


def _results():
    return sorted(p for p in BENCH.iterdir() if p.suffix in (".json", ".jsonl"))


def test_bench_results_stay_under_their_budget():
    big = [f"{p.name} ({p.stat().st_size:,} B)" for p in _results() if p.stat().st_size > FILE_BUDGET]
    assert not big, f"docs/bench files over {FILE_BUDGET:,} B: {big}; keep summaries, drop per-rep times"
    total = sum(p.stat().st_size for p in _results())
    assert total <= TOTAL_BUDGET, f"docs/bench JSON is {total:,} B, over its {TOTAL_BUDGET:,} B budget"


def test_docs_link_only_results_that_exist():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for doc in docs:
        for name in re.findall(r"(?:docs/)?bench/([\w.-]+\.(?:jsonl|json|png))\b", doc.read_text()):
            if not (BENCH / name).exists():
                missing.append(f"{doc.relative_to(ROOT)}: bench/{name}")
    assert not missing, f"docs name bench results that are not there: {missing}"
