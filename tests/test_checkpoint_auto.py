"""codec="auto" checkpoints: every decision auto can take (each codec of the precision order, and
the backend's own all-reduce) saves, loads back and continues bit for bit, flat and two-level.

One spawn of 4 gloo ranks: flat over the 4, then 2 nodes x 2 (``Topology(local_size=2)``). Codec
decisions are pinned (a measured choice would differ run to run); the backend is chosen by given
costs in which it is far faster than anything flatcomm predicts (given costs are never raced), and
the test checks that the saved decisions, and the buckets the hook sent, are the backend's.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.autotune import BACKEND, PRECISION, CostModel, Tuner
from flatcomm.ddp import checkpoint as ckpt
from flatcomm.tools import spawn

WORLD, STEPS, CUT = 4, 5, 3
CHOICES = list(PRECISION) + [BACKEND]
GB = 1e9
_COMPUTE = {"fp32": 8 * GB, "bf16": 4 * GB, "int8": 3 * GB, "int4": 3 * GB, "sign": 3 * GB}
# the backend far faster than flatcomm's collectives: flat, and per tier (2 nodes x 2)
BACKEND_FLAT = CostModel(link_Bps=1 * GB, latency_s=5e-5, compute_Bps=dict(_COMPUTE), backend_Bps=100 * GB,
                         backend_latency_s=1e-5)
BACKEND_TIERED = CostModel(link_Bps=0.005 * GB, latency_s=5e-5, compute_Bps=dict(_COMPUTE), backend_Bps=100 * GB,
                           backend_latency_s=1e-5, nodes=2, ranks_per_node=2, inter_latency_s=5e-5,
                           inter_Bps=0.01 * GB, intra_latency_s=5e-6, intra_Bps=50 * GB)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(32, 64)
        self.l2 = torch.nn.Linear(64, 64)
        self.l3 = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def _tuner(choice: str, tiered: bool) -> Tuner:
    if choice == BACKEND:
        return Tuner("int8", costs=BACKEND_TIERED if tiered else BACKEND_FLAT)
    return Tuner("sign", pinned={"-": choice})  # every bucket, whatever its size


def _make(choice: str, topology):
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.01)  # several buckets after DDP's rebuild
    state = fddp.register(ddp, "auto", topology=topology, tuner=_tuner(choice, topology != "flat"))
    return ddp, state, torch.optim.Adam(ddp.parameters(), lr=1e-3)


def _steps(rank, ddp, opt, a, b):
    for step in range(a, b):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _bits(ddp) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).view(torch.int32).clone()


def _one(rank, choice, topology) -> dict:
    ddp, state, opt = _make(choice, topology)
    _steps(rank, ddp, opt, 0, CUT)
    saved = _roundtrip({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "flatcomm": state.state_dict()})
    _steps(rank, ddp, opt, CUT, STEPS)  # the uninterrupted run (state_dict() changes nothing)
    straight = _bits(ddp)
    sent = {b["codec"] for s in state.stats["steps"] for b in s["buckets"]}
    ddp, state, opt = _make(choice, topology)  # a fresh process would build exactly this
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["flatcomm"])
    loaded = [(d.codec, d.chunks) for d in state.decisions.values()]
    _steps(rank, ddp, opt, CUT, STEPS)
    refused = None
    if choice == BACKEND:  # a State that asked for determinism cannot take the backend's decision
        strict = fddp.State("auto", mode="ordered", model=ddp, tuner=_tuner(choice, topology != "flat"))
        try:
            strict.load_state_dict(saved["flatcomm"])
        except ValueError as e:
            refused = str(e)
        strict.load_state_dict(saved["flatcomm"], allow_codec_change=True)  # decided again
        refused = (refused, len(strict.decisions))
    return {"refused": refused, "same": torch.equal(straight, _bits(ddp)), "tiered": saved["flatcomm"]["tiered"],
            "saved": [(e[1], e[2]) for e in saved["flatcomm"]["decisions"]], "loaded": loaded, "sent": sent,
            "held": any(bool(t.any()) for t in saved["flatcomm"]["client"].values())}


def _w(rank, world):
    from flatcomm import Topology

    out = {}
    for label, topology in (("flat", "flat"), ("two-level", Topology(local_size=2))):
        for choice in CHOICES:
            out[label, choice] = _one(rank, choice, topology)
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn.run(WORLD, _w, timeout_s=300)


@pytest.mark.parametrize("label", ["flat", "two-level"])
@pytest.mark.parametrize("choice", CHOICES)
def test_every_auto_decision_resumes_bit_for_bit(ranks, label, choice):
    for r in ranks:
        got = r[label, choice]
        assert got["tiered"] == (label == "two-level")
        # the decision under test is what was saved, loaded and sent (the backend's: not flatcomm's)
        assert got["saved"] and {c for c, _ in got["saved"]} == {choice}, got["saved"]
        assert got["loaded"] == got["saved"]
        assert got["sent"] == {choice}, got["sent"]
        if choice not in ("fp32", BACKEND):
            assert got["held"], "no residual was saved: the resume would prove nothing"
        if choice == BACKEND:
            assert "determinism" in (got["refused"][0] or "") and got["refused"][1] == 0, got["refused"]
        assert got["same"], f"{label} {choice}: the resumed run differs from the uninterrupted one"


def test_decision_entries_round_trip_and_are_checked():
    params = dict(Net().named_parameters())
    d = ckpt._decisions(params, [[["l1.weight"], BACKEND, 1], [["l2.weight", "l2.bias"], "int8", 3, ["int8", BACKEND]]])
    (k0, b), (k1, i8) = d.items()
    assert k0 == (id(params["l1.weight"]),) and b.codec == BACKEND and b.path == BACKEND and not b.raced
    assert i8.codec == "int8" and i8.chunks == 3 and i8.raced == ("int8", BACKEND)  # raced again on schedule
    assert ckpt._decision_entry(["l2.weight", "l2.bias"], i8) == [["l2.weight", "l2.bias"], "int8", 3, ["int8", BACKEND]]
    assert ckpt._decision_entry(["l1.weight"], b) == [["l1.weight"], BACKEND, 1]  # 3 fields as before
    for bad in ([["l1.weight"], "int9", 1], [["l1.weight"], BACKEND, 0], [["l1.weight"], "fp32", True],
                [["l1.weight"], "fp32", 1, ["fp32"]], [["l1.weight"], "fp32", 1, ["x", "fp32"]], [["l1.weight"], "fp32"]):
        with pytest.raises(ValueError, match="decisions"):
            ckpt._decisions(params, [bad])
