"""numpy is not a run-time dependency: DiLoCo (with verify_every), rank_states and the exact
accumulator's digest run in an interpreter where ``import numpy`` fails (as on a plain
``pip install torch flatcomm``); and the bytes that replaced ``.numpy().tobytes()`` are the same."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from flatcomm._bytes import tensor_bytes

_NO_NUMPY_RUN = textwrap.dedent("""
    import sys, tempfile, os
    sys.modules["numpy"] = None  # `import numpy` raises ImportError, torch's .numpy() raises
    import torch, torch.distributed as dist
    try:
        torch.zeros(1).numpy()
        raise SystemExit("numpy is still reachable")
    except RuntimeError:
        pass
    from flatcomm.diloco import DiLoCo
    from flatcomm.rank_states import gathered_state_dict
    from flatcomm.reproducible import ExactGradAccumulator
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rdv"), rank=0, world_size=1)
        torch.manual_seed(0)
        net = torch.nn.Linear(7, 3)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, opt, sync_every=2, codec="int8", verify_every=1)
        for _ in range(4):
            opt.zero_grad(); net(torch.randn(5, 7)).pow(2).mean().backward(); opt.step()
        assert outer.syncs == 2, outer.syncs
        g = gathered_state_dict(outer)
        assert g["ranks"][0]["diloco"]["syncs"] == 2
        acc = ExactGradAccumulator(net, 1)
        for _ in acc.micro_batches():
            net(torch.randn(5, 7)).pow(2).mean().backward()
        assert len(acc.stats.digest) == 64
        dist.destroy_process_group()
    print("ok")
""")


def test_diloco_rank_states_and_digest_run_without_numpy():
    r = subprocess.run([sys.executable, "-c", _NO_NUMPY_RUN], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8,
                                   torch.bool, torch.float16])
def test_tensor_bytes_equal_numpy_tobytes(dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    base = (torch.randn(37, 11, generator=g) * 1e30)
    base[0, 0], base[1, 1], base[2, 2] = float("inf"), float("nan"), 0.0
    x = base.to(dtype)
    for t in (x, x.t(), x[3:20:2, 1:], x[:0], x.reshape(-1)[5], x[:, 4]):  # views, strides, empty, 0-d
        want = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else \
            t.reshape(1).view(torch.uint8).numpy().tobytes()
        assert tensor_bytes(t) == want
    assert tensor_bytes(torch.empty(0)) == b""
