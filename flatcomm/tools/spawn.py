"""Run a function on N local processes joined in a gloo process group (tests, demo, benchmarks).

Each rank runs ``fn(rank, world, *args)``; the return values come back as a list in rank order and
an exception on any rank is re-raised in the parent with that rank's traceback.

Ranks are forked from one forkserver that has imported torch and flatcomm once: a rank starts in
~0.1 s instead of the 2-4 s a fresh interpreter takes to import torch on a small machine (the test
suite starts a few hundred ranks). Each rank gets the caller's environment as it is at the call, as
a fresh interpreter would.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_PRELOAD = ["torch", "torch.distributed", "flatcomm", "flatcomm.tools.spawn"]
_context = None


def _forkserver():
    """The one forkserver context of this process, preloading torch and flatcomm."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _exit_with(launcher: int) -> None:
    """End this rank when the process that launched it is gone (killed: its ``finally`` never ran),
    rather than computing on for the rest of its run."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:  # (alive, another user's: not ours to judge)
                pass

    threading.Thread(target=watch, name="flatcomm-spawn-watch", daemon=True).start()


def _entry(rank, world, init_file, timeout_s, threads, fn, args, queue, backend="gloo", env=None, launcher=None):
    if launcher is not None:
        _exit_with(launcher)
    try:
        if env is not None:  # the caller's environment now, not the forkserver's at its start
            os.environ.clear()
            os.environ.update(env)
        torch.set_num_threads(threads)
        if "flatcomm" in backend:
            import flatcomm.backend  # noqa: F401 - registers the backend
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            if dist.is_initialized():  # (unless fn destroyed it)
                dist.destroy_process_group()
        # Tensors travel as bytes: shared-memory handles would die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
        threads: int = 1, run_s: Optional[float] = None, backend: str = "gloo") -> List[Any]:
    """Run ``fn`` on ``world`` gloo ranks and return their results (picklable) in rank order.
    ``timeout_s``: the process group's timeout; ``run_s``: how long the whole run may take
    (default ``timeout_s`` + 60 s); ``backend``: of the default group (``"flatcomm"``: the
    backend of :mod:`flatcomm.backend`)."""
    ctx = _forkserver()
    queue = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, timeout_s, threads, fn, args, queue, backend, env,
                                                  os.getpid()))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict = {}
        errors: List[str] = []
        deadline = time.monotonic() + (run_s if run_s is not None else timeout_s + 60)
        try:
            while len(results) + len(errors) < world:
                try:
                    rank, ok, value = queue.get(timeout=1.0)
                except queue_mod.Empty:
                    # A rank that died without reporting (killed, crashed in C++) ends the run.
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        why = f"ranks {dead} exited abnormally" if dead else "timed out"
                        raise RuntimeError(f"flatcomm.tools.spawn: {why}; "
                                           f"{len(results)} of {world} ranks reported") from None
                    continue
                if ok:
                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
