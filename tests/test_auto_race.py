"""codec="auto" confirms a measured decision by racing it against the safe choice
(flatcomm.autotune.race): the verdict rule, agreement across ranks, and the Tuner's use of it."""
from __future__ import annotations

import math

import pytest
import torch

from flatcomm.autotune import CostModel, Tuner
from flatcomm.autotune import race as R
from flatcomm.tools import spawn


@pytest.mark.parametrize("cand,safe,expect", [
    ([1.0, 1.1, 1.0], [2.0, 2.1, 2.2], "int8"),       # separated: every candidate run faster
    ([1.0, 1.1, 1.96], [2.0, 2.1, 2.2], None),        # not beyond the margin yet: race on
    ([2.3, 2.5, 2.4], [2.0, 2.1, 2.2], "backend"),    # the candidate's best no faster than the safe worst
    ([1.0, 3.0] * 4, [2.0] * 8, "backend"),           # never separated within MAX_ROUNDS: the safe choice
    ([1.0, 1.0], [5.0, 5.0], None),                   # too few rounds to tell
])
def test_verdict(cand, safe, expect):
    assert R._verdict(cand, safe, "int8", "backend") == expect


def test_safe_choice_is_the_backend_only_without_determinism():
    assert R.safe_choice(False, "all_reduce") == "backend"
    assert R.safe_choice(True, "all_reduce") == "fp32"
    assert R.safe_choice(False, "reduce_scatter") == "fp32"


class _Fake:
    def __init__(self, codec: str):
        self.codec = codec

    def __call__(self) -> None:
        pass


def _fast_link_costs() -> CostModel:
    """Costs under which the model predicts int8 fastest (a slow link)."""
    c = {k: 4e9 for k in ("fp32", "bf16", "int8", "int4", "sign")}
    return CostModel(link_Bps=1e8, latency_s=1e-5, compute_Bps=c, rs_compute_Bps=c, backend_Bps=1e8,
                     backend_latency_s=1e-5)


def _rank_fake(rank: int, world: int, times: dict) -> list:
    # Rank-dependent fake times per codec: the race must use the slowest rank's, on every rank.
    R._runner = lambda codec, kind, n, w, group, device: _Fake(codec)
    R._timed = lambda fn, device: times[fn.codec][rank]
    out = []
    t = Tuner("int8", costs=_fast_link_costs())
    t._measured = True  # as if measured here: decisions are raced
    d = t.choose(1 << 20, deterministic=False)
    out.append((d.codec, d.raced, "raced" in d.reason))
    t2 = Tuner("int8", costs=_fast_link_costs())  # given costs: never raced
    out.append(t2.choose(1 << 20, deterministic=False).codec)
    return out


@pytest.mark.parametrize("times,expect", [
    ({"int8": [0.5, 0.6], "backend": [1.0, 1.0]}, "int8"),
    # rank 0 alone would keep int8; the slowest rank (1) does not beat the backend: kept on both
    ({"int8": [0.5, 1.3], "backend": [1.0, 1.0]}, "backend"),
])
def test_race_decides_on_the_slowest_rank_the_same_everywhere(times, expect):
    got = spawn.run(2, _rank_fake, times, timeout_s=60)
    assert got[0] == got[1], got
    (codec, raced, said), unraced = got[0]
    assert codec == expect and raced == ("int8", "backend") and said, got
    assert unraced == "int8", got  # the model's choice where costs were given


def _rank_real(rank: int, world: int) -> tuple:
    import flatcomm
    g = flatcomm.collectives.private_group(None)
    r = R.race("int8", "backend", 1 << 16, g)
    return r.winner, len(r.candidate_s), r.candidate_s, r.safe_s


def test_real_race_finishes_and_agrees():
    got = spawn.run(2, _rank_real, timeout_s=60)
    assert got[0] == got[1], got
    winner, rounds, cand, safe = got[0]
    assert winner in ("int8", "backend") and R.MIN_ROUNDS <= rounds <= R.MAX_ROUNDS
    assert all(math.isfinite(x) and x > 0 for x in cand + safe)
