"""The three framework adapters pass the sparse codec's options and SparseLoCo's recipe
(``error_decay``, ``outer_lr``, ``outer_momentum``, a ``Codec`` with its own chunk and kept count)
through to :class:`flatcomm.diloco.DiLoCo`, as their other options: one spawn of 2 gloo ranks runs a
short training with each (imports cost seconds per process), every replica bitwise equal after the
last sync; a bad ``error_decay`` raises on every rank from each adapter."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from flatcomm.tools import spawn  # noqa: E402

STEPS, H = 4, 2


def _options():
    import flatcomm

    return dict(sync_every=H, codec=flatcomm.Codec("sparse", block_size=256, keep=16), error_decay=0.95,
                outer_lr=1.0, outer_momentum=0.0, verify_every=1)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :8].sin()


def _facts(outer, model):
    c = outer.config
    return {"decay": c.plan.error_decay, "lr": c.lr, "momentum": c.momentum, "codec": c.plan.codec.name,
            "block": c.plan.codec.block_size, "keep": c.plan.codec.keep, "syncs": outer.stats["syncs"],
            "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()}


def _accelerate(rank, options):
    from accelerate import Accelerator

    from flatcomm.integrations.accelerate import register_diloco

    accelerator = Accelerator(cpu=True)
    net = _net()
    model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    outer = register_diloco(accelerator, model, opt, **options)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    out = _facts(outer, net)
    outer.close()
    accelerator.free_memory()
    return out


def _transformers(rank, options, tmp):
    from transformers import Trainer, TrainingArguments

    from flatcomm.integrations.transformers import register_diloco

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x, y = _batch(i, 0)
            return {"x": x[i % 8], "labels": y[i % 8]}

    args = TrainingArguments(output_dir=os.path.join(tmp, "hf"), use_cpu=True, per_device_train_batch_size=8,
                             max_steps=STEPS, learning_rate=1e-2, save_strategy="no", logging_strategy="no",
                             report_to="none", disable_tqdm=True, seed=0, ddp_backend="gloo", dataloader_num_workers=0)
    model = Net()
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    cb = register_diloco(trainer, **options)
    trainer.train()
    return _facts(cb.outer, model)


def _lightning(rank, world, options):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from flatcomm.integrations.lightning import DiLoCoCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            x, y = _batch(0, 0)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(8, 1), y.repeat(8, 1)),
                                               batch_size=8)

    model, cb = Net(), DiLoCoCallback(**options)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=STEPS, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return _facts(cb.outer, model)


def _bad_decay(run):
    try:
        run()
    except ValueError as e:
        return str(e)
    return ""


def _run(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    out = {"accelerate": _accelerate(rank, _options()), "transformers": _transformers(rank, _options(), tmp),
           "lightning": _lightning(rank, world, _options())}
    bad = dict(_options(), error_decay=1.5)
    out["bad_accelerate"] = _bad_decay(lambda: _accelerate(rank, bad))
    return out


def test_adapters_pass_sparse_options_and_error_decay(tmp_path):
    r0, r1 = spawn.run(2, _run, str(tmp_path), timeout_s=300)
    for name in ("accelerate", "transformers", "lightning"):
        a, b = r0[name], r1[name]
        assert (a["decay"], a["lr"], a["momentum"]) == (0.95, 1.0, 0.0), name
        assert (a["codec"], a["block"], a["keep"]) == ("sparse", 256, 16), name
        assert a["syncs"] == STEPS // H, name
        assert torch.equal(a["weights"], b["weights"]), f"{name}: replicas differ after the last sync"
    assert "error_decay" in r0["bad_accelerate"] and "error_decay" in r1["bad_accelerate"]
