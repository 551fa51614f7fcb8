"""Resume after a crash under torchrun: same final weights as a run that never stopped.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/restart_train.py \\
        --codec int8 --ckpt /tmp/ckpt --crash-at 7 --out /tmp/weights

Every ``--every`` steps each rank writes its own checkpoint file (model, optimizer and its own
flatcomm state: ``state.state_dict()`` does not communicate), then rank 0 marks the step complete.
``--crash-at S`` kills rank 1 (SIGKILL) at step S of the first attempt; torchrun stops rank 0 and
starts both again; they resume from the last complete checkpoint and continue bit for bit (the
per-rank flatcomm state holds both error-feedback residuals and the bucket layout). At the end
rank 0 saves the weights to ``--out``/<codec>.pt
(``--codec fp32,int8`` trains one model per codec, one after the other). Needs flatcomm installed (or on PYTHONPATH). CPU, gloo.

Restarts and the store: each attempt initialises the process group from torchrun's environment.
torchrun's c10d rendezvous (``--standalone`` or ``--rdzv-backend c10d``) gives every attempt a
fresh store; with a static rendezvous (``--master-addr/--master-port`` without ``--rdzv-backend``)
the store outlives the workers and keeps the old attempt's keys, so this script prefixes its keys
per attempt (``TORCHELASTIC_RESTART_COUNT``), which is harmless with either.
"""
from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp


def init(timeout_s: float) -> None:
    """The default process group, keyed per torchrun attempt (see the module docstring)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout) \
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
    if store is None:  # not under torchrun's agent store: let torch create its own from env://
        dist.init_process_group("gloo", timeout=timeout)
        return
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart_train/attempt{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 64, generator=g)
    return x, torch.tanh(x[:, :8] * 2.0) + 0.1 * torch.randn(32, 8, generator=g)


def save(dirname: str, step: int, rank: int, model, opt, state) -> None:
    """Each rank its own file, written atomically; rank 0 marks the step complete after a barrier."""
    d = os.path.join(dirname, f"step{step}")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"rank{rank}.pt")
    torch.save({"step": step, "model": model.module.state_dict(), "opt": opt.state_dict(),
                "flatcomm": state.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()  # every rank's file is on disk
    if rank == 0:
        with open(os.path.join(dirname, "latest.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(dirname, "latest.tmp"), os.path.join(dirname, "latest"))


def load(dirname: str, rank: int, model, opt, state) -> int:
    """The step to continue from (0 without a complete checkpoint)."""
    try:
        with open(os.path.join(dirname, "latest")) as f:
            step = int(f.read())
    except FileNotFoundError:
        return 0
    ckpt = torch.load(os.path.join(dirname, f"step{step}", f"rank{rank}.pt"), weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["flatcomm"])
    return ckpt["step"]


def train(args, codec: str, ckpt_dir: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)),
                bucket_cap_mb=0.05)
    state = flatcomm.ddp.register(model, codec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = load(ckpt_dir, rank, model, opt, state)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    loss = torch.zeros(())
    for step in range(start, args.steps):
        if step == args.crash_at and rank == 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if (step + 1) % args.every == 0:
            save(ckpt_dir, step + 1, rank, model, opt, state)
    if rank == 0:
        print(f"{codec}: resumed at step {start}, final loss {loss.item():.6f}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f"{codec}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codec", default="int8", help="a codec, or several: fp32,int8")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory")
    ap.add_argument("--crash-at", type=int, default=-1, help="rank 1 dies at this step, first attempt only")
    ap.add_argument("--out", help="rank 0 saves the final weights in this directory")
    ap.add_argument("--timeout", type=float, default=30.0, help="collective timeout, seconds")
    args = ap.parse_args()

    torch.set_num_threads(1)
    init(args.timeout)
    for codec in args.codec.split(","):
        train(args, codec, os.path.join(args.ckpt, codec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
