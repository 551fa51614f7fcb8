"""Errors relayed between ranks arrive whole and name the failed ranks once: the longest messages
the library raises (DiLoCo's DDP refusal, a checkpoint of another configuration), a 5000-byte
multi-byte message, identical messages from several ranks grouped (3 gloo ranks). The call header
of a successful call keeps its size."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flatcomm import collectives as C
from flatcomm.comm import header
from flatcomm.comm.rejected import in_step
from flatcomm.diloco import DiLoCo
from flatcomm.tools import spawn


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        cause = e.__cause__ if e.__cause__ is not None else e
        return str(e), str(cause)
    return "", ""


def _relay(rank, world):
    out = {}
    net = _net()
    ddp = DDP(net)  # every rank refuses with the same (long) message
    out["ddp"] = _raised(lambda: DiLoCo(ddp, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=2))
    del ddp
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=2)
    sd = outer.state_dict()
    if rank == 1:  # only rank 1 loads a checkpoint of another configuration
        sd = dict(sd, config="0" * 16)
    out["config"] = _raised(lambda: outer.load_state_dict(sd))
    long = f"rank {rank} says " + "ünïcödé " * 600  # two ranks, two different 5000-byte reasons

    def checks():
        if rank != 1:
            raise ValueError(long)

    def call():  # the checks of an all_reduce, then the all_reduce (whose header carries the failures)
        in_step(C.private_group(None), header.KIND_IDS["all_reduce"], False, checks)
        C.all_reduce(torch.ones(7), codec="fp32")

    out["long"] = _raised(call)
    out["long own"] = long
    out["after"] = _raised(lambda: C.all_reduce(torch.ones(7), codec="fp32"))  # still in step
    return out


def test_relayed_errors_are_whole_and_name_the_ranks_once():
    res = spawn.run(3, _relay, timeout_s=60)
    own = res[0]["ddp"][1]  # rank 0's own error: the text every rank relays
    assert len(own.encode()) > 4 * header.REASON_BYTES and own.endswith("pass allow_ddp=True"), own
    for rank, out in enumerate(res):
        msg = out["ddp"][0]
        assert msg.count("failed") == 1 and "rank 0, rank 1 and rank 2 failed: ValueError: " in msg, msg
        assert msg.endswith(own.removeprefix("flatcomm: ")), f"rank {rank}: cut: {msg[-300:]!r}"
        msg = out["config"][0]
        cfg = res[1]["config"][1]
        assert "other DiLoCo configuration" in cfg and msg.endswith(cfg.removeprefix("flatcomm: ")), (rank, msg)
        assert msg.count("failed") == 1 and "rank 1 failed" in msg and "rank 0" not in msg, msg
        msg = out["long"][0]
        for r in (0, 2):
            want = f"rank {r} failed: ValueError: {res[r]['long own']}"
            assert want in msg, f"rank {rank}: rank {r}'s reason cut or missing: {msg[:200]!r}..."
        assert "rank 1 failed" not in msg and "[...]" not in msg
        assert out["after"] == ("", ""), out["after"]


def test_header_row_size_does_not_depend_on_the_reason():
    names = header.FIELDS
    ok = header.row(3, header.OK, [("numel", 5)], names)
    cut = header.row(3, header.FAILED_VALUE, [], names, "x" * 10000)
    short = header.row(3, header.FAILED_VALUE, [], names, "short reason")
    assert ok.numel() == cut.numel() == short.numel() == header.length(len(names))
    table = torch.stack([short, cut])
    # without the store (no process group) the row's start stands in, marked as cut
    assert header.check(table, [(n, 0) for n in names]) == [
        "rank 0 failed: short reason", "rank 1 failed: " + "x" * (header.REASON_BYTES - 1) + " [...]"]
    whole = header.check(table, [(n, 0) for n in names], whole={1: "x" * 10000})
    assert whole[1] == "rank 1 failed: " + "x" * 10000
