"""DiLoCo resumed after a crash under torchrun: the same final weights as a run that never stopped.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/diloco_restart.py \\
        --ckpt /tmp/ckpt --save-at 5,7,8 --crash-at 9 --out /tmp/weights

Every rank is a replica (Streaming DiLoCo: ``sync_every=8, fragments=2, fragment_sync_delay=1``,
int4 with error feedback, AdamW inside). At each ``--save-at`` step every rank writes its own
checkpoint (model, inner optimizer, ``DiLoCo.state_dict()``: a sync in flight is drained into it),
then rank 0 marks the step complete. ``--crash-at S`` kills rank 1 (SIGKILL) at step S of the
first attempt (``--crash-at 6,7,9``: attempt k dies at the k-th step listed; give torchrun as many
restarts); torchrun restarts both, they resume from the last complete checkpoint. At the end
``outer.finish()`` brings every replica to the same weights, which rank 0 saves to
``--out``/weights.pt. CPU, gloo.
"""
from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from flatcomm.diloco import DiLoCo


def init(timeout_s: float) -> None:
    """The default process group, keyed per torchrun attempt (a static store outlives attempts)."""
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"diloco_restart/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def step(model, opt, t: int, rank: int) -> None:
    g = torch.Generator().manual_seed(7919 * t + rank)  # each replica its own data
    x = torch.randn(16, 32, generator=g)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
    opt.step()  # DiLoCo's hook runs the outer syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", default="5,7,8", help="steps after which to checkpoint")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--crash-at", default="", help="rank 1 dies at this step of the first attempt "
                    "(a list: attempt k at the k-th step)")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    init(args.timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    outer = DiLoCo(model, opt, sync_every=8, codec="int4", fragments=2, fragment_sync_delay=1, verify_every=1)
    start = 0
    latest = os.path.join(args.ckpt, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            start = int(f.read())
        ckpt = torch.load(os.path.join(args.ckpt, f"step{start}.rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        outer.load_state_dict(ckpt["diloco"])
    if rank == 0:
        print(f"diloco: resumed at step {start}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crashes = [int(s) for s in args.crash_at.split(",") if s]
    crash_at = crashes[attempt] if attempt < len(crashes) else -1
    save_at = {int(s) for s in args.save_at.split(",") if s}
    for t in range(start, args.steps):
        if t == crash_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        step(model, opt, t, rank)
        if t + 1 in save_at:
            os.makedirs(args.ckpt, exist_ok=True)
            path = os.path.join(args.ckpt, f"step{t + 1}.rank{rank}.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": outer.state_dict()},
                       path + ".tmp")
            os.replace(path + ".tmp", path)
            dist.barrier()  # every rank's file is on disk
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(t + 1))
                os.replace(latest + ".tmp", latest)
    # The replicas' weights differ between syncs: finish() syncs what is left, so that every rank
    # holds the same model (the one to save and evaluate).
    outer.finish()
    if rank == 0:
        print(f"diloco: {outer.syncs} syncs since step {start}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"weights": [p.detach() for p in model.parameters()]}, os.path.join(args.out, "weights.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
