"""flatcomm.ddp State(start_step=N): the first N rounds are lossless fp32, then the codec starts with
zero residuals; the step count (and so the warm-up) survives a checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
from flatcomm.tools import spawn


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))


def _grads_mean64(net, x, y, world):
    """float64 mean over ranks of each parameter's local gradient (a plain copy of the model)."""
    ref = _net()
    ref.load_state_dict(net.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    out = []
    for p in ref.parameters():
        g = p.grad.detach().double().contiguous()
        dist.all_reduce(g)
        out.append(g / world)
    return out


def _w_warmup(rank, world, start, steps):
    net = _net()
    ddp = DDP(net, bucket_cap_mb=0.001)  # several buckets
    state = fddp.register(ddp, "sign", start_step=start)
    exact, sizes = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(7, 19, generator=g), torch.randn(7, 5, generator=g)
        want = _grads_mean64(net, x, y, world)
        ddp.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        state.wait()
        # fp32 of two ranks: (a + b) / 2 is the correctly rounded mean, so it equals float64 rounded
        exact.append(all(torch.equal(p.grad, w.float()) for p, w in zip(net.parameters(), want)))
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=-0.1)
    st = state.stats["steps"]
    codecs = [{b["codec"] for b in s["buckets"]} for s in st]
    sizes = [s["wire_bytes"] for s in st]
    res = [s["residual_norm"] for s in st]
    sd = state.state_dict()
    return {"exact": exact, "codecs": codecs, "wire": sizes, "residual": res, "sd_step": sd["step"]}


def test_start_step_sends_fp32_then_the_codec():
    start, steps = 3, 6
    out = spawn.run(2, _w_warmup, start, steps, timeout_s=120)
    for r in out:
        assert r["exact"][:start] == [True] * start, r["exact"]
        assert not any(r["exact"][start:]), "sign must not reproduce the exact mean"
        assert r["codecs"][:start] == [{"fp32"}] * start
        assert r["codecs"][start:] == [{"sign"}] * (steps - start)
        assert r["residual"][:start] == [0.0] * start and all(v > 0 for v in r["residual"][start:])
        assert max(r["wire"][start:]) * 8 < min(r["wire"][:start])
        assert r["sd_step"] == steps


def _w_resume(rank, world):
    net = _net()
    ddp = DDP(net)
    state = fddp.register(ddp, "int8", start_step=4)
    state.load_state_dict({"version": fddp.STATE_DICT_VERSION, "form": "total", "codec": "int8",
                           "block_size": 256, "mode": "ordered", "world_size": 2, "step": 2, "residual": {}})
    for step in range(4):
        x = torch.randn(5, 19)
        ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
    return [{b["codec"] for b in s["buckets"]} for s in state.stats["steps"]]


def test_start_step_counts_from_the_checkpointed_step():
    for codecs in spawn.run(2, _w_resume, timeout_s=120):
        assert codecs == [{"fp32"}, {"fp32"}, {"int8"}, {"int8"}]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_start_step_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="start_step"):
        fddp.State("sign", start_step=bad)


def test_sign_by_name_gets_small_blocks_and_a_warm_up_by_default():
    st = fddp.State("sign")
    want = fddp.CODEC_DEFAULTS["sign"]
    assert st.codec.block_size == want["block_size"] < 256 and st.start_step == want["start_step"] > 0
    st = fddp.State("sign", block_size=256, start_step=0)  # explicit values win
    assert st.codec.block_size == 256 and st.start_step == 0
    for name in ("int8", "int4", "fp32"):
        st = fddp.State(name)
        assert st.codec.block_size == 256 and st.start_step == 0
    from flatcomm.ops.codecs import Codec

    assert fddp.State(Codec("sign")).codec.block_size == 256  # a Codec carries its own parameters
