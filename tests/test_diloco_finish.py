"""DiLoCo.finish(): with fragments=2 and fragment_sync_delay=1 (a sync in flight, local steps since
every fragment's last sync) every replica ends with the same weights, bit for bit, equal to the
masters; a second call does nothing; training and checkpoints go on after it (2 gloo ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from flatcomm.diloco import DiLoCo
from flatcomm.tools import spawn

H = 8


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))


def _train(net, opt, steps, rank, start):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + t)
        opt.zero_grad()
        net(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        opt.step()


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _same_everywhere(t):
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return all(torch.equal(r.view(torch.int32), rows[0].view(torch.int32)) for r in rows)


def _finish(rank, world):
    out = {}
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    outer = DiLoCo(net, opt, sync_every=H, codec="int4", fragments=2, fragment_sync_delay=1,
                   fragment_update_alpha=0.5)
    _train(net, opt, 12, rank, 0)  # fragment 1 started at 12 (in flight); fragment 0 local since 9
    out["in flight"] = outer.pending is not None
    out["differ before"] = not _same_everywhere(_flat(net))
    syncs = outer.syncs
    outer.finish()
    w = _flat(net)
    out["equal"] = _same_everywhere(w)
    out["weights are masters"] = torch.equal(w, torch.cat([f.master for f in outer.fragments]))
    out["extra syncs"] = outer.syncs - syncs  # the one in flight, and fragment 1's now
    sd = outer.state_dict()
    outer.finish()  # idempotent: nothing changes
    out["idempotent"] = torch.equal(_flat(net), w) and outer.syncs == syncs + 2
    outer.load_state_dict(sd)  # a checkpoint written after finish() loads
    _train(net, opt, 6, rank, 12)  # training goes on: fragment 0 starts at 16, applied at 17
    out["syncs after"] = outer.syncs - syncs
    outer.finish()
    out["equal again"] = _same_everywhere(_flat(net))
    return out


def test_finish_gives_every_replica_the_same_weights():
    res = spawn.run(2, _finish, timeout_s=60)
    for rank, out in enumerate(res):
        assert out["in flight"] and out["differ before"], out
        assert out["equal"] and out["weights are masters"], f"rank {rank}: replicas differ after finish(): {out}"
        assert out["extra syncs"] == 2 and out["idempotent"], out
        assert out["syncs after"] == 3 and out["equal again"], out
