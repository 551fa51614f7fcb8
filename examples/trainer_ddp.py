"""The Hugging Face Trainer + flatcomm: DDP on CPU (gloo), int8 gradients, checkpoint and resume.

    torchrun --standalone --nproc-per-node 2 examples/trainer_ddp.py --out /tmp/hf
    torchrun --standalone --nproc-per-node 2 examples/trainer_ddp.py --out /tmp/hf2 --resume /tmp/hf/checkpoint-4

The second run continues from step 4 and ends with the same weights digest as the first.
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from flatcomm.integrations.transformers import register


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, x, labels):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        self.y = self.x[:, :4].sum(1, keepdim=True) * 0.5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True, help="output_dir: checkpoint-4, checkpoint-8, ...")
    ap.add_argument("--resume", help="a checkpoint folder to continue from (or 'last')")
    args = ap.parse_args()

    targs = TrainingArguments(output_dir=args.out, use_cpu=True, ddp_backend="gloo", max_steps=args.steps,
                              per_device_train_batch_size=8, learning_rate=3e-2, lr_scheduler_type="constant",
                              save_strategy="steps", save_steps=4, logging_steps=args.steps, report_to="none",
                              disable_tqdm=True, seed=0)
    model = Regression()
    trainer = Trainer(model=model, args=targs, train_dataset=Data())
    callback = register(trainer, args.codec)  # flatcomm on trainer.model_wrapped, saved in each checkpoint
    trainer.train(resume_from_checkpoint=True if args.resume == "last" else args.resume)

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    steps = callback.state.stats["steps"]
    if trainer.is_world_process_zero():
        print(f"trainer {args.codec}: step {trainer.state.global_step}, {len(steps)} flatcomm steps, "
              f"compression {steps[-1]['compression']:.2f}x, weights {digest}")
    dist.destroy_process_group()  # every rank, before exit: no group torn down by a dying peer


if __name__ == "__main__":
    main()
