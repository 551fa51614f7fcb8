"""flatcomm.fsdp start_step=N (FSDP2 ReduceScatter/apply and FSDP1State): the first N reductions of
each parameter group are lossless fp32 with no residual, then the codec starts; the count is in
state_dict() and continues after a load."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn

from _support.fsdp import _loss, _Tiny, _wrap


def _residual_total(sd):
    return sum(float(v.abs().sum()) for k, v in sd.items() if not k.endswith("__step__"))


def _run(model, backend, steps, rank, step0=0):
    totals = []
    for s in range(step0, step0 + steps):
        model.zero_grad()
        _loss(model, rank, s).backward()
        totals.append(_residual_total(backend.state_dict()))
    return totals


def _w(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from flatcomm.fsdp import FSDP1State, apply, fsdp1_hook

    out = {}
    torch.manual_seed(0)
    model = _wrap(_Tiny())
    rs = apply(model, "sign", start_step=2)
    out["fsdp2"] = _run(model, rs, 4, rank)
    sd = rs.state_dict()
    out["fsdp2_step"] = int(sd[f"rank{rank}.__step__"])
    torch.manual_seed(0)
    model2 = _wrap(_Tiny())
    rs2 = apply(model2, "sign", start_step=5)
    rs2.load_state_dict(sd)  # 4 steps done: one more of warm-up, then sign
    out["fsdp2_resumed"] = _run(model2, rs2, 2, rank, step0=4)
    with pytest.raises(ValueError, match="__step__"):
        rs2.load_state_dict({**sd, f"rank{rank}.__step__": torch.tensor(-1)})
    torch.manual_seed(0)
    fsdp = FSDP(_Tiny(), device_id=torch.device("cpu"), use_orig_params=True)
    st = FSDP1State("int4", model=fsdp, start_step=3)
    fsdp.register_comm_hook(st, fsdp1_hook)
    out["fsdp1"] = _run(fsdp, st, 5, rank)
    out["fsdp1_step"] = int(st.state_dict()[f"rank{rank}.__step__"])
    return out


def test_fsdp_start_step_warm_up_then_codec_and_checkpointed_count():
    for r in spawn.run(2, _w, timeout_s=240):
        assert r["fsdp2"][:2] == [0.0, 0.0] and all(t > 0 for t in r["fsdp2"][2:]), r["fsdp2"]
        assert r["fsdp2_step"] == 4
        # step 4 is the last warm-up step of start_step=5: the loaded residual is flushed (sent) by fp32
        assert r["fsdp2_resumed"][0] == 0.0 and r["fsdp2_resumed"][1] > 0, r["fsdp2_resumed"]
        assert r["fsdp1"][:3] == [0.0] * 3 and all(t > 0 for t in r["fsdp1"][3:]), r["fsdp1"]
        assert r["fsdp1_step"] == 5


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_fsdp_start_step_rejects_bad_values(bad):
    from flatcomm.fsdp import FSDP1State, ReduceScatter

    for cls in (ReduceScatter, FSDP1State):
        with pytest.raises(ValueError, match="start_step"):
            cls("int8", start_step=bad)
