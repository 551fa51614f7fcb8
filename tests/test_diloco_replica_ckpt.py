"""A DiLoCo state_dict() records the replica it belongs to: loading another replica's state raises
on every replica and changes nothing on any; each loads its own; a version-1 checkpoint (no
replica recorded) loads with a warning; verify_every may change at a resume, other options may not
and the error names those that differ (2 gloo ranks, a sync in flight)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from flatcomm.diloco import DiLoCo
from flatcomm.tools import spawn


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 2))


def _snapshot(outer):
    p = outer.pending
    return ([(f.master.clone(), f.momentum.clone(), [r.clone() for r in f.residuals]) for f in outer.fragments],
            outer.step, outer.syncs, None if p is None else (p.fragment, p.started))


def _same(a, b):
    fa, *ca = a
    fb, *cb = b
    return ca == cb and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and
                            all(torch.equal(r, q) for r, q in zip(x[2], y[2])) for x, y in zip(fa, fb))


def _swap(rank, world):
    out = {}
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=4, codec="int8", fragments=2, fragment_sync_delay=1)
    for t in range(6):  # fragment 1 starts after step 6: in flight
        g = torch.Generator().manual_seed(100 * rank + t)
        opt.zero_grad()
        net(torch.randn(4, 9, generator=g)).pow(2).mean().backward()
        opt.step()
    sd = outer.state_dict()
    out["recorded"] = sd["replica"]
    parts = [None] * world
    dist.all_gather_object(parts, sd)
    before = _snapshot(outer)
    try:
        outer.load_state_dict(parts[1 - rank])  # the other replica's file
        out["swapped"] = ""
    except ValueError as e:
        out["swapped"] = str(e)
    out["unchanged"] = _same(before, _snapshot(outer))
    outer.load_state_dict(parts[rank])
    out["own loads"] = _same(before, _snapshot(outer))
    old = {k: v for k, v in sd.items() if k not in ("replica", "finished_at", "options")}
    old["version"], old["config"] = 1, f"{outer.config.fingerprint():016x}"  # version 1 hashed verify_every too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer.load_state_dict(old)
    out["v1 warning"] = [str(w.message) for w in caught if "does not record the replica" in str(w.message)]
    outer.close()
    # verify_every is a check, not state: it may change at a resume; other options may not, and
    # the error lists those that differ
    for name, kw in (("verify_every on", dict(sync_every=4, verify_every=1)),
                     ("other options", dict(sync_every=8, outer_lr=0.5))):
        fresh = _net()
        again = DiLoCo(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), codec="int8", fragments=2,
                       fragment_sync_delay=1, **kw)
        try:
            again.load_state_dict(parts[rank])
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
        again.close()
    return out


def test_another_replicas_state_raises_everywhere_and_changes_nothing():
    res = spawn.run(2, _swap, timeout_s=60)
    for rank, out in enumerate(res):
        assert out["recorded"] == {"rank": rank, "world_size": 2}, out["recorded"]
        msg = out["swapped"]
        for word in ("rank 0 failed", "rank 1 failed", "belongs to replica 1 of 2 and this is replica 0 of 2",
                     "belongs to replica 0 of 2 and this is replica 1 of 2", "own file"):
            assert word in msg, f"rank {rank}: {word!r} missing in {msg!r}"
        assert out["unchanged"] and out["own loads"], out
        assert out["v1 warning"], out
        assert out["verify_every on"] == "", out["verify_every on"]
        msg = out["other options"]
        for word in ("sync_every saved 4, now 8", "outer_lr saved 0.7, now 0.5", "verify_every may change"):
            assert word in msg, f"{word!r} missing in {msg!r}"
        assert "fragments saved" not in msg and "codec saved" not in msg, msg
