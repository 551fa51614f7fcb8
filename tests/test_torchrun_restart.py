"""examples/restart_train.py under torchrun: rank 1 is killed mid-run, torchrun restarts both ranks
(--max-restarts 1), they resume from the last checkpoint (model, optimizer, flatcomm state) and end
with the same weights, bit for bit, as a run that never stopped (fp32 and int8)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "restart_train.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp, name, codec, crash_at, static):
    out = os.path.join(tmp, name, "out")
    rdzv = (["--master-addr", "127.0.0.1", "--master-port", str(_free_port())] if static
            else ["--standalone"])
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           *rdzv, EXAMPLE, "--codec", codec, "--steps", "9", "--ckpt", os.path.join(tmp, name, "ckpt"),
           "--crash-at", str(crash_at), "--out", out, "--timeout", "30"]
    # The example imports the installed package; here the source tree stands in for it.
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return out, p.stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("restart"))
    out, _ = _torchrun(tmp, "straight", "fp32,int8", -1, static=False)
    yield tmp, out
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed next to this python")
@pytest.mark.parametrize("codec,static", [pytest.param("fp32", True, marks=pytest.mark.slow), ("int8", True)])
def test_killed_rank_resumes_to_the_same_weights(straight, codec, static):
    tmp, ref_dir = straight
    out, log = _torchrun(tmp, f"crash_{codec}", codec, 7, static)
    assert f"{codec}: resumed at step 6" in log, log  # the second attempt started from the checkpoint
    ref = torch.load(os.path.join(ref_dir, f"{codec}.pt"), weights_only=True)
    got = torch.load(os.path.join(out, f"{codec}.pt"), weights_only=True)
    for n in ref:
        assert torch.equal(ref[n].view(torch.int32), got[n].view(torch.int32)), f"{codec}: {n} differs"
