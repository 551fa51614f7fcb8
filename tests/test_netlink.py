"""The link harness (flatcomm.tools.netlink): namespaces come and go, ranks talk across the link, and
nothing is left behind when a rank fails or hangs. Needs root and `ip netns`; skipped otherwise."""
from __future__ import annotations

import subprocess
import time

import pytest

from flatcomm.tools import netlink
from flatcomm.tools.netlink import Link, LinkError, LinkUnavailable

OK, WHY = netlink.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")


def _netns() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# ---- rank functions (module level: the ranks import them) -------------------------------------------


def _allreduce(rank, world, n):
    import os

    import torch
    import torch.distributed as dist

    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    return x, os.environ["GLOO_SOCKET_IFNAME"]


def _raise_on_1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # rank 0 waits for a peer that never comes
    return rank


def _hang(rank, world):
    time.sleep(300)


def _node_traffic(rank, world, n):
    """Bytes that left this rank's node (fc0's kernel counter) during an all-reduce among the ranks
    of the node only, then during one among all ranks."""
    import os

    import torch
    import torch.distributed as dist

    g = int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    groups = [dist.new_group(list(range(k * g, (k + 1) * g))) for k in range(world // g)]
    x = torch.full((n,), float(rank))

    def sent(fn):
        dist.barrier()
        tx0, _ = netlink.interface_bytes()
        fn()
        dist.barrier()
        return netlink.interface_bytes()[0] - tx0

    inside = sent(lambda: dist.all_reduce(x, group=groups[node]))
    across = sent(lambda: dist.all_reduce(x))
    return {"local_rank": int(os.environ["LOCAL_RANK"]), "node": node, "inside": inside,
            "across": across, "sum": float(x[0])}


# ---- parsing (no namespaces needed) -----------------------------------------------------------------


def test_parse():
    assert netlink.parse_rate("1gbit") == 1e9
    assert netlink.parse_rate("100mbit") == 1e8
    assert netlink.parse_rate("10Gbit") == 1e10
    assert netlink.parse_delay("0.2ms") == pytest.approx(2e-4)
    assert netlink.parse_delay("200us") == pytest.approx(2e-4)
    assert netlink.parse_link("1gbit,0.2ms") == (1e9, pytest.approx(2e-4))
    assert netlink.parse_link("10gbit") == (1e10, None)
    for bad in ("1gbps", "fast", "", "1gbit,0.2ms,3"):
        with pytest.raises(ValueError):
            netlink.parse_link(bad)


# ---- the link ---------------------------------------------------------------------------------------


@needs_netns
def test_setup_and_teardown():
    before = _netns()
    with Link(ranks=3, rate="100mbit") as link:  # 3 ranks: the bridge topology
        names = set(link.namespaces) | {link.bridge_ns}
        assert names <= _netns()
        show = subprocess.run(["tc", "-n", link.namespaces[0], "qdisc", "show", "dev", "fc0"],
                              capture_output=True, text=True).stdout
        assert "tbf" in show and "100Mbit" in show
    assert not names & _netns()
    assert not {n for n in _netns() - before if n.startswith(link.tag)}  # nothing else of ours


@needs_netns
def test_allreduce_across_link():
    import torch

    with Link(2, "1gbit") as link:
        names = set(link.namespaces)
        res = link.run(2, _allreduce, 1000, timeout_s=60, echo=False)
    expected = torch.arange(1000, dtype=torch.float32) * 3
    for x, ifname in res:
        assert torch.equal(x, expected)
        assert ifname == "fc0"
    assert not names & _netns()


@needs_netns
def test_nodes_hold_ranks_and_count_what_leaves_them():
    n = 1 << 18  # 1 MB of fp32
    with Link(2, "1gbit", ranks_per_node=2) as link:
        assert link.world == 4 and link.info()["ranks_per_node"] == 2
        tx0 = link.tx_bytes(0)
        res = link.run(4, _node_traffic, n, timeout_s=90, echo=False)
        assert link.tx_bytes(0) - tx0 >= res[0]["across"]  # the parent reads the same counter
    assert [(r["node"], r["local_rank"]) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # inside a node: 0+1 on node 0, 2+3 on node 1; then across all four ranks: 1+1+5+5
    assert all(r["sum"] == 12.0 for r in res), res
    for r in res:
        assert r["inside"] < 64 << 10, r  # barriers only: the node's own traffic stays on its loopback
        # two nodes: each must send at least S (half reduced, half gathered); gloo's ring sends
        # 2 (W-1)/W S = 1.5 S, its algorithm may vary with the size (plus headers and ACKs)
        assert 1.0 * 4 * n < r["across"] < 2.2 * 4 * n, r
    with pytest.raises(ValueError, match="ranks_per_node"):
        Link(2, "1gbit", ranks_per_node=0)


@needs_netns
def test_cleanup_when_rank_raises():
    t0 = time.monotonic()
    with pytest.raises(LinkError, match="rank one says no"):
        with Link(2, "1gbit") as link:
            names = set(link.namespaces)
            link.run(2, _raise_on_1, timeout_s=60, grace_s=3, echo=False)
    assert time.monotonic() - t0 < 45  # the surviving rank was stopped, not waited for
    assert not names & _netns()


@needs_netns
def test_timeout_kills_ranks_and_cleans_up():
    with pytest.raises(LinkError, match="timed out"):
        with Link(2, "1gbit") as link:
            names = set(link.namespaces)
            link.run(2, _hang, timeout_s=8, echo=False)
    assert not names & _netns()


@needs_netns
def test_delay_needs_netem_or_says_why():
    link = Link(2, "1gbit,0.2ms")
    try:
        with link:
            assert link.delay_applied
    except LinkUnavailable as e:  # this kernel has no sch_netem: refused with the reason
        assert "netem" in str(e)
    assert not {n for n in _netns() if n.startswith(link.tag)}
