"""flatcomm.diloco across 4 gloo ranks: mode="exact" gives the same weights when the replicas' rank
numbers are permuted (each keeping its data) for every codec, and for fp32 with a 2x2 Topology
as flat; ordered int4 with a Topology keeps replicas equal; a DDP replica and an FSDP2 replica
(2 replicas x 2 ranks) sync each local shard with the same rank of the other replica and match
a plain replica that trains on both ranks' batches."""
from __future__ import annotations

import torch

import flatcomm
from flatcomm import CODECS
from flatcomm.diloco import DiLoCo
from flatcomm.tools import spawn

H, STEPS = 4, 8


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))


def _batch(replica, t, part=None):
    g = torch.Generator().manual_seed(1000 * replica + t)
    x = torch.randn(8, 13, generator=g)
    return x if part is None else x[4 * part: 4 * part + 4]


def _run(replica, codec, mode="exact", topology=None, **kw):
    """The masters after STEPS inner steps of a replica training on ``replica``'s data."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=H, codec=codec, mode=mode, topology=topology, verify_every=1, **kw)
    for t in range(STEPS):
        opt.zero_grad()
        net(_batch(replica, t)).pow(2).mean().backward()
        opt.step()
    return torch.cat([f.master for f in outer.fragments])


def _exact(rank, world):
    perm = [2, 0, 3, 1]  # rank r plays replica perm[r]: same replicas, other rank numbers
    out = {}
    for codec in CODECS:
        # every codec through the fragmented schedule with a delay (the same exact sync as one
        # fragment, plus the schedule); the plain schedule for the default codec and fp32 (lean:
        # each DiLoCo run here is ~16 collectives on 4 ranks)
        b, b2 = _run(perm[rank], codec, fragments=2, fragment_sync_delay=1), \
            _run(rank, codec, fragments=2, fragment_sync_delay=1)
        out[codec] = (torch.equal(b, b2), not torch.equal(b, _net_flat()))
        if codec in ("fp32", "int4"):
            out[codec + " one fragment"] = torch.equal(_run(rank, codec), _run(perm[rank], codec))
    topo = flatcomm.Topology(local_size=2)
    flat = _run(rank, "fp32")
    out["fp32 2x2 vs flat"] = torch.equal(flat, _run(rank, "fp32", topology=topo))
    out["fp32 2x2 permuted"] = torch.equal(flat, _run(perm[rank], "fp32", topology=topo))
    ordered = _run(rank, "int4", mode="ordered", topology=topo)  # verify_every=1 checked every sync
    out["int4 2x2 ordered moved"] = not torch.equal(ordered, _net_flat())
    return out


def _net_flat():
    return torch.cat([p.detach().reshape(-1) for p in _net().parameters()])


def test_exact_mode_is_independent_of_rank_order_and_topology():
    res = spawn.run(4, _exact, timeout_s=120)
    for rank, per in enumerate(res):
        bad = [k for k, v in per.items() if not (all(v) if isinstance(v, tuple) else v)]
        assert not bad, f"rank {rank}: {bad}: {per}"


# ---- DDP and FSDP2 replicas ----------------------------------------------------------------------


def _sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    outer_group, inner_group = mesh["replicate"].get_group(), mesh["shard"].get_group()
    replica, part = rank // 2, rank % 2
    results = {}
    for kind in ("ddp", "fsdp2", "plain"):
        net = _net()
        if kind == "ddp":
            model = DDP(net, process_group=inner_group)
        elif kind == "fsdp2":
            model = fully_shard(net, mesh=mesh["shard"])
        else:
            model = net
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # fragments=2 cuts each rank's own values in halves: an FSDP2 shard's halves hold other
        # values than a whole replica's, and sync at other steps. By modules, every layout agrees.
        outer = DiLoCo(model, opt, sync_every=H, codec="fp32", fragments=[net[0], net[2]], fragment_sync_delay=1,
                       group=outer_group, verify_every=1)
        for t in range(STEPS):
            opt.zero_grad()
            # DDP / FSDP2: each rank half the replica's batch; plain: the whole batch on every rank
            x = _batch(replica, t) if kind == "plain" else _batch(replica, t, part)
            model(x).pow(2).mean().backward()
            opt.step()
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        results[kind] = (torch.cat([p.detach().reshape(-1) for p in full]), outer.syncs,
                         sum(f.numel for f in outer.fragments))
        outer.close()
        if kind == "fsdp2":  # fragments=k on a shard: k equal runs of this rank's values
            fresh = fully_shard(_net(), mesh=mesh["shard"])
            halves = DiLoCo(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), sync_every=H, codec="fp32",
                            fragments=2, group=outer_group)
            results["fsdp2_halves"] = [f.numel for f in halves.fragments]
            halves.close()
    return results


def test_ddp_and_fsdp2_replicas_match_a_plain_replica():
    res = spawn.run(4, _sharded, timeout_s=120)
    n = res[0]["plain"][2]
    for rank, per in enumerate(res):
        ref, syncs, _ = per["plain"]
        assert syncs == 3
        for kind in ("ddp", "fsdp2"):
            w, s, numel = per[kind]
            assert s == syncs
            assert (w - ref).abs().max() < 1e-5, f"rank {rank} {kind}: differs from a plain replica"
        assert per["fsdp2"][2] < n, "FSDP2: the outer sync did not run on the local shards"
        a, b = per["fsdp2_halves"]
        assert a + b == per["fsdp2"][2] and abs(a - b) <= 1, per["fsdp2_halves"]
        assert torch.equal(per["ddp"][0], res[rank - rank % 2]["ddp"][0]), "DDP: a replica's ranks differ"
