"""A DDP ``codec="auto"`` run that handed its buckets to the backend's all-reduce resumes from a
checkpoint bit for bit under Lightning, Accelerate and the transformers Trainer (2 gloo ranks).

On loopback ``auto`` keeps the backend's all-reduce, but by racing it, which on a loaded box is not
the same every run; here the tuner gets costs in which the backend is far faster than flatcomm's
collectives (given costs are never raced), so the backend is chosen every time. The test checks
that what the checkpoint holds is that decision (every saved decision is ``"backend"``), that the
resumed run used the restored decisions (not new ones) and sent its buckets through the backend,
and that its weights are the uninterrupted run's, bit for bit.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from flatcomm.tools import spawn  # noqa: E402

STEPS, SAVE_AT = 8, 4  # 4 batches per rank per epoch (Lightning, Trainer)
GB = 1e9


def _tuner():
    from flatcomm.autotune import CostModel, Tuner

    costs = CostModel(link_Bps=1 * GB, latency_s=5e-5, compute_Bps={c: 2 * GB for c in ("fp32", "bf16", "int8")},
                      backend_Bps=100 * GB, backend_latency_s=1e-5)
    return Tuner("int8", costs=costs)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return x, x[:, :4].sum(1, keepdim=True) * 0.5


def _bits(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).view(torch.int32).clone()


def _used(state) -> dict:
    st = state.stats
    return {"sent": sorted({b["codec"] for s in st["steps"] for b in s["buckets"]}),
            "restored": all("restored from a checkpoint" in d["reason"] for d in st["decisions"])}


def _saved(gathered) -> list:
    return sorted({e[1] for part in gathered["ranks"] for e in part["decisions"]})


def _lightning(rank, world, tmp):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from flatcomm.integrations.lightning import FlatcommCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=8)

    def fit(save_dir, ckpt_path=None):
        model, cb = Net(), FlatcommCallback("auto", tuner=_tuner())
        saver = ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                             max_steps=STEPS, callbacks=[cb, saver], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, ckpt_path=ckpt_path)
        return _bits(model), cb.state

    straight, st = fit(os.path.join(tmp, "l_a"))
    path = os.path.join(tmp, "l_a", f"step={SAVE_AT}.ckpt")
    saved = _saved(torch.load(path, weights_only=True)["callbacks"]["flatcomm"]["gathered"])
    resumed, st2 = fit(os.path.join(tmp, "l_b"), ckpt_path=path)
    return {"same": torch.equal(straight, resumed), "saved": saved, "first": _used(st), "resumed": _used(st2)}


def _accelerate(rank, world, tmp):
    from accelerate import Accelerator

    from flatcomm.integrations.accelerate import register

    x_all, y_all = _data()

    def train(save_dir=None, load_dir=None):
        accelerator = Accelerator(cpu=True)
        net = _net()
        opt = torch.optim.Adam(net.parameters(), lr=3e-2)
        model, opt = accelerator.prepare(net, opt)
        state = register(accelerator, model, "auto", tuner=_tuner())
        start = 0
        if load_dir:
            accelerator.load_state(load_dir)
            start = SAVE_AT
        for step in range(start, STEPS):
            i = (8 * (2 * step + rank)) % 64
            loss = torch.nn.functional.mse_loss(model(x_all[i:i + 8]), y_all[i:i + 8])
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if save_dir and step + 1 == SAVE_AT:
                accelerator.save_state(save_dir)
        bits = _bits(net)
        accelerator.free_memory()
        return bits, state

    saved_dir = os.path.join(tmp, "a_ckpt")
    straight, st = train(save_dir=saved_dir)
    saved = _saved(torch.load(os.path.join(saved_dir, "custom_checkpoint_0.pkl"), weights_only=True))
    resumed, st2 = train(load_dir=saved_dir)
    return {"same": torch.equal(straight, resumed), "saved": saved, "first": _used(st), "resumed": _used(st2)}


def _transformers(rank, world, tmp):
    from transformers import Trainer, TrainingArguments

    from flatcomm.integrations.transformers import FILE, register

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        x, y = _data()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    def train(name, resume=None):
        args = TrainingArguments(output_dir=os.path.join(tmp, name), use_cpu=True, per_device_train_batch_size=8,
                                 max_steps=STEPS, learning_rate=3e-2, lr_scheduler_type="constant",
                                 weight_decay=0.0, save_strategy="steps", save_steps=SAVE_AT,
                                 logging_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                                 ddp_backend="gloo", dataloader_num_workers=0)
        model = Net()
        trainer = Trainer(model=model, args=args, train_dataset=Data())
        cb = register(trainer, "auto", tuner=_tuner())
        trainer.train(resume_from_checkpoint=resume)
        return _bits(model), cb.state

    straight, st = train("t_a")
    ck = os.path.join(tmp, "t_a", f"checkpoint-{SAVE_AT}")
    saved = _saved(torch.load(os.path.join(ck, FILE), weights_only=True))
    if rank == 0:
        shutil.copytree(ck, os.path.join(tmp, "t_b", f"checkpoint-{SAVE_AT}"))
    torch.distributed.barrier()
    resumed, st2 = train("t_b", resume=True)
    return {"same": torch.equal(straight, resumed), "saved": saved, "first": _used(st), "resumed": _used(st2)}


def _run(rank, world, tmp, framework):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    run = {"lightning": _lightning, "accelerate": _accelerate, "transformers": _transformers}[framework]
    return run(rank, world, tmp)


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_auto_backend_run_resumes_bit_for_bit(tmp_path, framework):
    # one spawn per framework: each sets process-wide state (environment, loggers) of its own
    for r in spawn.run(2, _run, str(tmp_path), framework, timeout_s=180):
        assert r["saved"] == ["backend"], r  # the checkpoint holds the backend's decision
        assert r["first"] == {"sent": ["backend"], "restored": False}, r
        assert r["resumed"] == {"sent": ["backend"], "restored": True}, r  # used as loaded
        assert r["same"], f"{framework}: the resumed auto run differs from the uninterrupted one"
