"""flatcomm.tools.bench.frontier: row names, the paired summary and its parity verdict, the rendering
between the doc's markers, and a tiny resumable run (a rerun adds no point) whose bytes per sync are
the codecs' payload sizes."""
from __future__ import annotations

import json

import pytest

from flatcomm import Codec
from flatcomm.tools.bench import frontier, frontier_report as rep


def test_row_names():
    assert frontier.row_spec("int4", 15) == "diloco:codec=int4,H=15"
    s = frontier.row_spec("top128", 15)
    assert s.startswith("diloco:codec=sparse,keep=128,H=15,") and "mode=exact" in s
    assert frontier.row_spec("top64s4", 10).startswith("diloco:codec=sparse4,keep=64,H=10,")
    assert frontier.row_spec("top192s1", 15).startswith("diloco:codec=sparse1,keep=192,H=15,")
    assert frontier.row_spec("diloco:codec=int8,H=3,ef=false", 15) == "diloco:codec=int8,H=15,ef=False"
    assert frontier._rows("fp32,diloco:codec=sparse,keep=128,top64") == ["fp32", "diloco:codec=sparse,keep=128", "top64"]
    assert frontier._rows("diloco:codec=sparse,keep=160;int4") == ["diloco:codec=sparse,keep=160", "int4"]
    with pytest.raises(ValueError, match="not fp32"):
        frontier.row_spec("torch", 15)


def test_short_names():
    assert rep.short("int4") == "int4"
    assert rep.short(frontier.row_spec("diloco:codec=sparse,keep=128,mode=exact,decay=0.95,outer_lr=3.0", 15)) == \
        "top128 decay 0.95 lr 3.0"
    assert rep.short("diloco:codec=sparse4,keep=64,mode=ordered,H=15") == "top64s4 ordered"


def _pt(row, seed, vals, bpp, size="100k"):
    return {"size": size, "replicas": 2, "row": row, "seed": seed, "H": 15, "syncs": 160, "params": 1000,
            "readings": {str(s): {"val": v, "bytes_per_param_per_sync": bpp} for s, v in zip((80, 160), vals)}}


def test_summary_pairs_seeds_and_names_the_cheapest_row_at_parity():
    pts = [_pt("fp32", 0, (2.0, 1.8), 4.0), _pt("fp32", 1, (2.2, 1.9), 4.0),
           _pt("top64", 0, (2.1, 1.9), 0.02), _pt("top64", 1, (2.3, 2.0), 0.02),        # +5%: not at parity
           _pt("top128", 0, (2.01, 1.81), 0.04), _pt("top128", 1, (2.2, 1.9), 0.04),    # +0.25%, +0.28%
           _pt("int4", 0, (2.0, 1.8), 0.5), _pt("top128", 0, (9.0, 9.0), 0.04)]         # a repeat counts once
    rows = rep.summarize(pts)[("100k", 2, 15, 160)]
    assert rows["top128"][160]["rel"] == pytest.approx([1.81 / 1.8 - 1, 0.0])
    assert rows["top128"][160]["seeds"] == [0, 1] and rows["fp32"][80]["rel"] == []
    assert rep.lowest_at_parity(rows, [80, 160]) == "top128"
    assert rep.lowest_at_parity({k: v for k, v in rows.items() if k != "top128"}, [80, 160]) == "int4"
    md = rep.markdown(pts)
    assert "Fewest bytes within +1% of fp32 DiLoCo (mean) at 80 and 160 syncs: **`top128`** (0.0400 B/param/sync, 2 seeds)" in md
    assert md.index("`fp32`") < md.index("`int4`") < md.index("`top128`") < md.index("`top64`")


def test_render_writes_between_the_markers_only(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{rep.BEGIN}\nold\n{rep.END}\nafter\n")
    md = rep.render([_pt("fp32", 0, (2.0, 1.8), 4.0), _pt("int4", 0, (2.0, 1.8), 0.5)], str(doc), None)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and md in text


def test_a_tiny_run_resumes_and_counts_payload_bytes(tmp_path):
    pts = tmp_path / "p.jsonl"
    argv = ["--rows", "fp32,top64", "--seeds", "1", "--syncs", "1,2", "--sync-every", "2",
            "--points", str(pts), "--doc", "", "--plot", "", "--timeout", "120"]
    assert frontier.main(argv) == 0
    lines = [json.loads(x) for x in pts.read_text().splitlines()]
    assert [p["row"] for p in lines] == ["fp32", "top64"]
    n = lines[0]["params"]
    for p in lines:
        assert sorted(p["readings"]) == ["1", "2"] and p["step_s"] > 0
    assert lines[0]["readings"]["2"]["bytes_per_param_per_sync"] == Codec("fp32").wire_bytes(n) / n
    assert lines[1]["readings"]["2"]["bytes_per_param_per_sync"] == Codec("sparse", keep=64).wire_bytes(n) / n
    assert frontier.main(argv) == 0  # resumed: every point is there already
    assert len(pts.read_text().splitlines()) == 2
