"""Whatever a flatcomm state's ``state_dict()`` returns, at any step, loads back and continues bit for bit.

Property-style over every kind of state (2 gloo ranks, one spawn): the DDP hook (int8; ``auto``
with pinned codecs; ``auto`` handing buckets to the backend), OnebitAdam, FSDP2
(:func:`flatcomm.fsdp.apply`), FSDP1 (:class:`flatcomm.fsdp.FSDP1State`, with a warm-up count),
HSDP (:func:`flatcomm.fsdp.hybrid.apply`, 2 replicas of 1 shard), and the objects the framework
adapters save (Lightning's callback state, Accelerate's checkpointing object; the Trainer's file
is the same gathered container). A run of ``K`` steps snapshots its state before every step and
after the last (through ``torch.save`` / ``torch.load(weights_only=True)``); for every snapshot a
fresh model gets the weights and optimizer state of that step, loads the snapshot, must save it
back unchanged, and trains on to step ``K``: its weights must be the uninterrupted run's bits.
"""
from __future__ import annotations

import copy
import io
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn
from _support.rank_states import same as same_state

K = 3  # snapshots at steps 0, 1, 2, 3


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(32, 48)
        self.l2 = torch.nn.Linear(48, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class Run:
    """One training run of one kind: a module, an optimizer, flatcomm's state and how to save/load it."""

    def __init__(self, module, opt, step: Callable[[int], None], save: Callable[[], Any], load: Callable[[Any], None]):
        self.module, self.opt, self.step, self.save, self.load = module, opt, step, save, load


def _mse_step(model, opt, wait=None):
    def step(s):
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def _fsdp_step(model, opt):
    from test_fsdp import _loss

    def step(s):
        opt.zero_grad()
        _loss(model, dist.get_rank(), s).backward()
        opt.step()
    return step


def _ddp(codec, adapter=None, **opts) -> Run:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    ddp = DDP(_Net(), bucket_cap_mb=0.002)
    state = fddp.register(ddp, codec, **opts)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    save, load = _adapted(state, adapter)
    return Run(ddp.module, opt, _mse_step(ddp, opt), save, load)


def _adapted(state, adapter):
    """(save, load) of ``state`` itself, or of the object a framework adapter checkpoints."""
    if adapter == "lightning":
        from flatcomm.integrations.lightning import FlatcommCallback

        cb = FlatcommCallback()
        cb.state = state
        return cb.state_dict, cb.load_state_dict
    if adapter == "accelerate":
        from flatcomm.integrations.accelerate import RankStates

        obj = RankStates(state)

        def save():  # save_state gathers to the main process, which writes the file every rank loads
            box = [obj.state_dict()]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return save, obj.load_state_dict
    return state.state_dict, state.load_state_dict


def _auto_backend() -> Run:
    from flatcomm.autotune import CostModel, Tuner

    costs = CostModel(link_Bps=1e9, latency_s=5e-5, compute_Bps={"fp32": 2e9, "int8": 2e9}, backend_Bps=1e11,
                      backend_latency_s=1e-5)
    return _ddp("auto", tuner=Tuner("int8", costs=costs))


def _onebit() -> Run:
    from flatcomm.optim import OnebitAdam

    model = _Net()
    opt = OnebitAdam(model.parameters(), lr=1e-3, warmup_steps=1, codec="int8")
    return Run(model, None, _mse_step(model, opt), opt.state_dict, opt.load_state_dict)


def _fsdp2(adapter=None) -> Run:
    from test_fsdp import _Tiny, _wrap

    import flatcomm.fsdp

    torch.manual_seed(0)
    model = _wrap(_Tiny())
    rs = flatcomm.fsdp.apply(model, "int8")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    save, load = _adapted(rs, adapter)
    return Run(model, opt, _fsdp_step(model, opt), save, load)


def _fsdp1() -> Run:
    from test_state_compat import _fsdp1 as make

    model, state = make("FULL_SHARD", "int4", start_step=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    return Run(model, opt, _fsdp_step(model, opt), state.state_dict, state.load_state_dict)


def _hsdp() -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from test_fsdp import _Tiny

    from flatcomm.fsdp import hybrid

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = _Tiny()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = hybrid.apply(model, mesh, "int8")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    return Run(model, opt, _fsdp_step(model, opt), state.state_dict, state.load_state_dict)


def _auto_pinned() -> Run:
    from flatcomm.autotune import Tuner

    return _ddp("auto", tuner=Tuner("sign", pinned={"bucket0": "int8", "bucket1": "fp32", "bucket2": "sign",
                                                    "-": "int4"}))


KINDS: Dict[str, Callable[[], Run]] = {
    "ddp int8": lambda: _ddp("int8"),
    "ddp auto (pinned codecs)": _auto_pinned,
    "ddp auto (backend)": _auto_backend,
    "OnebitAdam": _onebit,
    "FSDP2": _fsdp2,
    "FSDP1": _fsdp1,
    "HSDP": _hsdp,
    "Lightning callback (DDP)": lambda: _ddp("int8", adapter="lightning"),
    "Accelerate object (DDP)": lambda: _ddp("int8", adapter="accelerate"),
    "Accelerate object (FSDP2)": lambda: _fsdp2(adapter="accelerate"),
}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _weights(run: Run) -> List[torch.Tensor]:
    return [_local(p).detach().clone() for p in run.module.parameters()]


def _bits(run: Run) -> torch.Tensor:
    return torch.cat([w.reshape(-1).float() for w in _weights(run)]).view(torch.int32)


def _opt_state(run: Run) -> Optional[dict]:
    return copy.deepcopy(run.opt.state_dict()) if run.opt is not None else None


def _kind(make: Callable[[], Run]) -> dict:
    run = make()
    snaps = []
    for s in range(K + 1):
        snaps.append((_weights(run), _opt_state(run), _roundtrip(run.save())))
        if s < K:
            run.step(s)
    final = _bits(run)
    same, saved_back = [], []
    for s, (weights, opt_state, sd) in enumerate(snaps):
        fresh = make()
        with torch.no_grad():
            for p, w in zip(fresh.module.parameters(), weights):
                _local(p).copy_(w)
        if opt_state is not None:
            fresh.opt.load_state_dict(opt_state)
        fresh.load(sd)
        saved_back.append(same_state(_roundtrip(fresh.save()), sd))
        for t in range(s, K):
            fresh.step(t)
        same.append(torch.equal(_bits(fresh), final))
    return {"same": same, "saved_back": saved_back}


def _w(rank, world):
    out = {}
    for name, make in KINDS.items():
        try:
            out[name] = _kind(make)
        except Exception as e:  # noqa: BLE001 - reported per kind (a failed kind must not hide the others)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn.run(2, _w, timeout_s=300)


# Known limit: the DDP hook with a lossy codec, saved after exactly one step. DDP rebuilds its
# buckets after its first iteration, so the uninterrupted run's step 1 already uses the rebuilt
# buckets, while a resumed process runs its step 1 as its own first iteration, in the initial
# layout (which the replay cannot turn into buckets DDP has not built yet): the codec's blocks
# differ for that one step. The residuals are all kept (it loads and saves back unchanged), the
# bits are not the same. The backend over two ranks and the FSDP states do not depend on it.
FIRST_ITERATION_LAYOUT = {"ddp int8", "ddp auto (pinned codecs)", "Lightning callback (DDP)",
                          "Accelerate object (DDP)"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_state_dict_loads_back_and_continues_bit_for_bit(ranks, kind):
    for rank, r in enumerate(ranks):
        got = r[kind]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert all(got["saved_back"]), f"rank {rank}: loaded, saved again and got another dict at steps " \
                                       f"{[s for s, ok in enumerate(got['saved_back']) if not ok]}"
        differ = [s for s, ok in enumerate(got["same"]) if not ok]
        if kind in FIRST_ITERATION_LAYOUT:
            assert differ in ([], [1]), f"rank {rank}: resumed from the snapshot of steps {differ}: other bits"
        else:
            assert not differ, f"rank {rank}: resumed from the snapshot of steps {differ}: other bits"
