"""The churn bench's summary (flatcomm.tools.bench.churn.summarize) on a hand-made event log: the
survivors' steps per second, the time from a death to the next committed sync, the heal time, and
masters that differ after a committed sync caught."""
from __future__ import annotations

import pytest

from flatcomm.tools.bench.churn import summarize


def _round(rid, t, mstep, step, committed=True, quorum=3, healed=False, h=7, started=0.0):
    return {"event": "round", "id": rid, "t": t, "started": started, "mstep": mstep, "step": step,
            "committed": committed, "quorum": quorum, "contributors": quorum, "healed": healed, "hash": h}


def _log(victim_hash=7):
    ev = []
    for rid in ("r0", "r1"):
        ev += [_round(rid, 1.0, 1, 10), _round(rid, 2.0, 2, 20, quorum=2), _round(rid, 3.5, 3, 30),
               {"event": "done", "id": rid, "t": 4.0, "started": 0.0, "step": 40, "heldout": 2.5, "hash": 9}]
    ev += [_round("r2", 1.0, 1, 10),  # killed at t = 1.5, restarted at 1.6, healed at the sync of t = 3.5
           _round("r2", 3.5, 3, 30, healed=True, started=1.6, h=victim_hash),
           {"event": "done", "id": "r2", "t": 4.0, "started": 1.6, "step": 40, "heldout": 2.5, "hash": 9}]
    return ev


def test_summary_of_a_churn_run():
    s = summarize(_log(), [1.5], ["r0", "r1"], "r2")
    assert s["steps_per_s"] == pytest.approx(30 / 3.0)  # 10 -> 40 between the first full sync and the end
    assert s["death_to_commit_s"] == [pytest.approx(0.5)]
    assert s["start_to_heal_s"] == [pytest.approx(1.9)]
    assert s["masters_equal"] and s["final_equal"] and s["syncs"] == 3 and s["heldout"] == 2.5


def test_summary_catches_unequal_masters():
    assert not summarize(_log(victim_hash=8), [1.5], ["r0", "r1"], "r2")["masters_equal"]
