"""examples/diloco_restart.py under torchrun: rank 1 is killed after a sync (resume from step 5),
mid interval (from 7) and with a fragment's all-reduce in flight (from 8), one kill per attempt of
one run; torchrun restarts both ranks each time and they end (after outer.finish()) with the
uninterrupted run's weights, bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "diloco_restart.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(tmp, name, crashes):
    out = os.path.join(tmp, name, "out")
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(len(crashes)),
           "--monitor-interval", "0.2", "--standalone", EXAMPLE, "--ckpt", os.path.join(tmp, name, "ckpt"),
           "--crash-at", ",".join(map(str, crashes)),
           "--out", out, "--timeout", "30"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return torch.load(os.path.join(out, "weights.pt"), weights_only=True), p.stdout


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed next to this python")
@pytest.mark.slow
def test_killed_replica_resumes_bit_for_bit(tmp_path):
    ref, log = _torchrun(str(tmp_path), "straight", [])
    assert "resumed at step 0" in log, log
    # Killed at 6 -> resumes at 5 (after a sync), at 7 -> 7 (mid interval), at 9 -> 8 (in flight).
    got, log = _torchrun(str(tmp_path), "crashes", [6, 7, 9])
    resumed = [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "resumed at step" in line]
    assert resumed == [0, 5, 7, 8], log
    for key in ("weights",):  # after outer.finish(): the model every replica holds
        assert len(ref[key]) == len(got[key]) > 0
        for a, b in zip(ref[key], got[key]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{key} differ after the resumes"
