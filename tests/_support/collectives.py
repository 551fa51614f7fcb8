"""Inputs per rank, bitwise comparisons, a per-rank log of checks and delay injection for the
collectives tests (run on the ranks)."""
from __future__ import annotations

import random
import time
import zlib
from typing import List, Tuple

import torch
import torch.distributed as dist

from flatcomm.comm import pipeline


def inputs(tag: str, world: int, n: int, dtype: torch.dtype = torch.float32, kind: str = "mixed") -> List[torch.Tensor]:
    """Every rank's input for case ``tag`` (each rank can rebuild all of them)."""
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{r}".encode()))
        x = torch.randn(n, generator=g)
        if kind == "mixed":
            x = x * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
            x[torch.rand(n, generator=g) < 0.03] = 0.0
        elif kind == "wide":  # magnitudes over 2^+-30, and cancellation between ranks
            x = x * torch.exp2(torch.randint(-30, 31, (n,), generator=g).float())
        xs.append(x.to(dtype))
    return xs


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def gather(t: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's tensor (as fp32, exact for bf16/fp16), on every rank."""
    t = t.reshape(-1).float()
    world = dist.get_world_size()
    if world == 1:
        return [t.clone()]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


Checks = List[Tuple[str, str, bool, str]]


class _Log:
    def __init__(self, rank: int):
        self.rank = rank
        self.checks: Checks = []

    def add(self, section: str, name: str, ok: bool, msg: str = "") -> None:
        self.checks.append((section, name, bool(ok), msg))

    def close(self, section: str, name: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
        err = (got.double() - ref).abs()
        bad = ~(err <= bound)
        if bad.any():
            i = int(bad.nonzero()[0])
            self.add(section, name, False, f"{int(bad.sum())}/{err.numel()} outside bound; first at {i}: "
                     f"got {got[i].item()!r} ref {ref[i].item()!r} err {err[i].item():.3g} bound {bound[i].item():.3g}")
        else:
            ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
            self.add(section, name, True, f"max err/bound {ratio:.3f}")

    def bitwise(self, section: str, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        ok = same_bits(got, ref)
        msg = ""
        if not ok:
            if got.shape == ref.shape and got.dtype == ref.dtype:
                d = (bits(got) != bits(ref)).nonzero().flatten()
                msg = f"{d.numel()}/{got.numel()} differ; first at {int(d[0])}: {got[d[0]].item()!r} vs {ref[d[0]].item()!r}"
            else:
                msg = f"{got.dtype}{tuple(got.shape)} vs {ref.dtype}{tuple(ref.shape)}"
        self.add(section, name, ok, msg)


def _identical_across_ranks(log: _Log, section: str, name: str, t: torch.Tensor) -> None:
    allv = gather(t)
    if log.rank == 0:
        ok = all(same_bits(allv[0], v) for v in allv[1:])
        log.add(section, name, ok, "" if ok else "ranks hold different bits")


def _with_delays(seed: int, max_s: float):
    """Monkeypatch the pipeline so every chunk wait starts after a random per-rank delay."""
    rng = random.Random(seed)
    orig = pipeline.Pipeline.wait

    def wait(self, work):
        time.sleep(rng.random() * max_s)
        orig(self, work)

    pipeline.Pipeline.wait = wait
    return lambda: setattr(pipeline.Pipeline, "wait", orig)


def _expect(log: _Log, name: str, exc: type, fn, words: Tuple[str, ...] = ()) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except exc as e:
        dt = time.perf_counter() - t0
        msg = str(e)
        ok = dt < 5.0 and all(w in msg for w in words)
        log.add("bad_input", f"rank {log.rank}: {name}", ok, f"{dt:.2f} s: {msg[:200]}")
        return
    except Exception as e:  # noqa: BLE001
        log.add("bad_input", f"rank {log.rank}: {name}", False, f"wrong exception {e!r}"[:300])
        return
    log.add("bad_input", f"rank {log.rank}: {name}", False, "no exception")


def spread_values(owner: int, n: int = 1001, spread: int = 20, seed: int = 7) -> torch.Tensor:
    """Owner ``owner``'s test values: gaussian times 2^[-spread, spread], some zeros."""
    g = torch.Generator().manual_seed(seed * 1000 + owner)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x
