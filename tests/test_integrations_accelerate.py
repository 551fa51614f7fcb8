"""flatcomm.integrations.accelerate on 2 gloo ranks: Accelerate's MULTI_CPU (DDP) path.

One spawn runs every training run: plain Accelerate, flatcomm fp32 (the same bits), int8 (trains,
the hook runs), int8 saved with ``save_state`` at step 4 and resumed with ``load_state`` to step 10
(the same bits as the uninterrupted run), and that resume without flatcomm's saved state (differs).
"""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

pytest.importorskip("accelerate")

from flatcomm.tools import spawn  # noqa: E402

STEPS, SAVE_AT = 10, 4


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 8, generator=g)
    return x, x[:, :4].sum(1, keepdim=True) * 0.5


def _run(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    from accelerate import Accelerator

    import flatcomm.ddp
    from flatcomm.integrations.accelerate import register

    def train(codec=None, save_dir=None, load_dir=None, adapter=True):
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
        opt = torch.optim.Adam(net.parameters(), lr=3e-2)
        model, opt = accelerator.prepare(net, opt)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        state = None
        if codec is not None:
            state = register(accelerator, model, codec) if adapter else flatcomm.ddp.register(model, codec)
        start = 0
        if load_dir:
            accelerator.load_state(load_dir)
            start = SAVE_AT
        losses = []
        for step in range(start, STEPS):
            x, y = _batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if save_dir and step + 1 == SAVE_AT:
                accelerator.save_state(save_dir)
        weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
        accelerator.free_memory()
        return weights, losses, state

    out = {}
    out["plain"], out["plain_losses"], _ = train()
    out["fp32"], _, _ = train("fp32")
    saved = os.path.join(tmp, "ckpt")
    out["int8"], out["int8_losses"], st = train("int8", save_dir=saved)
    steps = st.stats["steps"]
    out["hook_steps"] = len(steps)
    out["wire"], out["fp32_bytes"] = sum(s["wire_bytes"] for s in steps), sum(s["fp32_bytes"] for s in steps)
    out["files"] = sorted(os.listdir(saved))
    out["resumed"], _, st = train("int8", load_dir=saved)
    out["resumed_hook_steps"] = len(st.stats["steps"])
    # the same checkpoint without flatcomm's state: the residuals start from zero
    dropped = os.path.join(tmp, "dropped")
    if rank == 0:
        shutil.copytree(saved, dropped)
        os.remove(os.path.join(dropped, "custom_checkpoint_0.pkl"))
    torch.distributed.barrier()
    out["dropped"], _, _ = train("int8", load_dir=dropped, adapter=False)
    return out


def test_accelerate_ddp(tmp_path):
    r0, r1 = spawn.run(2, _run, str(tmp_path), timeout_s=120)
    for r in (r0, r1):
        assert torch.equal(r["fp32"].view(torch.int32), r["plain"].view(torch.int32)), "fp32 != Accelerate's DDP"
        assert not torch.equal(r["int8"], r["plain"]), "int8 gave fp32's bits: the hook did not run"
        assert r["hook_steps"] == STEPS and 0 < r["wire"] < r["fp32_bytes"] / 2
        assert r["resumed_hook_steps"] == STEPS - SAVE_AT
        assert torch.equal(r["resumed"].view(torch.int32), r["int8"].view(torch.int32)), "resume != uninterrupted"
        assert not torch.equal(r["dropped"], r["int8"]), "flatcomm's saved state made no difference"
    assert "custom_checkpoint_0.pkl" in r0["files"]
    losses, plain = r0["int8_losses"], r0["plain_losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
    assert abs(sum(losses[-3:]) - sum(plain[-3:])) < 0.1 * sum(plain[-3:]), (losses, plain)
    assert torch.equal(r0["int8"], r1["int8"])


ACCUMULATE = 2  # micro-batches per optimizer step


def _run_diloco(rank, world, tmp):
    """Every rank a DiLoCo replica (H=4, 2 fragments, delay 1, int4) with gradient accumulation:
    saved at step 4 (fragment 0's sync in flight) and step 5 (just after it was applied), each
    resumed with load_state to step 10."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    from accelerate import Accelerator

    from flatcomm.integrations.accelerate import register_diloco

    def train(save_at=(), load=None):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        model, opt = accelerator.prepare(net, opt)
        outer = register_diloco(accelerator, model, opt, sync_every=4, fragments=2, fragment_sync_delay=1,
                                codec="int4", verify_every=1)
        start = 0
        if load is not None:
            accelerator.load_state(os.path.join(tmp, f"ckpt{load}"))
            start = load
        for step in range(start, STEPS):
            for micro in range(ACCUMULATE):
                with accelerator.accumulate(model):
                    x, y = _batch(ACCUMULATE * step + micro, rank)
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
            if step + 1 in save_at:
                accelerator.save_state(os.path.join(tmp, f"ckpt{step + 1}"))
        weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
        stats = outer.stats
        outer.close()
        accelerator.free_memory()
        return weights, stats

    out = {}
    out["full"], st = train(save_at=(4, 5))
    out["steps"], out["syncs"] = st["inner_steps"], st["syncs"]
    out[4], _ = train(load=4)
    out[5], _ = train(load=5)
    return out


def test_accelerate_diloco_resumes_every_replica(tmp_path):
    r0, r1 = spawn.run(2, _run_diloco, str(tmp_path), timeout_s=120)
    assert not torch.equal(r0["full"], r1["full"]), "the replicas trained alike: DDP still all-reduced"
    assert r0["steps"] == STEPS and r0["syncs"] == 4  # one inner step per accumulated step
    for r in (r0, r1):
        for step in (4, 5):
            assert torch.equal(r[step].view(torch.int32), r["full"].view(torch.int32)), f"resume from {step} differs"


SAVE_TIMEOUT_S = 3.0


def _run_main_only(rank, world, tmp):
    """``if accelerator.is_main_process: accelerator.save_state(...)``: the save gathers every
    replica's DiLoCo state, a collective. Rank 0 (saving) and rank 1 (training on, into its next
    sync) both raise within the group's timeout, saying that save_state must run on every rank.
    Also: what each rank holds of a save (rank 0 only), and an empty DiLoCo entry at load."""
    from datetime import timedelta

    import torch.distributed as dist
    from accelerate import Accelerator

    from flatcomm.integrations.accelerate import RankStates, register_diloco

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    out = {}
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = accelerator.prepare(net, opt)
    outer = register_diloco(accelerator, model, opt, sync_every=2, codec="int8")
    saved = accelerator._custom_objects[-1]
    out["held"] = sorted(saved.state_dict())  # what save_state would write: the parts on rank 0 only
    replica = saved.state
    for ok in (False, True):
        try:
            RankStates(replica, accelerator, missing_ok=ok).load_state_dict({})
            out[f"empty, missing_ok={ok}"] = ""
        except ValueError as e:
            out[f"empty, missing_ok={ok}"] = str(e)
    def step(t):
        x, y = _batch(t, rank)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    for t in range(2):  # past DDP's own first-iterations collectives (bucket rebuild), one sync
        step(t)
    dist.group.WORLD.set_timeout(timedelta(seconds=SAVE_TIMEOUT_S))  # flatcomm's group inherits it
    t0 = time.monotonic()
    try:
        if accelerator.is_main_process:
            accelerator.save_state(os.path.join(tmp, "ckpt"))
        for t in range(2, 4):  # rank 1: into its next sync (after step 4), which rank 0 never joins
            step(t)
        out["error"] = ""
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - t0
    outer._hook.remove()  # (the run is broken: leave without draining)
    return out


def test_accelerate_save_state_on_main_process_only_fails_on_every_rank(tmp_path):
    res = spawn.run(2, _run_main_only, str(tmp_path), timeout_s=30)
    assert res[0]["held"] == ["format", "kind", "ranks", "version", "world_size"] and res[1]["held"] == [], \
        (res[0]["held"], res[1]["held"])
    for rank, out in enumerate(res):
        assert "missing_ok=True" in out["empty, missing_ok=False"] and out["empty, missing_ok=True"] == "", out
        assert "every rank" in out["error"] and "is_main_process" in out["error"], f"rank {rank}: {out['error']}"
        assert out["elapsed"] < 4 * SAVE_TIMEOUT_S, f"rank {rank} raised after {out['elapsed']:.1f} s"
    assert "did not enter this checkpoint save" in res[0]["error"], res[0]["error"]
    assert "entered a checkpoint save" in res[1]["error"], res[1]["error"]
