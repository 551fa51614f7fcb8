"""DiLoCo refuses a DistributedDataParallel whose all-reduce spans replicas (it would average every
gradient at every inner step, under the outer syncs): passed itself, or wrapping the module given;
``allow_ddp=True`` accepts it; a DDP inside one replica is fine (2 gloo ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flatcomm.diloco import DiLoCo
from flatcomm.tools import spawn


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _refused(make) -> str:
    try:
        outer = make()
    except ValueError as e:
        return str(e)
    outer.close()
    return ""


def _cases(rank, world):
    singles = [dist.new_group([r]) for r in range(world)]  # every rank calls new_group for each
    out = {}
    net = _net()
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out["ddp passed"] = _refused(lambda: DiLoCo(ddp, opt, sync_every=2))
    out["module under ddp"] = _refused(lambda: DiLoCo(net, opt, sync_every=2))
    out["allow_ddp"] = _refused(lambda: DiLoCo(net, opt, sync_every=2, allow_ddp=True))
    out["bad allow_ddp"] = ""
    try:
        DiLoCo(net, opt, sync_every=2, allow_ddp="yes")
    except TypeError as e:
        out["bad allow_ddp"] = str(e)
    del ddp
    plain = _net()
    out["plain"] = _refused(lambda: DiLoCo(plain, torch.optim.SGD(plain.parameters(), lr=0.1), sync_every=2))
    inner = _net()
    inner_ddp = DDP(inner, process_group=singles[rank])  # a replica of one rank: DDP inside it only
    out["ddp inside a replica"] = _refused(
        lambda: DiLoCo(inner_ddp, torch.optim.SGD(inner_ddp.parameters(), lr=0.1), sync_every=2))
    return out


def test_ddp_across_replicas_refused_unless_allowed():
    res = spawn.run(2, _cases, timeout_s=60)
    for rank, out in enumerate(res):
        for case in ("ddp passed", "module under ddp"):
            msg = out[case]
            for word in ("DistributedDataParallel", "every inner step", "ddp.module", "allow_ddp=True", "[0, 1]"):
                assert word in msg, f"rank {rank} {case}: {word!r} missing in: {msg!r}"
        assert out["allow_ddp"] == "" and out["plain"] == "" and out["ddp inside a replica"] == "", (rank, out)
        assert "allow_ddp" in out["bad allow_ddp"], out["bad allow_ddp"]
