"""flatcomm.elastic on a real torchft lighthouse (loopback) with 3 replica processes on gloo:
a replica SIGKILLed mid-interval and restarted with the same id heals and, after the next sync,
every master is bit-equal; the survivors keep committing meanwhile; a replica killed during a
sync's transfer makes that sync commit nothing on any survivor, within the timeout; (slow) a donor
killed while another replica heals from it: the heal is retried from the other survivor; (slow) a
replica killed between a quorum's forming and its rendezvous costs the survivors the rendezvous
timeout, not a collective's timeout."""
from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]')")

from _support.elastic_cluster import Cluster  # noqa: E402

TIMEOUT_S = 10.0  # the replicas' collective / should_commit timeout
HEARTBEAT_S = 1.0
RENDEZVOUS_S = 2.0  # the replicas' quorum-group set-up bound


def _rounds(events, rid=None, **match):
    return [e for e in events if e["event"] == "round" and (rid is None or e["id"] == rid)
            and all(e[k] == v for k, v in match.items())]


def _assert_equal_masters(events):
    """Every committed round: each replica that committed it holds the same master."""
    by_step: dict = {}
    for e in _rounds(events, committed=True):
        by_step.setdefault(e["mstep"], set()).add(e["hash"])
    assert by_step and all(len(h) == 1 for h in by_step.values()), by_step


def _kill_mid_interval(c: Cluster, rid: str) -> float:
    """Wait for ``rid`` to be mid-interval after a 3-replica sync, then have it SIGKILL itself at
    its next mid-interval point."""
    c.wait_for(f"{rid} mid-interval", lambda ev: any(
        e["event"] == "mid" and e["id"] == rid and e["mstep"] >= 3 for e in ev))
    return c.kill_mid_interval(rid)


def _survivors_commit(c: Cluster, after: float, n: int) -> list:
    """Wait for r0 and r1 to commit ``n`` rounds of a 2-replica quorum after time ``after``."""
    def ok(ev):
        rs = [_rounds(ev, r, committed=True, quorum=2) for r in ("r0", "r1")]
        rs = [[e for e in x if e["t"] > after] for x in rs]
        return rs if all(len(x) >= n for x in rs) else None
    return c.wait_for(f"{n} survivor rounds", ok, timeout=30)


def _heals(c: Cluster, rid: str, after: float) -> dict:
    def ok(ev):
        got = [e for e in _rounds(ev, rid, committed=True, healed=True) if e["t"] > after]
        return got[0] if got else None
    return c.wait_for(f"{rid} to heal", ok, timeout=60)


def _wait_all_in_sync(c: Cluster, after: float = 0.0) -> None:
    """Wait until each of r0, r1, r2 committed a round that all three contributed to, after ``after``."""
    c.wait_for(f"a sync of all 3 replicas after t={after:.2f}", lambda ev: len({e["id"] for e in _rounds(
        ev, committed=True, quorum=3, contributors=3) if e["t"] > after}) == 3)


def _churn(tmp_path, codec: str, mode: str) -> None:
    c = Cluster(tmp_path, 3, heartbeat_ms=int(HEARTBEAT_S * 1000), codec=codec, mode=mode, timeout=TIMEOUT_S,
                rendezvous_timeout=RENDEZVOUS_S)
    try:
        _wait_all_in_sync(c)
        killed = _kill_mid_interval(c, "r2")
        survived = _survivors_commit(c, killed, 2)
        # the survivors' first sync after the death waits at most the lighthouse's heartbeat timeout
        # (plus an interval and a loaded box's slack), never a collective's timeout
        assert survived[0][0]["t"] - killed < HEARTBEAT_S + TIMEOUT_S / 2
        c.start("r2", die_in_sync=2)  # heals, then dies in its next sync's transfer
        healed = _heals(c, "r2", killed)
        # not counted in its heal sync (its donor's steps count once), and no survivor left out
        assert healed["contributors"] == healed["quorum"] - 1 and healed["quorum"] >= 2
        c.wait_for("r2's death in a sync", lambda ev: c.exitcode("r2") == -9, timeout=60)
        after_death = _survivors_commit(c, healed["t"], 1)
        ev = c.events()
        for rid in ("r0", "r1"):  # the sync r2 died in: nothing committed on either survivor, in time
            failed = [e for e in _rounds(ev, rid, committed=False) if e["t"] > healed["t"]]
            assert failed and failed[0]["quorum"] == 3 and failed[0]["error"], failed
            assert failed[0]["quorum_s"] + failed[0]["exchange_s"] < TIMEOUT_S + 2
            before = [e for e in _rounds(ev, rid, committed=True) if e["t"] < failed[0]["t"]][-1]
            assert failed[0]["hash"] == before["hash"] and failed[0]["mstep"] == before["mstep"]
        assert after_death[0][0]["mstep"] == failed[0]["mstep"] + 1
        c.start("r2")  # the same id again: heals, and the next sync has all three
        back = _heals(c, "r2", after_death[0][0]["t"])
        _wait_all_in_sync(c, after=back["t"])
        c.finish()
        ev = c.events()
        _assert_equal_masters(ev)
        assert {e["id"] for e in ev if e["event"] == "done"} == {"r0", "r1", "r2"}
    finally:
        c.close()


def test_kill_restart_heal_ordered_int4(tmp_path):
    _churn(tmp_path, "int4", "ordered")


@pytest.mark.slow
@pytest.mark.parametrize("codec,mode", [("int4", "exact"), ("int8", "exact"), ("sparse", "ordered")])
def test_kill_restart_heal_other_codecs(tmp_path, codec, mode):
    _churn(tmp_path, codec, mode)


@pytest.mark.slow
def test_donor_killed_during_a_heal(tmp_path):
    marker = tmp_path / "a donor died"
    c = Cluster(tmp_path, 0, heartbeat_ms=int(HEARTBEAT_S * 1000), timeout=TIMEOUT_S)
    try:  # r0 and r1: once armed, the first of them asked for a heal state dies there
        for rid in ("r0", "r1"):
            c.start(rid, die_serving_heal=marker)
        c.start("r2")
        _wait_all_in_sync(c)
        (tmp_path / "a donor died.armed").touch()
        killed = _kill_mid_interval(c, "r2")
        c.start("r2")  # heals from r0 or r1, which dies serving it; then heals from the other
        healed = _heals(c, "r2", killed)
        assert marker.exists()
        failed = [e for e in _rounds(c.events(), "r2", committed=False) if e["t"] > killed]
        # its first join failed with the donor; it joined again at once, without training from its own weights
        assert failed and failed[0]["step"] == 0 and healed["step"] == 0, (failed, healed)
        donor = next(r for r in ("r0", "r1") if c.exitcode(r) == -9)
        c.start(donor)
        _heals(c, donor, healed["t"])
        _wait_all_in_sync(c, after=healed["t"])
        c.finish()
        _assert_equal_masters(c.events())
    finally:
        c.close()


@pytest.mark.slow
def test_replica_killed_before_the_rendezvous(tmp_path):
    c = Cluster(tmp_path, 3, heartbeat_ms=int(HEARTBEAT_S * 1000), timeout=TIMEOUT_S, rendezvous_timeout=RENDEZVOUS_S)
    try:
        _wait_all_in_sync(c)
        killed = _kill_mid_interval(c, "r2")
        armed = tmp_path / "r2 dies at its rendezvous"
        armed.touch()
        # restarted, r2 is in the survivors' next quorum and dies on its way to that quorum's rendezvous
        c.start("r2", die_at_rendezvous=armed)
        c.wait_for("r2's death at the rendezvous", lambda ev: c.events("dying-at-rendezvous"), timeout=30)
        died = c.events("dying-at-rendezvous")[0]["t"]
        ev = c.wait_for("the survivors' next commits", lambda ev: ev if all(
            _rounds(ev, r, committed=True, quorum=2) and _rounds(ev, r)[-1]["t"] > died + 0.5
            and _rounds(ev, r)[-1]["committed"] for r in ("r0", "r1")) else None, timeout=30)
        for rid in ("r0", "r1"):  # each waited for r2 the rendezvous bound, not a collective's timeout
            failed = [e for e in _rounds(ev, rid, committed=False) if e["t"] > killed]
            assert failed and "timeout" in failed[0]["error"], failed
            assert RENDEZVOUS_S - 0.5 < failed[0]["t"] - died < RENDEZVOUS_S + 2.5 < TIMEOUT_S, (failed, died)
            again = [e for e in _rounds(ev, rid, committed=True) if e["t"] > died][0]
            assert again["t"] - died < RENDEZVOUS_S + HEARTBEAT_S + 2.0, (again, died)
        c.start("r2")
        back = _heals(c, "r2", died)
        _wait_all_in_sync(c, after=back["t"])
        c.finish()
        _assert_equal_masters(c.events())
    finally:
        c.close()
