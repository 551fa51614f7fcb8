"""The pieces of flatcomm.elastic's islands, one process: the global batch stream (disjoint slices,
epochs, a state that resumes bit for bit, broken states refused), the heal state's part and data
fields, what part of the model a rank of an island syncs, and the island's write of a whole
master."""
from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="flatcomm.elastic needs torchft (pip install 'flatcomm[elastic]')")

import torch  # noqa: E402

from flatcomm.elastic import BatchStream, Island, heal  # noqa: E402
from flatcomm.elastic import data as stream_data  # noqa: E402


def test_stream_slices_are_disjoint_and_cover_each_epoch():
    islands, ranks, batch, samples = 3, 2, 5, 67  # 67 // 30 = 2 global batches an epoch, 7 samples dropped
    streams = {(k, r): BatchStream(samples, batch, islands, ranks, seed=9) for k in range(islands) for r in range(ranks)}
    for epoch in range(3):
        seen = []
        for _ in range(2):
            got = [streams[(k, r)].next(k, r) for k in range(islands) for r in range(ranks)]
            assert all(g.numel() == batch for g in got)
            seen += torch.cat(got).tolist()
        assert len(set(seen)) == len(seen) == 60 and all(0 <= i < samples for i in seen), epoch
    orders = [BatchStream(samples, batch, islands, ranks, seed=9) for _ in range(2)]
    firsts = []
    for s in orders[:1]:
        for _ in range(4):
            firsts.append(s.next(0, 0).tolist())
    assert firsts[0] != firsts[2]  # epoch 1 is reshuffled
    assert BatchStream(samples, batch, islands, ranks, seed=10).next(0, 0).tolist() != firsts[0]


def test_stream_state_resumes_bit_for_bit_and_matches_the_schedule():
    a = BatchStream(1000, 7, 2, 2, seed=4)
    for _ in range(80):  # past an epoch boundary (35 global batches an epoch)
        a.next(1, 0)
    sd = a.state_dict()
    b = BatchStream(1000, 7, 2, 2, seed=4)
    b.load_state_dict(sd)
    assert sd["epoch"] == 2 and sd["position"] == 10
    assert [a.next(1, 0).tolist() for _ in range(50)] == [b.next(1, 0).tolist() for _ in range(50)]
    ref = list(stream_data.schedule((1000, 7, 2, 2, 4), 130, 1, 0))
    c = BatchStream(1000, 7, 2, 2, seed=4)
    assert all(c.next(1, 0).tolist() == idx.tolist() for _, idx in ref)
    assert ref[0][0] == 1 and ref[-1][0] == 130


def test_broken_stream_states_are_refused_and_change_nothing():
    s = BatchStream(100, 4, 2, 1, seed=0)
    s.next(0)
    good = s.state_dict()
    bad = [{**good, "shape": [100, 4, 3, 1, 0]}, {k: v for k, v in good.items() if k != "generator"},
           {**good, "position": 99}, {**good, "generator": torch.zeros(3)}, {**good, "epoch": -1}, "state"]
    for sd in bad:
        with pytest.raises(ValueError):
            s.load_state_dict(sd)
    assert s.state_dict()["position"] == 1 and s.next(0).numel() == 4
    with pytest.raises(ValueError):
        BatchStream(10, 4, 2, 2)  # 10 samples do not fill a global batch of 16
    with pytest.raises(ValueError):
        s.next(2)


def test_heal_state_carries_part_and_data_and_checks_them():
    m = torch.randn(11)
    sd = heal.state(m, torch.zeros(11), 40, 4, 123, data={"position": 3, "g": torch.arange(4, dtype=torch.uint8)},
                    part=(1, 2))
    heal.check(sd, 123, 11, (1, 2))
    with pytest.raises(ValueError, match="rank 1 of an island of 2"):
        heal.check(sd, 123, 11, (0, 2))
    with pytest.raises(ValueError, match="'data'"):
        heal.check({**sd, "data": [1]}, 123, 11, (1, 2))
    old = {k: v for k, v in sd.items() if k not in ("data", "part")}
    heal.check({**old, "version": 1}, 123, 11)  # a version-1 checkpoint is still read
    with pytest.raises(ValueError):
        heal.check({**old, "version": 2}, 123, 11)
    sd["data"]["g"][0] = 9  # a copy: the caller's state is not shared
    assert heal.state_bytes({"a": 1, "b": torch.ones(2)}).equal(heal.state_bytes({"b": torch.ones(2), "a": 1}))
    assert not heal.state_bytes({"a": 1}).equal(heal.state_bytes({"a": 2}))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _as_rank(rank: int, size: int) -> Island:
    island = Island(None)
    island.rank, island.size = rank, size  # what a group of `size` ranks would say
    return island


def test_each_rank_of_a_replicated_island_syncs_its_share():
    net = _net()
    named = [(n, p) for n, p in net.named_parameters()]
    total = sum(p.numel() for _, p in named)
    parts = [_as_rank(r, 3).part(named) for r in range(3)]
    sizes = [sum(x.stop - x.start for x in part) for part in parts]
    assert sum(sizes) == total and all(s > 0 for s in sizes)
    covered = [(x.name, i) for part in parts for x in part for i in range(x.start, x.stop)]
    assert len(set(covered)) == total  # disjoint, and every value in one share
    island = _as_rank(0, 3)
    island.part(named)
    assert island.kind == "replicated" and island.gathers
    whole = torch.randn(total)
    island.write_all(whole)
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    assert torch.equal(flat, whole)
    single = Island(None)
    assert [x.name for x in single.part(named)] == [n for n, _ in named] and not single.gathers
    with pytest.raises(TypeError):
        Island("group")


def test_a_manager_made_for_another_island_layout_is_refused():
    from datetime import timedelta

    from flatcomm.elastic import ElasticDiLoCo, QuorumGroup

    class Made:  # what ElasticDiLoCo reads of a torchft Manager before anything else
        _use_async_quorum = False

        def __init__(self, rank, size):
            self._pg, self._group_rank, self._group_world_size = QuorumGroup(timedelta(seconds=5)), rank, size

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rank 1 of an island of 2"):
        ElasticDiLoCo(net, opt, manager=Made(1, 2), sync_every=2)  # no island group: an island of one
    with pytest.raises(TypeError, match="data must have"):
        ElasticDiLoCo(net, opt, manager=Made(0, 1), sync_every=2, data=object())
    with pytest.raises(ValueError, match="state_device"):
        ElasticDiLoCo(net, opt, manager=Made(0, 1), sync_every=2, state_device="gpu")


def test_a_heal_round_that_does_not_commit_puts_torchfts_step_back():
    """A rank that loaded its part in a round that did not commit (another rank of its island, or
    the donor, failed) goes back to torchft's step before the heal: the island heals whole at its
    next round. One process: a quorum of one, the heal and the failure scripted."""
    from datetime import timedelta

    import torch.distributed as dist

    from flatcomm.comm import standalone
    from flatcomm.elastic import ElasticDiLoCo, QuorumGroup

    class Scripted:  # torchft's Manager as ElasticDiLoCo uses it; round n heals from `donor` if asked
        _use_async_quorum, _group_rank, _group_world_size = False, 0, 1

        def __init__(self):
            self._pg, self.step, self.err, self.rounds = QuorumGroup(timedelta(seconds=10)), 0, None, 0
            self.heal_at, self.fail_at, self.donor = set(), set(), None

        def register_state_dict_fn(self, key, load, save):
            self.load = load

        def start_quorum(self, allow_heal=True):
            self.err = None
            if self.rounds in self.heal_at:  # torchft: the step jumps to the donor's, then the state loads
                self.step = 8
                self.load(self.donor)
            store = dist.PrefixStore(f"q{self.rounds}", dist.HashStore())
            self._pg._pg = standalone.gloo_group(store, 0, 1, timedelta(seconds=10))

        def errored(self):
            return self.err

        def report_error(self, e):
            self.err = type("Failure", (), {"original_exception": e})()

        def should_commit(self, timeout=None):
            fail = self.rounds in self.fail_at
            self.rounds += 1
            ok = self.err is None and not fail
            self.step += ok
            return ok

        def current_step(self):
            return self.step

        def state_dict(self):
            return {"step": self.step, "batches_committed": 0}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    m = Scripted()
    net = _net()
    outer = ElasticDiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), manager=m, sync_every=2)
    assert m.step == 1 and outer.rounds[-1].committed  # the join round
    donor = outer._heal_state()
    donor["master"] = donor["master"] + 1.0
    donor["step"] = 16
    m.donor, m.heal_at, m.fail_at = donor, {1, 2}, {1}
    r = outer.sync()  # heals, then the island's commit fails
    assert r.healed and not r.committed and r.healed_to == 16
    assert m.step == 1  # back to before the heal: the island is behind again
    r = outer.sync()  # heals again, and commits
    assert r.healed and r.committed and m.step == 9
    assert torch.equal(outer.fragment.master, donor["master"])
