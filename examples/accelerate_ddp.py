"""Hugging Face Accelerate + flatcomm: DDP on CPU (gloo), int8 gradients, save_state / load_state.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --out /tmp/acc
    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --out /tmp/acc2 --resume /tmp/acc/step4

The second run continues from step 4 and ends with the same weights digest as the first.
"""
import argparse
import hashlib
import os

import torch
from accelerate import Accelerator

from flatcomm.integrations.accelerate import register


def batch(step, rank):  # this rank's batch of this step: the same on a resumed run
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x[:, :4].sum(1, keepdim=True) * 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True, help="checkpoint folder (step4, step8, ...)")
    ap.add_argument("--resume", help="a folder save_state wrote, to continue from")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    model, opt = accelerator.prepare(model, opt)       # a DistributedDataParallel
    state = register(accelerator, model, args.codec)   # flatcomm's DDP hook, saved by save_state
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)            # model, optimizer, RNG and flatcomm's state
        start = int(os.path.basename(args.resume.rstrip("/"))[len("step"):])
    for step in range(start, args.steps):
        x, y = batch(step, accelerator.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if (step + 1) % 4 == 0:
            accelerator.save_state(os.path.join(args.out, f"step{step + 1}"))

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    loss = accelerator.reduce(loss.detach(), reduction="mean")
    steps = state.stats["steps"]
    if accelerator.is_main_process:
        print(f"accelerate {args.codec}: step {args.steps}, loss {float(loss):.4f}, {len(steps)} flatcomm steps, "
              f"compression {steps[-1]['compression']:.2f}x, weights {digest}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
