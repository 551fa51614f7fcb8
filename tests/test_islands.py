"""flatcomm.elastic over islands of 2 ranks (DDP or FSDP2 inside) on a real torchft lighthouse
(loopback), the islands brought back the way torchrun does (a dead rank takes its island down; the
launcher starts the whole island again):

* a rank SIGKILLed mid-interval, a rank SIGKILLed during a sync's transfer, a rank SIGKILLed while
  its island heals, a whole island SIGKILLed: the survivors commit their next sync within the
  heartbeat timeout + 1 s (+ the rest of their interval), nothing hangs, the restarted island
  heals shard by shard (each rank receives exactly its part of master + momentum) and after the
  next sync rank i's master part hashes equal on every island;
* every island's batches are the failure-free schedule's minus the documented lost interval: the
  exact sample indices of every step, no step read twice, none skipped but the outage.
"""
from __future__ import annotations

import zlib

import pytest

pytest.importorskip("torchft", reason="flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]')")

from _support.island_cluster import Islands  # noqa: E402

from flatcomm.elastic import data as stream_data  # noqa: E402

HEARTBEAT_S = 1.0
TIMEOUT_S = 10.0
H = 4


def _rounds(ev, island=None, **match):
    return [e for e in ev if e["event"] == "round" and (island is None or e["island"] == island)
            and all(e[k] == v for k, v in match.items())]


def _all_in_sync(c: Islands, after: float = 0.0) -> float:
    """Wait until every rank of every island committed a round all islands contributed to."""
    want = {(k, r) for k in range(c.n) for r in range(c.size)}
    got = c.wait_for(f"a sync of all islands after {after:.2f}", lambda ev: [e for e in _rounds(
        ev, committed=True, quorum=c.n, contributors=c.n) if e["t"] > after] if want <= {
        (e["island"], e["rank"]) for e in _rounds(ev, committed=True, quorum=c.n, contributors=c.n)
        if e["t"] > after} else None)
    return max(e["t"] for e in got)


def _survivor_commit(c: Islands, island: int, after: float) -> float:
    """When every rank of ``island`` next committed a round after ``after``."""
    got = c.wait_for(f"island {island} to commit after {after:.2f}", lambda ev: [
        min(e["t"] for e in _rounds(ev, island, committed=True, rank=r) if e["t"] > after)
        for r in range(c.size)] if all(any(e["t"] > after for e in _rounds(ev, island, committed=True, rank=r))
                                       for r in range(c.size)) else None)
    return max(got)


def _healed(c: Islands, island: int, after: float) -> list:
    """Every rank of ``island``'s committed heal round after ``after``."""
    def ok(ev):
        rs = [[e for e in _rounds(ev, island, committed=True, healed=True, rank=r) if e["t"] > after]
              for r in range(c.size)]
        return [x[0] for x in rs] if all(rs) else None
    return c.wait_for(f"island {island} to heal", ok, timeout=60)


def _check_parts_equal(ev, size: int) -> None:
    """After every committed round, rank i's master part is the same on every island."""
    by = {}
    for e in _rounds(ev, committed=True):
        by.setdefault((e["mstep"], e["rank"]), set()).add(e["hash"])
    assert by and all(len(h) == 1 for h in by.values()), {k: v for k, v in by.items() if len(v) > 1}


def _check_heal_sizes(heals: list, size: int) -> None:
    """A rank's heal carries its part of master + momentum (8 bytes a value) and nothing else big."""
    for e in heals:
        assert 8 * e["part"] <= e["heal_bytes"] <= 8 * e["part"] + 16384, e
        assert 0 < e["heal_s"] < TIMEOUT_S, e


def _check_batches(ev, islands: int, size: int) -> None:
    """Each rank's batches, over all its island's incarnations: the reference schedule's indices at
    every step it read, strictly increasing steps (nothing twice), and a gap only where its island
    was out: from the dead incarnation's last step to the step the next one healed at."""
    last = max(e["step"] for e in ev if e["event"] == "batch")
    for k in range(islands):
        for r in range(size):
            ref = {t: zlib.crc32(idx.numpy().tobytes()) for t, idx in stream_data.schedule(
                (4096, 4, islands, size, 3), last, k, r)}
            mine = [e for e in ev if e["event"] == "batch" and e["island"] == k and e["rank"] == r]
            steps = [e["step"] for e in mine]
            assert steps == sorted(set(steps)), f"island {k} rank {r} read a step twice: {steps}"
            assert all(e["crc"] == ref[e["step"]] for e in mine), f"island {k} rank {r} read other samples"
            heal_steps = {e["inc"]: e["healed_to"] for e in _rounds(ev, k, rank=r, committed=True, healed=True)}
            assert steps[0] == heal_steps.get(mine[0]["inc"], 0) + 1  # a late starter heals first
            for prev, nxt in zip(mine, mine[1:]):
                if nxt["step"] != prev["step"] + 1:  # only across an outage, to the healed step + 1
                    assert nxt["inc"] > prev["inc"], (k, r, prev, nxt)
                    assert nxt["step"] == heal_steps.get(nxt["inc"], -1) + 1, (k, r, prev, nxt, heal_steps)


def _dies(c: Islands, k: int, where: str, after: float) -> float:
    return c.wait_for(f"island {k}'s death in {where}", lambda ev: [
        e["t"] for e in c.events("dying") if e["island"] == k and e["where"] == where and e["t"] > after])[0]


def _survivors_in_time(c: Islands, survivor: int, died: float) -> None:
    """The survivors' next commit after a death: within the heartbeat timeout + 1 s, plus the rest
    of their interval (H steps of at most 0.5 s on a loaded box)."""
    first = _survivor_commit(c, survivor, died)
    assert first - died < HEARTBEAT_S + 1.0 + H * 0.5, (survivor, first - died)


def _churn_2x2(tmp_path, kind: str, codec: str = "int4", mode: str = "ordered") -> None:
    c = Islands(tmp_path, 2, 2, heartbeat_ms=int(HEARTBEAT_S * 1000), kind=kind, codec=codec, mode=mode,
                timeout=TIMEOUT_S, sync_every=H)
    try:
        heals = []
        t = _all_in_sync(c)
        # 1. rank 1 of island 1 dies mid-interval: island 1 goes down whole, island 0 goes on; the
        #    restarted island 1's rank 0 dies while it receives its heal; the next one heals
        c.arm(1, 0, "heal")
        c.arm(1, 1, "die")
        died = _dies(c, 1, "mid", t)
        _survivors_in_time(c, 0, died)
        _dies(c, 1, "heal", died)
        heals += _healed(c, 1, died)
        t = _all_in_sync(c, after=max(e["t"] for e in heals))
        # 2. rank 1 of island 0 dies during a sync's transfer
        c.arm(0, 1, "sync")
        died = _dies(c, 0, "sync", t)
        _survivors_in_time(c, 1, died)
        heals += _healed(c, 0, died)
        t = _all_in_sync(c, after=max(e["t"] for e in heals))
        # 3. a whole island (1) is lost: island 0 goes on alone, island 1 comes back and heals
        killed = c.kill_island(1)
        _survivors_in_time(c, 0, killed)
        heals += _healed(c, 1, killed)
        _all_in_sync(c, after=max(max(e["t"] for e in heals), t))
        c.finish()
        ev = c.events()
        _check_heal_sizes(heals, 2)
        _check_parts_equal(ev, 2)
        _check_batches(ev, 2, 2)
        assert len({(e["island"], e["rank"]) for e in ev if e["event"] == "done"}) == 4
    finally:
        c.close()


def test_islands_2x2_ddp_churn(tmp_path):
    _churn_2x2(tmp_path, "ddp")


@pytest.mark.slow
def test_islands_2x2_fsdp2_churn(tmp_path):
    _churn_2x2(tmp_path, "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("kind,codec,mode", [
    ("fsdp", "int8", "exact"), ("ddp", "sparse", "ordered"), ("ddp", "int4", "exact")])
def test_islands_2x2_other_codecs_and_modes(tmp_path, kind, codec, mode):
    _churn_2x2(tmp_path, kind, codec, mode)


@pytest.mark.slow
def test_islands_3x2_donor_dies_while_another_island_heals(tmp_path):
    """Island 2 is lost whole; when it comes back, the rank of the live island that serves it a
    part dies mid-heal: that island goes down too, island 2 heals from the third island (or from
    the restarted one once it healed), and all three end equal, no batch twice or skipped."""
    c = Islands(tmp_path, 3, 2, heartbeat_ms=int(HEARTBEAT_S * 1000), kind="ddp", timeout=TIMEOUT_S, sync_every=H)
    try:
        t = _all_in_sync(c)
        (tmp_path / "donor.armed").touch()  # the first rank asked for its part dies
        killed = c.kill_island(2)
        died = _dies_any(c, "serving", killed)
        donor = died["island"]
        assert donor in (0, 1)
        survivor = 1 - donor
        _survivors_in_time(c, survivor, died["t"])
        heals = _healed(c, 2, killed) + _healed(c, donor, died["t"])
        _all_in_sync(c, after=max(max(e["t"] for e in heals), t))
        c.finish()
        ev = c.events()
        _check_heal_sizes(heals, 2)
        _check_parts_equal(ev, 2)
        _check_batches(ev, 3, 2)
    finally:
        c.close()


def _dies_any(c: Islands, where: str, after: float) -> dict:
    return c.wait_for(f"a death in {where}", lambda ev: [
        e for e in c.events("dying") if e["where"] == where and e["t"] > after])[0]
