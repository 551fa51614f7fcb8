"""flatcomm.tools.bench.wallclock (the user's number): reading the loss at the budget and the time to a
target off a held-out curve, the summary over seeds (paired with int4's loss of the same seed, skipped
rows kept with their reason), the table and its rendering between the doc's markers; the clock's
schedule. A tiny run on the namespace link is left to the slow tests (it needs root)."""
from __future__ import annotations

import pytest

from flatcomm.tools.bench import wallclock_report as rep
from flatcomm.tools.bench.wallclock import lr_factor


def test_loss_at_interpolates_and_holds_the_ends():
    curve = [[0.0, 4.0], [10.0, 3.0], [20.0, 2.0], [31.0, 1.9]]
    assert rep.loss_at(curve, 0.0) == 4.0
    assert rep.loss_at(curve, 15.0) == pytest.approx(2.5)
    assert rep.loss_at(curve, 30.0) == pytest.approx(2.0 - 0.1 * 10 / 11)
    assert rep.loss_at(curve, 99.0) == 1.9


def test_time_to_target_is_the_first_crossing_within_the_budget():
    curve = [[0.0, 4.0], [10.0, 3.0], [20.0, 2.0], [25.0, 2.5], [30.0, 1.0]]
    assert rep.time_to(curve, 2.5) == pytest.approx(15.0)  # the first crossing, not the later one
    assert rep.time_to(curve, 4.5) == 0.0
    assert rep.time_to(curve, 0.5) is None
    assert rep.time_to(curve, 1.5, until=25.0) is None  # reached after the budget only
    assert rep.time_to(curve, 1.5) == pytest.approx(28.0 + 1 / 3)


def _pt(row, seed, evals, **kw):
    return {"row": row, "seed": seed, "link": "10mbit", "seconds": 30.0, "size": "100k", "evals": evals,
            "step_s": 0.1, "syncs": 20, "tx_bytes_per_param_per_sync": 0.5, "params": 1000, "H": 15, **kw}


def test_a_run_reaches_its_own_loss_at_the_budget():
    curve = [[0.0, 4.9], [135.1, 1.2], [150.31, 1.1433]]
    for budget in (150.0, 149.7, 143.3):
        assert rep.time_to(curve, rep.loss_at(curve, budget), until=budget) == pytest.approx(budget)


def test_summary_pairs_targets_by_seed_and_keeps_skipped_rows():
    pts = [_pt("int4", 0, [[0, 4.0], [30, 2.0]]), _pt("int4", 1, [[0, 4.0], [30, 3.0]]),
           _pt("ddp", 0, [[0, 4.0], [30, 3.0]]), _pt("ddp", 1, [[0, 4.0], [30, 3.5]]),
           _pt("auto", 0, [[0, 4.0], [20, 2.0], [32, 1.6]], auto={"codec": "sparse", "keep": 256}),
           _pt("auto", 1, [[0, 4.0], [30, 2.0]], auto={"codec": "int4", "keep": 0}),
           {"row": "torchft", "seed": 0, "link": "10mbit", "seconds": 30.0, "skipped": "no torchft"}]
    s = rep.summarize(pts)["10mbit"]
    assert s["best"] == "auto"
    r = s["rows"]
    assert r["int4"]["loss"]["mean"] == pytest.approx(2.5) and r["int4"]["to_target"]["mean"] == pytest.approx(30)
    assert r["int4"]["reached"] == 2  # its own loss at the budget, at the budget
    assert r["ddp"]["reached"] == 0 and r["ddp"]["paired"] == 2 and r["ddp"]["to_target"]["n"] == 0
    auto = r["auto"]
    assert auto["loss"]["min"] == pytest.approx(1.6 + 0.4 * 2 / 12) and auto["loss"]["max"] == pytest.approx(2.0)
    # seed 0: int4's 2.0 reached at 20 s; seed 1: int4's 3.0 at 15 s
    assert (auto["to_target"]["min"], auto["to_target"]["max"]) == (pytest.approx(15.0), pytest.approx(20.0))
    assert r["torchft"]["skipped"] == ["no torchft"] and r["torchft"]["loss"]["n"] == 0
    md = rep.markdown(rep.summarize(pts))
    assert "skipped: no torchft" in md and "picked sparse top-256 x1, int4 x1" in md
    assert "Lowest held-out loss at the budget: **DiLoCo `codec=\"auto\"`**" in md


def test_render_between_the_markers(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"head\n{rep.BEGIN}\nold\n{rep.END}\ntail\n")
    s = rep.summarize([_pt("int4", 0, [[0, 4.0], [30, 2.0]])])
    md, written = rep.render(s, str(doc))
    assert written and doc.read_text() == f"head\n{rep.BEGIN}\n{md}{rep.END}\ntail\n" and "old" not in md


def test_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0.0) == pytest.approx(0.01) and lr_factor(0.05) == pytest.approx(0.5)
    assert lr_factor(0.1) == pytest.approx(1.0) and lr_factor(1.0) == pytest.approx(0.1)
    assert lr_factor(2.0) == pytest.approx(0.1)
