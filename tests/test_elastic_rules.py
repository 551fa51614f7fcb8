"""The rules of flatcomm.elastic under membership change, checked value by value on 3 gloo ranks with
a scripted stand-in for torchft's Manager (quorums, heals and failures chosen by the test):

* a replica leaves: the survivors' server residuals fold into their client residuals (nothing
  double-counted, nothing dropped); the leaver's residuals are gone;
* a replica heals: it gets the donor's last committed master and momentum (not its weights), starts
  with zero residuals, contributes zero and is not counted: the heal sync's outer step is the
  float64 reference's with the average over the trained replicas only; every master is then
  bit-equal;
* a sync that fails on a replica commits nothing there (master, momentum, residuals as before, the
  inner steps kept in the weights);
* the fold rule itself, and heal states that do not fit (a load that fails changes nothing).
"""
from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]')")

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flatcomm.comm import standalone  # noqa: E402
from flatcomm.tools import spawn  # noqa: E402

H, LR, MU = 3, 0.7, 0.9
# (members, who heals from whom, a member whose sync fails after the exchange)
SCRIPT = [((0, 1, 2), None, None),   # join
          ((0, 1, 2), None, None),
          ((0, 1), None, None),      # 2 is gone
          ((0, 1), None, None),
          ((0, 1, 2), (0, 2), None),  # 2 is back: heals from 0
          ((0, 1, 2), None, None),
          ((0, 1, 2), None, 1)]      # 1's sync fails after the sum


class _Failure:
    def __init__(self, e):
        self.original_exception = e


class FakeManager:
    """What ElasticDiLoCo uses of torchft.Manager, the quorums taken from SCRIPT."""
    _use_async_quorum = False

    def __init__(self, name: str, rank: int, start: int = 0, script=SCRIPT, heal_fails=None):
        from flatcomm.elastic import QuorumGroup
        self._pg, self.name, self.rank, self.round = QuorumGroup(timedelta(seconds=30)), name, rank, start
        self.step, self.err, self.fail_now = start, None, False
        self.script, self.heal_fails = script, heal_fails or {}  # round -> the rank whose heal fails

    def register_state_dict_fn(self, key, load, save):
        self.load, self.save = load, save

    def start_quorum(self, allow_heal=True):
        members, heal, fail = self.script[self.round]
        self.err, self.fail_now = None, fail == self.rank
        if self.heal_fails.get(self.round) == self.rank:
            self.report_error(RuntimeError("the heal's transfer failed (scripted)"))
        if heal is not None:  # the donor's heal state, through the world (every rank is in this round)
            box = [self.save() if self.rank == heal[0] else None]
            dist.broadcast_object_list(box, src=heal[0])
            if self.rank == heal[1]:
                self.load(box[0])
        store = dist.PrefixStore(f"{self.name}/q{self.round}", dist.distributed_c10d._get_default_store())
        self._pg._pg = standalone.gloo_group(store, members.index(self.rank), len(members), timedelta(seconds=30))
        self.round += 1

    def errored(self):
        return self.err

    def report_error(self, e):
        self.err = _Failure(e)

    def should_commit(self, timeout=None):
        if self.fail_now:
            self.report_error(RuntimeError("peer died (scripted)"))
        ok = self.err is None
        self.step += ok
        return ok

    def current_step(self):
        return self.step

    def state_dict(self):
        return {"step": self.step, "batches_committed": 0}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _train(net, opt, rank, steps, at):
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + at + i)
        opt.zero_grad()
        net(torch.randn(8, 11, generator=g) * (rank + 1)).pow(2).mean().backward()
        opt.step()


def _replica(rank, codec, captured):
    from flatcomm.elastic import ElasticDiLoCo, exchange
    torch.manual_seed(0)  # the same start everywhere (rank 2's restart: other weights, healing fixes them)
    net = torch.nn.Sequential(torch.nn.Linear(11, 23), torch.nn.Tanh(), torch.nn.Linear(23, 3))
    real = exchange.sum_over

    def capture(plan, group, delta, residuals, stats):
        before = [delta.clone()] + [r.clone() for r in residuals]
        total = real(plan, group, delta, residuals, stats)
        captured.append({"in": before, "total": total.clone(), "size": group.size()})
        return total
    exchange.sum_over = capture
    return net, ElasticDiLoCo, real, exchange


def _snapshot(outer):
    f = outer.fragment
    return {"master": f.master.clone(), "momentum": f.momentum.clone(), "weights": f.gather(),
            "residuals": [r.clone() for r in f.residuals], "step": outer.step, "syncs": outer.syncs}


def _run(rank, world, codec):
    captured: list = []
    net, ElasticDiLoCo, real, exchange = _replica(rank, codec, captured)
    snaps = []
    try:
        if rank == 2:  # in the first two rounds, then "killed", then restarted (a new process: new objects)
            m = FakeManager(codec, rank)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            outer = ElasticDiLoCo(net, opt, manager=m, sync_every=H, codec=codec, outer_lr=LR, outer_momentum=MU)
            snaps.append(_snapshot(outer))
            _train(net, opt, rank, H, outer.step)
            snaps.append(_snapshot(outer))
            torch.manual_seed(99)
            net = torch.nn.Sequential(torch.nn.Linear(11, 23), torch.nn.Tanh(), torch.nn.Linear(23, 3))
            m = FakeManager(codec, rank, start=4)
        else:
            m = FakeManager(codec, rank)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        outer = ElasticDiLoCo(net, opt, manager=m, sync_every=H, codec=codec, outer_lr=LR, outer_momentum=MU)
        snaps.append(_snapshot(outer))
        while m.round < len(SCRIPT):
            before = _snapshot(outer)
            _train(net, opt, rank, H, outer.step)
            snaps.append({**_snapshot(outer), "before": before, "committed": outer.rounds[-1].committed})
    finally:
        exchange.sum_over = real
    return snaps, captured


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_membership_changes(codec):
    results = spawn.run(3, _run, codec, timeout_s=60)
    (s0, c0), (s1, c1), (s2, c2) = results
    # rounds of ranks 0 and 1: join, 1..6; rank 2: join, 1 | join(heal)=4, 5, 6
    assert len(s0) == len(s1) == 7 and len(s2) == 5
    _check_heal(codec, s0, s1, s2, c0, c1, c2)
    _check_failure(s1)
    if codec == "int4":
        _check_fold(s0, s1, c0, c1)


def _outer64(master, momentum, delta):
    buf = momentum.double() * MU + delta
    return master.double() - LR * (delta + MU * buf), buf


def _check_heal(codec, s0, s1, s2, c0, c1, c2):
    from flatcomm.diloco.state import outer_step
    heal_round, before0 = s2[2], s0[4]["before"]  # rank 2's restart: its join round healed
    # the sums' inputs in the heal round (the 4th sum of ranks 0 and 1): rank 2 sent zeros, with zero residuals
    assert c2[1]["size"] == 3 and all(torch.count_nonzero(t) == 0 for t in c2[1]["in"])
    # the outer step applied the sum divided by the 2 replicas that trained (not 3, no donor twice)
    m, _ = outer_step(before0["master"], before0["momentum"], c0[3]["total"] / 2, LR, MU, True)
    assert torch.equal(s0[4]["master"], m)
    if codec == "fp32":  # and the sum is the float64 one of ranks 0 and 1's pseudo-gradients
        d0, d1 = c0[3]["in"][0].double(), c1[3]["in"][0].double()
        ref, _ = _outer64(before0["master"], before0["momentum"], (d0 + d1) / 2)
        assert (s0[4]["master"].double() - ref).abs().max() < 1e-5
    for s in (s0[4], s1[4], heal_round):
        assert torch.equal(s["master"], s0[4]["master"]) and torch.equal(s["momentum"], s0[4]["momentum"])
        assert torch.equal(s["weights"], s0[4]["master"])
    assert heal_round["step"] == s0[4]["step"] and heal_round["syncs"] == s0[4]["syncs"]
    assert torch.equal(s2[3]["master"], s0[5]["master"])  # the next sync: still bit-equal


def _check_failure(s1):
    failed = s1[6]
    assert not failed["committed"]
    for k in ("master", "momentum"):
        assert torch.equal(failed[k], failed["before"][k])
    assert all(torch.equal(a, b) for a, b in zip(failed["residuals"], failed["before"]["residuals"]))
    assert not torch.equal(failed["weights"], failed["master"])  # the inner steps stay in the weights


def _check_fold(s0, s1, c0, c1):
    for s, c in ((s0, c0), (s1, c1)):
        left = s[2]["before"]["residuals"]  # committed after the last 3-replica sync
        client, server = c[1]["in"][1], c[1]["in"][2]  # what the first 2-replica sum started from
        assert torch.count_nonzero(left[1]) > 0
        assert torch.equal(client, left[0] + left[1]) and torch.count_nonzero(server) == 0
        same = s[3]["before"]["residuals"]  # no change of layout: no fold
        assert torch.equal(c[2]["in"][1], same[0]) and torch.equal(c[2]["in"][2], same[1])


def test_fold_rule():
    from flatcomm.elastic.exchange import Plan, fold
    from flatcomm.ops.codecs import resolve
    plan = Plan(resolve("int4"), "ordered", True)
    c, s = torch.randn(101), torch.zeros(101)
    s[30:60] = torch.randn(30)
    res = [c.clone(), s.clone()]
    assert not fold(plan, res, (0, 3), (0, 3)) and torch.equal(res[0], c) and torch.equal(res[1], s)
    assert fold(plan, res, (0, 3), (0, 2))
    assert torch.equal(res[0], c + s) and torch.count_nonzero(res[1]) == 0
    assert fold(plan, [c.clone(), s.clone()], None, (1, 2))  # no committed layout yet (healed)
    one = [c.clone()]
    assert not fold(Plan(resolve("int4"), "exact", True), one, (0, 3), (0, 2)) and torch.equal(one[0], c)


def test_heal_state_checks():
    from flatcomm.elastic import heal
    good = heal.state(torch.zeros(5), torch.zeros(5), 12, 3, 0xABC)
    heal.check(good, 0xABC, 5)
    bad = [({**good, "fingerprint": 1}, "configuration"), ({**good, "master": torch.zeros(4)}, "master"),
           ({**good, "momentum": torch.full((5,), float("nan"))}, "not finite"), ({**good, "step": -1}, "step"),
           ({**good, "version": 9}, "version"), ({"master": 1}, "keys"), ([], "keys"),
           ({**good, "master": torch.zeros(5, dtype=torch.float64)}, "float32")]
    for sd, what in bad:
        with pytest.raises(ValueError, match=what):
            heal.check(sd, 0xABC, 5)


def test_wrong_managers_and_arguments_are_refused():
    from flatcomm.diloco import DiLoCo
    from flatcomm.elastic import ElasticDiLoCo, QuorumGroup
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="flatcomm.elastic.ElasticDiLoCo"):
        DiLoCo(net, opt, sync_every=2, manager=object())
    from flatcomm.integrations._common import diloco_replica  # every framework adapter's DiLoCo
    with pytest.raises(ValueError, match="flatcomm.elastic.ElasticDiLoCo"):
        diloco_replica(net, net, opt, {"sync_every": 2, "manager": object()})

    class NotOurs:
        _pg, _use_async_quorum = object(), False
    with pytest.raises(TypeError, match="QuorumGroup"):
        ElasticDiLoCo(net, opt, manager=NotOurs(), sync_every=2)
    m = FakeManager("x", 0)
    m._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        ElasticDiLoCo(net, opt, manager=m, sync_every=2)
    m._use_async_quorum = False
    for kw, what in (({"sync_every": 0}, "sync_every"), ({"sync_every": 2, "mode": "fast"}, "mode"),
                     ({"sync_every": 2, "codec": "auto"}, "codec"), ({"sync_every": 2, "outer_momentum": 1.0}, "momentum"),
                     ({"sync_every": 2, "codec": "int5"}, "int5")):
        with pytest.raises((ValueError, TypeError), match=what):
            ElasticDiLoCo(net, opt, manager=m, **kw)
    assert m.round == 0  # refused before any round
    for kw in ({"timeout": timedelta(0)}, {"rendezvous_timeout": timedelta(seconds=-1)}, {"rendezvous_timeout": 5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            QuorumGroup(**kw)
    assert QuorumGroup(timedelta(seconds=3)).rendezvous_timeout == timedelta(seconds=3)  # never above timeout


def _heal_fails(rank, world):
    import time
    from flatcomm.elastic import ElasticDiLoCo
    torch.manual_seed(0)
    net = torch.nn.Linear(11, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    m = FakeManager("heal-fails", rank, script=[((0, 1), None, None)] * 3, heal_fails={1: 1})
    outer = ElasticDiLoCo(net, opt, manager=m, sync_every=H, codec="int4")
    snaps, t0 = [_snapshot(outer)], time.monotonic()
    _train(net, opt, rank, H, 0)
    snaps.append(_snapshot(outer))
    took = time.monotonic() - t0
    _train(net, opt, rank, H, H)
    snaps.append(_snapshot(outer))
    return snaps, [(r.committed, r.error) for r in outer.rounds], took


def test_a_member_that_could_not_join_fails_the_round_at_once():
    (s0, r0, took0), (s1, r1, _) = spawn.run(2, _heal_fails, timeout_s=60)
    assert [c for c, _ in r0] == [c for c, _ in r1] == [True, False, True]
    assert "could not join" in r0[1][1] and "scripted" in r1[1][1]
    assert took0 < 20  # not the 30 s timeout
    for s in (s0, s1):  # the failed round changed nothing; the next one commits, bit-equal
        assert torch.equal(s[1]["master"], s[0]["master"]) and torch.equal(s[1]["momentum"], s[0]["momentum"])
    assert torch.equal(s0[2]["master"], s1[2]["master"]) and not torch.equal(s0[2]["master"], s0[1]["master"])


def _resume(rank, world):
    from flatcomm.elastic import ElasticDiLoCo
    script = [((0, 1), None, None)] * 5

    def replica(name, start=0, resume=None, seed=0):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(11, 23), torch.nn.Tanh(), torch.nn.Linear(23, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)  # stateless: nothing else to save
        m = FakeManager(name, rank, start=start, script=script)
        return net, opt, m, ElasticDiLoCo(net, opt, manager=m, sync_every=H, codec="int4", resume=resume)
    net, opt, m, outer = replica("whole")
    for _ in range(3):  # join, then 3 syncs
        _train(net, opt, rank, H, outer.step)
        if outer.syncs == 2:
            sd = outer.state_dict()
    whole = outer.fragment.master.clone()
    bad = {**sd, "residuals": sd["residuals"][:1]}
    try:
        replica("bad", start=3, resume=bad)
        refused = None
    except ValueError as e:
        refused = str(e)
    net, opt, m, outer = replica("resumed", start=3, resume=sd, seed=5)  # other weights: the checkpoint wins
    assert m.step == sd["torchft"]["step"] + 1 and outer.syncs == 2 and outer.rounds[-1].contributors == 0
    _train(net, opt, rank, H, outer.step)
    return whole, outer.fragment.master.clone(), refused


def test_resume_from_a_checkpoint_continues_bit_for_bit():
    for whole, resumed, refused in spawn.run(2, _resume, timeout_s=60):
        assert torch.equal(whole, resumed)
        assert refused is not None and "residuals" in refused


def test_checkpoint_checks():
    from flatcomm.elastic import heal
    st = heal.state(torch.zeros(5), torch.zeros(5), 12, 3, 0xABC)
    good = heal.checkpoint(st, [torch.zeros(5), torch.zeros(5)], (0, 2), {"step": 4})
    heal.check_checkpoint(good, 0xABC, 5, [5, 5])
    for sd, what in (({**good, "layout": [0]}, "layout"), ({**good, "torchft": {}}, "torchft"),
                     ({**good, "residuals": [torch.zeros(5)]}, "residuals"), (st, "lacks"),
                     ({**good, "residuals": [torch.zeros(5), torch.full((5,), float("inf"))]}, "finite"),
                     ({**good, "fingerprint": 7}, "configuration"), ([], "dict")):
        with pytest.raises(ValueError, match=what):
            heal.check_checkpoint(sd, 0xABC, 5, [5, 5])


def _differ(rank, world):
    from flatcomm.elastic import ElasticDiLoCo
    torch.manual_seed(0)
    net = torch.nn.Linear(11, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    m = FakeManager("differ", rank, script=[((0, 1), None, None)])
    try:
        ElasticDiLoCo(net, opt, manager=m, sync_every=H, verify_every=1 + rank)
    except RuntimeError as e:
        return str(e), m.step
    return None, m.step


def test_replicas_configured_differently_all_raise():
    for msg, step in spawn.run(2, _differ, timeout_s=60):
        assert msg is not None and "configuration" in msg and "[1]" in msg and step == 0


def test_make_manager_advertises_its_hostname():
    """A replica on another host reaches this one's heal transport (and store) at ``hostname``,
    not at this machine's name (torchft's default, which another host may not resolve to it)."""
    from torchft._torchft import LighthouseServer
    from flatcomm.elastic import make_manager
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    m = make_manager("advertised", lh.address(), hostname="localhost", min_replicas=1)
    try:
        assert m._checkpoint_transport.address().startswith("http://localhost:")
        assert m._store.host == "localhost"  # where the quorum's group may meet (not 127.0.0.1)
    finally:
        m.shutdown(wait=False)
        lh.shutdown()
