"""flatcomm.integrations.lightning on 2 gloo ranks: Lightning's DDPStrategy on CPU.

One spawn runs every fit (importing Lightning and DDP costs seconds per process): plain Lightning,
flatcomm fp32 (the same bits), int8 (trains, the hook runs), int8 saved at step 4 and resumed to
step 8 (the same bits as the uninterrupted int8 fit), and the same resume with flatcomm's state
left out of the checkpoint (different bits: the saved residuals matter).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

from flatcomm.tools import spawn  # noqa: E402

STEPS, SAVE_AT = 12, 4  # 4 batches per rank per epoch


def _run(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from flatcomm.integrations.lightning import FlatcommCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(64, 8, generator=g)
            y = x[:, :4].sum(1, keepdim=True) * 0.5  # learnable in a few steps
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def fit(callbacks, steps, ckpt_path=None, save_dir=None):
        model = Net()
        if save_dir:  # the usual way to checkpoint: ModelCheckpoint, here at step SAVE_AT
            callbacks = callbacks + [ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=SAVE_AT,
                                                     save_top_k=-1)]
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                             max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=bool(save_dir),
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, ckpt_path=ckpt_path)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(), model.losses

    out = {}
    out["plain"], out["plain_losses"] = fit([], STEPS)
    out["fp32"], _ = fit([FlatcommCallback("fp32")], STEPS)
    cb = FlatcommCallback("int8")
    out["int8"], out["int8_losses"] = fit([cb], STEPS, save_dir=os.path.join(tmp, "a"))
    st = cb.state.stats
    out["hook_steps"] = len(st["steps"])
    out["wire"] = sum(s["wire_bytes"] for s in st["steps"])
    out["fp32_bytes"] = sum(s["fp32_bytes"] for s in st["steps"])
    path = os.path.join(tmp, "a", f"step={SAVE_AT}.ckpt")
    resumed_cb = FlatcommCallback("int8")
    out["resumed"], _ = fit([resumed_cb], STEPS, ckpt_path=path, save_dir=os.path.join(tmp, "b"))
    out["resumed_hook_steps"] = len(resumed_cb.state.stats["steps"])
    if rank == 0:  # the same checkpoint without flatcomm's state
        ckpt = torch.load(path, weights_only=True)
        out["saved_ranks"] = len(ckpt["callbacks"]["flatcomm"]["gathered"]["ranks"])
        del ckpt["callbacks"]["flatcomm"]
        torch.save(ckpt, os.path.join(tmp, "dropped.ckpt"))
    torch.distributed.barrier()
    out["dropped"], _ = fit([FlatcommCallback("int8")], STEPS, ckpt_path=os.path.join(tmp, "dropped.ckpt"),
                            save_dir=os.path.join(tmp, "c"))
    return out


def _run_resharded(rank, world, path):
    """One rank resumes the 2-rank checkpoint: flatcomm's state arrives resharded."""
    os.environ.update(LOCAL_RANK="0", RANK="0", NODE_RANK="0", WORLD_SIZE="1")
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    import flatcomm.ddp
    from flatcomm.integrations.lightning import FlatcommCallback

    class Probe(pl.Callback):  # runs after FlatcommCallback's on_fit_start (callbacks run in order)
        def on_fit_start(self, trainer, pl_module):
            self.loaded = flatcomm_cb.state.state_dict()

    flatcomm_cb, probe = FlatcommCallback("int8"), Probe()
    ckpt = torch.load(path, weights_only=True)
    total = flatcomm.ddp.reshard(ckpt["callbacks"]["flatcomm"]["gathered"]["ranks"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=STEPS, callbacks=[flatcomm_cb, probe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_net_for_reshard(), ckpt_path=path)
    return probe.loaded, total, trainer.global_step


def _net_for_reshard():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-2)

        def train_dataloader(self):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8)
    return Net()


def test_lightning_ddp(tmp_path):
    r0, r1 = spawn.run(2, _run, str(tmp_path), timeout_s=120)
    for r in (r0, r1):
        assert torch.equal(r["fp32"].view(torch.int32), r["plain"].view(torch.int32)), "fp32 != Lightning's DDP"
        assert not torch.equal(r["int8"], r["plain"]), "int8 gave fp32's bits: the hook did not run"
        assert r["hook_steps"] == STEPS and 0 < r["wire"] < r["fp32_bytes"] / 2
        assert r["resumed_hook_steps"] == STEPS - SAVE_AT
        assert torch.equal(r["resumed"].view(torch.int32), r["int8"].view(torch.int32)), "resume != uninterrupted"
        assert not torch.equal(r["dropped"], r["int8"]), "flatcomm's saved state made no difference"
    # the same 4 batches every epoch: the last epoch's loss against the first's, and against fp32's
    losses, plain = r0["int8_losses"], r0["plain_losses"]
    assert len(losses) == STEPS
    first, last = sum(losses[:4]), sum(losses[-4:])
    assert last < 0.5 * first and abs(last - sum(plain[-4:])) < 0.05 * last, (losses, plain)
    assert torch.equal(r0["int8"], r1["int8"])  # every rank holds the same weights
    assert r0["saved_ranks"] == 2
    # the 2-rank checkpoint on 1 rank: the residual total, resharded (one rank: client = T, server = 0)
    (loaded, total, step), = spawn.run(1, _run_resharded, str(tmp_path / "a" / f"step={SAVE_AT}.ckpt"), timeout_s=90)
    assert loaded["world_size"] == 1 and step == STEPS
    assert any(bool(t.any()) for t in total["residual"].values())
    for n, t in total["residual"].items():
        assert torch.equal(loaded["client"][n], t) and not loaded["server"][n].any(), n


def _run_fsdp2(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from flatcomm.integrations.lightning import FlatcommCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
            self.losses = []

        def configure_model(self):  # FSDP2 the Lightning way; the module training_step calls is the root
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(64, 8, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True) * 0.5),
                                               batch_size=8)

    def fit(callbacks, ckpt_path=None, save_dir=None):
        model = Net()
        if save_dir:
            callbacks = callbacks + [ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=SAVE_AT,
                                                     save_top_k=-1)]
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, callbacks=callbacks,
                             logger=False, enable_checkpointing=bool(save_dir), enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, ckpt_path=ckpt_path)
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]), model.losses

    out = {}
    out["plain"], out["plain_losses"] = fit([])
    out["fp32"], _ = fit([FlatcommCallback("fp32")])
    cb = FlatcommCallback("int8")
    out["int8"], out["int8_losses"] = fit([cb], save_dir=os.path.join(tmp, "a"))
    out["calls"], out["wire"] = cb.state.stats.calls, cb.state.stats.wire_bytes
    out["resumed"], _ = fit([FlatcommCallback("int8")], ckpt_path=os.path.join(tmp, "a", f"step={SAVE_AT}.ckpt"))
    return out


def test_lightning_model_parallel_fsdp2(tmp_path):
    r0, r1 = spawn.run(2, _run_fsdp2, str(tmp_path), timeout_s=120)
    n_params = r0["plain"].numel()
    for r in (r0, r1):
        assert torch.equal(r["fp32"].view(torch.int32), r["plain"].view(torch.int32)), "fp32 != FSDP2's reduce-scatter"
        assert not torch.equal(r["int8"], r["plain"]), "int8 gave fp32's bits: flatcomm did not run"
        # 2 parameter groups per step; a plain fp32 reduce-scatter sends half the padded gradient
        assert r["calls"] >= 2 * STEPS and 0 < r["wire"] < STEPS * 4 * n_params / 2 / 2
        assert torch.equal(r["resumed"].view(torch.int32), r["int8"].view(torch.int32)), "resume != uninterrupted"
    losses, plain = r0["int8_losses"], r0["plain_losses"]
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]) and abs(sum(losses[-4:]) - sum(plain[-4:])) < 0.05 * sum(plain[-4:])


def _run_diloco(rank, world, tmp):
    """Every rank a DiLoCo replica (H=4, 2 fragments, delay 1): saved at step 4, with fragment 0's
    sync in flight, and at step 5, just after it was applied; each resumed to step 12. One batch
    per epoch: Lightning resumes a plain DataLoader only at an epoch's end."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from flatcomm.integrations.lightning import DiLoCoCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

        def train_dataloader(self):
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True)),
                                               batch_size=32)

    def fit(ckpt_path=None, save_dir=None, every=None, missing_ok=False, held=None):
        model, cb = Net(), DiLoCoCallback(sync_every=4, fragments=2, fragment_sync_delay=1, codec="int4",
                                          verify_every=1, missing_ok=missing_ok)
        callbacks = [cb]
        if save_dir:
            callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=every,
                                             save_top_k=-1))
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                             max_steps=STEPS, callbacks=callbacks, logger=False, enable_checkpointing=bool(save_dir),
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, ckpt_path=ckpt_path)
        if held is not None:  # what this rank holds of a checkpoint's DiLoCo state (a collective)
            held.append(sorted(cb.state_dict()))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(), cb.outer.stats

    out = {"held": []}
    out["full"], st = fit(save_dir=os.path.join(tmp, "a"), every=1, held=out["held"])  # a checkpoint every step
    out["syncs"], out["wire"] = st["syncs"], st["wire_bytes"]
    out["in_flight"], _ = fit(ckpt_path=os.path.join(tmp, "a", "step=4.ckpt"))
    out["after_sync"], _ = fit(ckpt_path=os.path.join(tmp, "a", "step=5.ckpt"))
    # A checkpoint without the callback's entry: refused, unless missing_ok=True
    stripped = os.path.join(tmp, "stripped.ckpt")
    if rank == 0:
        ckpt = torch.load(os.path.join(tmp, "a", "step=5.ckpt"), weights_only=False)
        del ckpt["callbacks"]["flatcomm_diloco"]
        torch.save(ckpt, stripped)
    torch.distributed.barrier()
    try:
        fit(ckpt_path=stripped)
        out["missing"] = ""
    except ValueError as e:
        out["missing"] = str(e)
    out["missing_ok"], _ = fit(ckpt_path=stripped, missing_ok=True)
    if rank == 0:
        for name, path in (("saved_4", "a/step=4.ckpt"), ("saved_5", "a/step=5.ckpt")):
            ckpt = torch.load(os.path.join(tmp, path), weights_only=True)
            parts = ckpt["callbacks"]["flatcomm_diloco"]["gathered"]["ranks"]
            out[name] = [p["diloco"]["outer"]["in_flight"] is not None for p in parts]
    return out


def test_lightning_diloco_resumes_every_replica(tmp_path):
    r0, r1 = spawn.run(2, _run_diloco, str(tmp_path), timeout_s=120)
    # DDP's all-reduce is off: the replicas trained on their own batches since the last sync
    assert not torch.equal(r0["full"], r1["full"])
    assert r0["syncs"] == r1["syncs"] == 5  # fragment 0 at 4, 8 (12 is in flight), fragment 1 at 2, 6, 10
    assert 0 < r0["wire"] < r0["syncs"] * r0["full"].numel() * 4 / 4  # int4: well under fp32's bytes
    assert r0["saved_4"] == [True, True]  # the step-4 checkpoint holds fragment 0's sync in flight
    assert r0["saved_5"] == [False, False]
    for r in (r0, r1):
        for kill in ("in_flight", "after_sync"):
            assert torch.equal(r[kill].view(torch.int32), r["full"].view(torch.int32)), f"resume after {kill} differs"
        assert "missing_ok=True" in r["missing"] and "no DiLoCo state" in r["missing"], r["missing"]
        assert not torch.equal(r["missing_ok"], r["full"])  # started DiLoCo afresh: another run
    # the checkpoint's DiLoCo state is gathered to rank 0 (which writes it) only
    assert r0["held"] == [["gathered"]] and r1["held"] == [[]], (r0["held"], r1["held"])
