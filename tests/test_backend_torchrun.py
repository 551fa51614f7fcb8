"""`init_process_group("flatcomm")` under torchrun, the program otherwise plain torch: a DDP step
and a loss average run on flatcomm's sums (each rank's result is the rank-ordered fp32 sum, the
same bits on both ranks), and `FLATCOMM_BACKEND_CODEC=int8` compresses the group's float sums (the
result then differs from the exact sum, within int8's error)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.distributed as dist
    import flatcomm.backend  # registers "flatcomm"

    dist.init_process_group("flatcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10 for r in range(world)]
    x = xs[rank].clone()
    dist.all_reduce(x)
    ordered = xs[0].clone()
    for r in range(1, world):
        ordered += xs[r]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ws = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(ws, w)
    out = {"backend": str(dist.get_backend()), "equal_ordered": bool(torch.equal(x, ordered)),
           "err": float((x.double() - sum(t.double() for t in xs)).abs().max()),
           "scale": float(max(t.abs().max() for t in xs)),
           "same_weights": all(torch.equal(ws[0], t) for t in ws)}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
''')


def _run(tmp_path, **env_extra) -> dict:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           **env_extra}
    p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed next to this python")
def test_init_process_group_flatcomm_under_torchrun(tmp_path):
    plain = _run(tmp_path)
    assert plain["backend"] == "flatcomm" and plain["same_weights"], plain
    assert plain["equal_ordered"], plain  # the rank-ordered fp32 sum, bit for bit
    lossy = _run(tmp_path, FLATCOMM_BACKEND_CODEC="int8")
    assert lossy["same_weights"] and not lossy["equal_ordered"], lossy
    assert 0 < lossy["err"] <= 2 * 2 * lossy["scale"] / 127, lossy  # two int8 stages, per-block scales
