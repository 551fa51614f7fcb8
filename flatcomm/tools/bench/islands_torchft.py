"""torchft 0.2's own DiLoCo on the islands bench's islands (a tool; :mod:`flatcomm.tools.bench.islands`).

Each island is a torchft replica group of W ranks: a ``Manager`` per rank with the island's rank and
size (``use_async_quorum=False``, ``init_sync=False``; model, inner optimizer and step in its state
dict so that a heal is complete), DDP inside, torchft's ``DiLoCo`` with the same outer optimizer
(SGD lr 0.7, Nesterov 0.9) and H. torchft's DiLoCo all-reduces the whole model on every rank of the
island (fp32: its quantized path needs triton), so W copies of the model cross between islands per
sync where flatcomm sends one (each rank its 1/W share). A restarted island trains from fresh
weights until its first sync, where it heals (torchft's behaviour), receiving model + inner
optimizer state on every rank.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Dict

import torch

from .churn import TIMEOUT_S, _inner_step, _Log, _place, _torchft_replica, _weights_hash, _workload


def torchft_island_rank(cfg: Dict[str, Any], k: int, r: int, inc: int, log_path: str) -> None:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from flatcomm.elastic.replica import HostTransport, island_store

    from .convergence_workloads import held_out_loss

    host = _place(cfg, f"r{k}")
    logging.getLogger("torchft").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    w, W, H = _workload(cfg), cfg["W"], cfg["H"]
    log = _Log(log_path, f"i{k}r{r}")
    log("phase", island=k, rank=r, inc=inc, phase="start")
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.FileStore(os.path.join(cfg["tmp"], f"{cfg['run']}-island{k}.{inc}.store"), W)
    dist.init_process_group("gloo", store=store, rank=r, world_size=W, timeout=timeout)
    torch.manual_seed(1000 + cfg["seed"])
    model = torch.nn.parallel.DistributedDataParallel(w.model())
    opt, sched = w.make_optimizer(model.parameters())
    outer_opt, state, load, save = _torchft_replica(model, opt)

    _keep, shost, sport = island_store(dist.group.WORLD, host, timeout)
    transport = HostTransport(host, timeout)
    majority = 1 if cfg["N"] <= 2 else cfg["N"] // 2 + 1  # as the lighthouse's min_replicas
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=majority,
                      use_async_quorum=False,
                      init_sync=False, load_state_dict=load, state_dict=save, replica_id=f"island{k}",
                      store_addr=shost, store_port=sport, rank=r, world_size=W, lighthouse_addr=cfg["lighthouse"],
                      hostname=host, timeout=timeout, quorum_timeout=timedelta(seconds=120),
                      checkpoint_transport=transport)
    log("phase", island=k, rank=r, inc=inc, phase="manager")
    numel = sum(p.numel() for p in model.parameters())
    with TorchftDiLoCo(manager, [model], opt, outer_opt, sync_every=H, backup_device=torch.device("cpu")):
        while state["step"] < w.steps:
            if state["step"] % H == H // 2:
                log("mid", island=k, rank=r, inc=inc, mstep=manager.current_step(), step=state["step"])
            before, state["healed"] = manager.current_step(), False
            t = time.perf_counter()
            _inner_step(w, model, opt, sched, state["step"], k * W + r)
            time.sleep(max(0.0, cfg["step_s"] - (time.perf_counter() - t)))
            state["step"] += 1  # a heal in this step's sync loaded the donor's count (already past it)
            if state["step"] % H == 0:
                healed = state["healed"]
                heal_s, heal_bytes = transport.last_recv if healed else (0.0, 0)
                log("round", island=k, rank=r, inc=inc, mstep=manager.current_step(), step=state["step"],
                    committed=manager.current_step() > before, quorum=manager.num_participants(),
                    contributors=manager.num_participants(), healed=healed, heal_s=heal_s, heal_bytes=heal_bytes,
                    part=numel, hash=_weights_hash(model.module))
    log("done", island=k, rank=r, inc=inc, step=state["step"], heldout=held_out_loss(w, model.module))
    log.f.close()
    dist.barrier()  # the island's rank 0 serves its should_commit: none leaves before the others' answer
    manager.shutdown(wait=False)
    os._exit(0)
