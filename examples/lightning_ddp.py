"""PyTorch Lightning + flatcomm: DDP on CPU (gloo), int8 gradients, checkpoint and resume.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out /tmp/lt
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out /tmp/lt2 --resume /tmp/lt/step=4.ckpt

The second run continues from step 4 and ends with the same weights digest as the first.
"""
import argparse
import hashlib
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from flatcomm.integrations.lightning import FlatcommCallback


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # averaged over the ranks (every rank calls it)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-2)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        y = x[:, :4].sum(1, keepdim=True) * 0.5
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True, help="checkpoint folder (one file every 4 steps)")
    ap.add_argument("--resume", help="a checkpoint file to continue from")
    args = ap.parse_args()

    flatcomm_cb = FlatcommCallback(args.codec)  # registers on the DDP model Lightning builds
    saver = ModelCheckpoint(dirpath=args.out, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.steps,
                         callbacks=[flatcomm_cb, saver], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regression()
    trainer.fit(model, ckpt_path=args.resume)  # flatcomm's state resumes with the checkpoint

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    steps = flatcomm_cb.state.stats["steps"]  # per step: wire bytes, compression, error
    if trainer.is_global_zero:
        print(f"lightning {args.codec}: step {trainer.global_step}, loss {float(trainer.callback_metrics['loss']):.4f}, "
              f"{len(steps)} flatcomm steps, compression {steps[-1]['compression']:.2f}x, weights {digest}")
    dist.destroy_process_group()  # every rank, before exit: no group torn down by a dying peer


if __name__ == "__main__":
    main()
