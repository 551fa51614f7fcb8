"""What a user runs first, from the installed wheel, on 2 gloo ranks: a DiLoCo sync (with
``verify_every``, which hashes the masters), a ``flatcomm`` backend all_reduce and a DDP step with
flatcomm's comm hook. `.ci/dist_check.sh` runs it in a fresh venv without numpy (not a run-time
dependency), from a directory outside the checkout.

    python dist_smoke.py            # starts 2 ranks of itself (file rendezvous), waits, checks
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from datetime import timedelta

WORLD = 2


def _diloco(rank: int) -> None:
    import torch
    import torch.distributed as dist
    from flatcomm.diloco import DiLoCo

    torch.manual_seed(0)
    net = torch.nn.Linear(9, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outer = DiLoCo(net, opt, sync_every=2, codec="int8", verify_every=1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(8, 9, generator=g)).pow(2).mean().backward()
        opt.step()
    assert outer.syncs == 2, outer.syncs
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    rows = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(rows, flat)
    assert all(torch.equal(r, rows[0]) for r in rows), "DiLoCo replicas differ after a sync"


def _backend(rank: int) -> None:
    import torch
    import torch.distributed as dist
    import flatcomm.backend  # noqa: F401 - registers the "flatcomm" backend

    group = dist.new_group(backend="flatcomm")
    x = torch.full((1001,), float(rank + 1)) / 3
    dist.all_reduce(x, group=group)
    want = (torch.tensor(1.0) / 3 + torch.tensor(2.0) / 3)  # rank order: rank 0's value first
    assert torch.equal(x, want.expand(1001)), x[:4]


def _ddp(rank: int) -> None:
    import torch
    import torch.distributed as dist
    import flatcomm.ddp

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(9, 4))
    state = flatcomm.ddp.register(ddp, "int8")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(8, 9, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    rows = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(rows, flat)
    assert all(torch.equal(r, rows[0]) for r in rows), "DDP replicas differ after a step"
    assert state is not None


def rank_main(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    try:
        import numpy  # noqa: F401
        has_numpy = True
    except ImportError:
        has_numpy = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        for name, check in (("DiLoCo sync", _diloco), ("flatcomm backend all_reduce", _backend),
                            ("DDP step with flatcomm.ddp hook", _ddp)):
            check(rank)
            if rank == 0:
                print(f"  ok: {name}", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"  numpy importable: {has_numpy}", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), init]) for r in range(WORLD)]
        try:
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(codes):
        print(f"dist_smoke: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3:
        rank_main(int(sys.argv[1]), sys.argv[2])
    else:
        sys.exit(main())
