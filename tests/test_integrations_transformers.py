"""flatcomm.integrations.transformers on 2 gloo ranks: the Hugging Face Trainer on CPU (DDP).

One spawn runs every training: the plain Trainer, flatcomm fp32 (the same bits), int8 (trains, the
hook runs; checkpoints at steps 4, 8, 10), ``resume_from_checkpoint=True`` from a folder whose last
checkpoint is checkpoint-4, to step 10 (the same bits as the uninterrupted run), and a resume from
a checkpoint whose flatcomm file was removed (raises; with ``missing_ok=True`` it trains, differently).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from flatcomm.tools import spawn  # noqa: E402

STEPS, SAVE_EVERY = 10, 4


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
        self.losses = []

    def forward(self, x, labels=None):
        out = self.net(x)
        loss = torch.nn.functional.mse_loss(out, labels)
        self.losses.append(float(loss.detach()))
        return {"loss": loss, "logits": out}


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 8, generator=g)
        self.y = self.x[:, :4].sum(1, keepdim=True) * 0.5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _run(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    from transformers import Trainer, TrainingArguments

    from flatcomm.integrations.transformers import FILE, register

    def train(name, codec=None, resume=None, missing_ok=False):
        args = TrainingArguments(output_dir=os.path.join(tmp, name), use_cpu=True, per_device_train_batch_size=8,
                                 max_steps=STEPS, learning_rate=3e-2, lr_scheduler_type="constant",
                                 weight_decay=0.0, save_strategy="steps", save_steps=SAVE_EVERY,
                                 logging_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                                 ddp_backend="gloo", dataloader_num_workers=0)
        model = _Net()
        trainer = Trainer(model=model, args=args, train_dataset=_Data())
        cb = register(trainer, codec, missing_ok=missing_ok) if codec else None
        trainer.train(resume_from_checkpoint=resume)
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        return weights, model.losses, cb

    out = {}
    out["plain"], out["plain_losses"], _ = train("plain")
    out["fp32"], _, _ = train("fp32", "fp32")
    out["int8"], out["int8_losses"], cb = train("int8", "int8")
    steps = cb.state.stats["steps"]
    out["hook_steps"] = len(steps)
    out["wire"], out["fp32_bytes"] = sum(s["wire_bytes"] for s in steps), sum(s["fp32_bytes"] for s in steps)
    ck4 = os.path.join(tmp, "int8", "checkpoint-4")
    out["files"] = sorted(os.listdir(ck4))
    if rank == 0:  # a folder whose last checkpoint is checkpoint-4: resume_from_checkpoint=True finds it
        shutil.copytree(ck4, os.path.join(tmp, "resumed", "checkpoint-4"))
    torch.distributed.barrier()
    out["resumed"], _, cb = train("resumed", "int8", resume=True)
    out["resumed_hook_steps"] = len(cb.state.stats["steps"])
    if rank == 0:
        shutil.copytree(ck4, os.path.join(tmp, "dropped"))
        os.remove(os.path.join(tmp, "dropped", FILE))
    torch.distributed.barrier()
    with pytest.raises(FileNotFoundError, match="missing_ok"):
        train("d1", "int8", resume=os.path.join(tmp, "dropped"))
    out["dropped"], _, _ = train("d2", "int8", resume=os.path.join(tmp, "dropped"), missing_ok=True)
    return out


def test_trainer_ddp(tmp_path):
    r0, r1 = spawn.run(2, _run, str(tmp_path), timeout_s=150)
    for r in (r0, r1):
        assert torch.equal(r["fp32"].view(torch.int32), r["plain"].view(torch.int32)), "fp32 != the Trainer's DDP"
        assert not torch.equal(r["int8"], r["plain"]), "int8 gave fp32's bits: the hook did not run"
        assert r["hook_steps"] == STEPS and 0 < r["wire"] < r["fp32_bytes"] / 2
        assert r["resumed_hook_steps"] == STEPS - 4
        assert torch.equal(r["resumed"].view(torch.int32), r["int8"].view(torch.int32)), "resume != uninterrupted"
        assert not torch.equal(r["dropped"], r["int8"]), "flatcomm's saved state made no difference"
    assert "flatcomm_state.pt" in r0["files"] and "trainer_state.json" in r0["files"]
    losses, plain = r0["int8_losses"], r0["plain_losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
    assert abs(sum(losses[-3:]) - sum(plain[-3:])) < 0.1 * sum(plain[-3:]), (losses, plain)
    assert torch.equal(r0["int8"], r1["int8"])


def _run_diloco(rank, world, tmp):
    """Every rank a DiLoCo replica (H=4, 2 fragments, delay 1, AdamW with warm-up and cosine decay),
    a checkpoint every step; resumed from checkpoint-4 (fragment 0's sync in flight) and
    checkpoint-5 (just after it was applied) to step 10."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    from transformers import Trainer, TrainingArguments

    from flatcomm.integrations.transformers import DILOCO_FILE, register_diloco

    def train(name, resume=None):
        args = TrainingArguments(output_dir=os.path.join(tmp, name), use_cpu=True, per_device_train_batch_size=8,
                                 max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2,
                                 weight_decay=0.1, adam_beta2=0.95, save_strategy="steps", save_steps=1,
                                 logging_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                                 ddp_backend="gloo", dataloader_num_workers=0)
        model = _Net()
        trainer = Trainer(model=model, args=args, train_dataset=_Data())
        cb = register_diloco(trainer, sync_every=4, fragments=2, fragment_sync_delay=1, codec="int4", verify_every=1)
        trainer.train(resume_from_checkpoint=resume)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(), cb.outer.stats

    out = {}
    out["full"], st = train("full")
    out["syncs"] = st["syncs"]
    for step in (4, 5):
        ck = os.path.join(tmp, "full", f"checkpoint-{step}")
        if rank == 0:
            out[f"saved_{step}"] = [p["diloco"]["outer"]["in_flight"] is not None for p in
                                    torch.load(os.path.join(ck, DILOCO_FILE), weights_only=True)["ranks"]]
        out[step], _ = train(f"from{step}", resume=ck)
    return out


def test_trainer_diloco_resumes_every_replica(tmp_path):
    r0, r1 = spawn.run(2, _run_diloco, str(tmp_path), timeout_s=150)
    assert not torch.equal(r0["full"], r1["full"]), "the replicas trained alike: DDP still all-reduced"
    assert r0["syncs"] == r1["syncs"] == 4  # fragment 1 at 2, 6, 10 (in flight at the end); fragment 0 at 4, 8
    assert r0["saved_4"] == [True, True] and r0["saved_5"] == [False, False]
    for r in (r0, r1):
        for step in (4, 5):
            assert torch.equal(r[step].view(torch.int32), r["full"].view(torch.int32)), f"resume from {step} differs"


def test_resume_rules_for_diloco_state(tmp_path):
    """One rule with Lightning and Accelerate: a resume without DiLoCo's state raises naming
    missing_ok=True; a checkpoint of a DiLoCo run resumed with register() (plain DDP) raises."""
    from flatcomm.integrations.transformers import DILOCO_FILE, DiLoCoCallback, FlatcommCallback

    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    plain = FlatcommCallback(None, "int8")
    plain.build = lambda: None  # (no trainer here: the checks come first)
    (ckpt / DILOCO_FILE).write_bytes(b"")
    plain.resume_from = str(ckpt)
    with pytest.raises(ValueError, match="register_diloco"):
        plain.on_train_begin(None, None, None)
    (ckpt / DILOCO_FILE).unlink()
    for ok in (False, True):
        cb = DiLoCoCallback(None, sync_every=4, missing_ok=ok)
        cb.build = lambda: None
        cb.resume_from = str(ckpt)
        if ok:
            cb.on_train_begin(None, None, None)  # starts DiLoCo afresh
        else:
            with pytest.raises(ValueError, match=r"no DiLoCo state .* missing_ok=True"):
                cb.on_train_begin(None, None, None)
