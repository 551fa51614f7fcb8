"""Short versions of the hardening runs (``python -m flatcomm.tools.hardening fuzz|kills`` runs the
big ones: >= 2,000 fuzzed calls, 200 SIGKILLs): random call arguments with one rank perturbed at a
time on 2 and 4 gloo ranks (flat and 2 x 2), and a peer SIGKILLed mid two-level call."""
from __future__ import annotations

import pytest

from flatcomm.tools import hardening


def test_fuzzed_calls_keep_every_rank_in_step() -> None:
    res = hardening.fuzz(calls=200, worlds=(2, 4), seed=23, pg_timeout=30.0)
    assert res["calls"] == 200
    assert res["errors raised"] > 50 and res["succeeded"] > 20, res  # both kinds of outcome were tried
    assert not res["failures"], "\n".join(res["failures"][:20])


@pytest.mark.slow
def test_survivors_of_a_killed_peer_raise_and_exit_cleanly() -> None:
    res = hardening.kills(count=3, pg_timeout=5.0, seed=23)
    assert not res["failures"], "\n".join(res["failures"])
    assert res["raise s max"] is not None and res["raise s max"] <= 7.0, res
