"""A call that fails mid-way leaves no transfer pending (issue 23, class 8): gloo ends a process
with ``terminate called without an active exception`` when a group is torn down with
point-to-point work still in flight. The kill runs (tests/test_hardening_runs.py,
``python -m flatcomm.tools.hardening kills``) hit that only now and then; these tests pin the
mechanism down: after the first failed wait, every other transfer of the call is waited for."""
from __future__ import annotations

import pytest

from flatcomm.comm import header, node, pipeline


class FakeWork:
    def __init__(self, fails: bool = False):
        self.fails, self.waited = fails, False

    def wait(self):
        self.waited = True
        if self.fails:
            raise RuntimeError("peer closed the connection")
        return True


def _pipeline() -> pipeline.Pipeline:
    """A Pipeline without a group (these tests drive its parts by hand)."""
    pipe = pipeline.Pipeline.__new__(pipeline.Pipeline)
    pipe.header, pipe.taken = None, []
    return pipe


def test_node_exchange_waits_for_every_transfer_after_a_failure(monkeypatch) -> None:
    works = [FakeWork(), FakeWork(fails=True), FakeWork(), FakeWork(fails=True), FakeWork()]
    monkeypatch.setattr(node.dist, "batch_isend_irecv", lambda ops: works)
    with pytest.raises(RuntimeError, match="peer closed"):
        node._exchange(["op"])  # type: ignore[list-item]
    assert all(w.waited for w in works)


def test_pipeline_drains_exchanges_in_flight_when_a_chunk_fails() -> None:
    pipe = _pipeline()
    sent = {j: FakeWork() for j in range(3)}

    def reduce(j, work):
        work.wait()
        raise RuntimeError(f"decode of chunk {j} failed")

    with pytest.raises(RuntimeError, match="chunk 0"):
        pipe.run(3, lambda j: sent[j], reduce, None)
    assert sent[1].waited  # sent before chunk 0 was reduced: in flight when it failed
    assert not sent[2].waited  # never sent


def test_pipeline_settles_its_header_exchange_on_failure() -> None:
    pipe = _pipeline()

    class Header:  # a CallHeader whose exchange failed
        work = FakeWork(fails=True)

        def finish(self):
            self.work.wait()

        def abandoned(self):
            header.CallHeader.abandoned(self)  # type: ignore[arg-type]

    pipe.header = Header()  # type: ignore[assignment]
    with pytest.raises(ValueError):
        with pipe:
            raise ValueError("an argument the body rejected")
    assert Header.work.waited and pipe.header is None


def _groups_released(rank: int, world: int) -> dict:
    """flatcomm keeps no process group alive: a group only the program still holds (as a DDP
    model holds its group after ``destroy_process_group``) would keep gloo's threads running into
    interpreter exit, where a thread finishing an op's clean-up needs the GIL and aborts."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from flatcomm import collectives as C

    sub = dist.new_group(list(range(world)))  # the world's backend (gloo, or flatcomm's)
    x = torch.arange(7, dtype=torch.float32)
    C.all_reduce(x, group=sub)
    private = C.private_group(sub)
    refs = {"parent": weakref.ref(sub), "private": weakref.ref(private)}
    dist.destroy_process_group(sub)  # the program still holds sub
    listed = private in dist.distributed_c10d._world.pg_map
    if listed:  # a plain gloo parent: no hook tells flatcomm (its private group goes with sub)
        dist.destroy_process_group(private)
    del private
    gc.collect()
    out = {"mean": x.tolist(), "private_freed_while_parent_held": refs["private"]() is None,
           "private_listed_after_parent_destroyed": listed}
    del sub
    gc.collect()
    out["private_freed"] = refs["private"]() is None
    out["parent_freed"] = refs["parent"]() is None
    return out


@pytest.mark.parametrize("backend", ["gloo", "flatcomm"])
def test_flatcomm_keeps_no_destroyed_group_alive(backend: str) -> None:
    from flatcomm.tools import spawn

    for r in spawn.run(2, _groups_released, backend=backend):
        assert r["mean"] == [float(i) for i in range(7)]  # the average of equal tensors
        assert r["parent_freed"] and r["private_freed"], r
        # A flatcomm group's shutdown (what destroy_process_group calls) drops its private group;
        # a plain gloo group has no such hook: its private group goes with the parent.
        assert r["private_freed_while_parent_held"] == (backend == "flatcomm"), r
        # ... and unregisters it from torch (destroyed with its parent).
        assert r["private_listed_after_parent_destroyed"] == (backend != "flatcomm"), r
