"""Cross-site DiLoCo over islands: each island is one torchrun job of W ranks (DDP or FSDP2 inside),
the islands sync every ``--sync-every`` inner steps through flatcomm.elastic on torchft's quorum.

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 --heartbeat_timeout_ms 1000 --join_timeout_ms 3000
    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint localhost:29600 examples/islands.py \
        --island 0 --islands 2 --lighthouse localhost:29510
    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint localhost:29601 examples/islands.py \
        --island 1 --islands 2 --lighthouse localhost:29510

(docs/elastic.md, "Islands": two islands on one machine, and N sites.) A rank that dies takes its
island down (torchrun stops the island's other workers) and torchrun's ``--max-restarts`` starts it
again: the new incarnation heals each rank's part from the same rank of a live island, receives the
data position with it, and resumes at the schedule's next batch. The islands' ranks meet inside the
island on a gloo group keyed by torchrun's restart count (a store that outlives a restart still
holds the last attempt's keys). Every rank prints one JSON line per sync round and one at the end
(held-out loss of the final model, the same on every island).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--island", type=int, required=True, help="this island's number, 0 .. islands-1")
    ap.add_argument("--islands", type=int, required=True, help="how many islands the job has")
    ap.add_argument("--lighthouse", required=True, help="HOST:PORT of torchft_lighthouse")
    ap.add_argument("--kind", default="ddp", choices=("ddp", "fsdp"), help="how the island trains its replica")
    ap.add_argument("--steps", type=int, default=400, help="inner steps of the run")
    ap.add_argument("--sync-every", type=int, default=20, help="inner steps between syncs (H)")
    ap.add_argument("--codec", default="int4", help="the pseudo-gradient's codec")
    ap.add_argument("--mode", default="ordered", choices=("ordered", "exact"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per inner step")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds: every collective and heal")
    ap.add_argument("--min-replicas", type=int, default=0,
                    help="islands a sync needs (default: a majority of --islands, 1 of 2; as the lighthouse's)")
    ap.add_argument("--hostname", default=None,
                    help="the address other islands reach this island's rank 0 at (sites on several hosts)")
    return ap.parse_args(argv)


def island_group(timeout: timedelta):
    """The island's gloo group, on torchrun's store under this attempt's prefix."""
    import torch.distributed as dist
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"islands/attempt{attempt}", base),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.group.WORLD


def model(kind: str, hidden: int, group):
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)  # every island starts from the same weights
    net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                              torch.nn.GELU(), torch.nn.Linear(hidden, 64))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def main(argv=None) -> None:
    a = parse(argv)
    import torch

    import flatcomm.elastic as elastic
    logging.getLogger("torchft").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=a.timeout)
    group = island_group(timeout)
    rank, size = group.rank(), group.size()
    net = model(a.kind, a.hidden, group)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    samples = torch.randn(1 << 16, 64, generator=g)
    target = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]  # learn a rotation
    stream = elastic.BatchStream(samples.shape[0], a.batch, a.islands, size, seed=2)
    lighthouse = a.lighthouse if "://" in a.lighthouse else f"http://{a.lighthouse}"
    majority = a.min_replicas or (1 if a.islands <= 2 else a.islands // 2 + 1)
    manager = elastic.make_manager(f"island{a.island}", lighthouse, timeout=timeout, min_replicas=majority,
                                   quorum_timeout=timedelta(seconds=300), hostname=a.hostname, island=group)
    outer = elastic.ElasticDiLoCo(net, opt, manager=manager, sync_every=a.sync_every, codec=a.codec, mode=a.mode,
                                  island=group, data=stream)
    seen = 0
    while outer.step < a.steps:
        x = samples[stream.next(a.island, rank)]
        opt.zero_grad()
        (net(x) - x @ target).pow(2).mean().backward()
        opt.step()  # every sync_every-th step: one sync round over the islands
        for r in list(outer.rounds)[seen:]:
            print(json.dumps({"island": a.island, "rank": rank, "pid": os.getpid(), "t": time.time(), "step": r.step,
                              "committed": r.committed, "quorum": r.quorum, "contributors": r.contributors,
                              "healed": r.healed, "heal_s": round(r.heal_s, 4), "heal_bytes": r.heal_bytes,
                              "error": r.error}), flush=True)
        seen = len(outer.rounds)
    with torch.no_grad():
        x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(12345))
        loss = float((net(x) - x @ target).pow(2).mean())  # every rank: FSDP2 gathers in forward
    print(json.dumps({"island": a.island, "rank": rank, "done": True, "stats": outer.stats, "heldout": loss}),
          flush=True)
    outer.shutdown()  # waits for the island: rank 0 serves its should_commit
    sys.stdout.flush()
    os._exit(0)  # torchft's threads: exit without waiting for them


if __name__ == "__main__":
    main()
