"""examples/diloco_restart.py under torchrun: rank 1 is killed after a sync (resume from step 5),
mid interval (from 7) and with a fragment's all-reduce in flight (from 8); torchrun restarts both
ranks and they end with the uninterrupted run's weights and fp32 masters, bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "diloco_restart.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(tmp, name, crash_at):
    out = os.path.join(tmp, name, "out")
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           "--standalone", EXAMPLE, "--ckpt", os.path.join(tmp, name, "ckpt"), "--crash-at", str(crash_at),
           "--out", out, "--timeout", "30"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return torch.load(os.path.join(out, "weights.pt"), weights_only=True), p.stdout


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed next to this python")
def test_killed_replica_resumes_bit_for_bit(tmp_path):
    ref, _ = _torchrun(str(tmp_path), "straight", -1)
    for crash_at, resumed_at in ((6, 5), (7, 7), (9, 8)):
        got, log = _torchrun(str(tmp_path), f"crash{crash_at}", crash_at)
        assert f"resumed at step {resumed_at}" in log, log
        for key in ("weights", "masters"):
            for a, b in zip(ref[key], got[key]):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"crash at {crash_at}: {key} differ"
