"""The flatcomm backend's prepared all-reduces (flatcomm.comm.prepared.Prepared, cached per group by
numel, dtype and op in flatcomm.backend.reduce): a repeated dist.all_reduce skips the argument layers,
in the header's slot, gathered or pipelined. It must give the full path's bits on fresh values at
every call, follow a settings change (re-prepared), pair with a rank on the full path and raise the
same named error on every rank, and queue a small call behind the calls queued on the worker."""
from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from flatcomm.tools import spawn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 3, 33, 1000, 4093, 600_001)  # 600,001: gathered (bf16, fp16) or pipelined (fp32)
REPS = 3  # each shape reduced this often: the first call prepares, the others reuse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _values(rank: int, rep: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 31 * rep + n)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    if n >= 33:  # non-finite values, NaNs whose payloads differ between ranks at the same index
        x[::9] = float("inf") if rank == 0 else -1.0
        nan = torch.tensor([0x7FC00001 + rank + 16 * rep], dtype=torch.int32).view(torch.float32)
        x[4::13] = nan
    return x.to(dtype)


def _all(rank: int) -> dict:
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        for dt in DTYPES:
            for n in SIZES:
                for rep in range(REPS):
                    x = _values(rank, rep, n, dt)
                    dist.all_reduce(x, op=op)
                    out[(str(op), dt, n, rep)] = _bits(x)
    return out


def _prepared_vs_large(rank: int, world: int, mode: str) -> dict:
    import flatcomm.backend as fb
    from flatcomm.comm import header, prepared, small

    fb.configure(None, mode=mode)
    posts = []
    post = prepared.Prepared.post

    def counted(self, tensor):
        handle = post(self, tensor)
        posts.append(handle is not None)
        return handle

    prepared.Prepared.post = counted
    fast = _all(rank)
    prepared.Prepared.post = post
    header.SLOT_MAX_BYTES = 0  # no slot, nothing gathered: every call takes the pipelined path
    small.GATHER_TABLE_BYTES = 0
    dist.group.WORLD.prepared.clear()
    prepared.prepare_all_reduce = lambda *args: None  # checked in full each time
    large = _all(rank)
    return {"prepared": fast, "large": large, "posted": sum(posts), "calls": len(posts)}


@pytest.mark.parametrize("world,mode", [(2, "ordered"), (3, "ordered"), (3, "exact")])
def test_prepared_calls_give_the_full_large_paths_bits(world, mode):
    res = spawn.run(world, _prepared_vs_large, mode, timeout_s=120, backend="flatcomm")
    calls = 2 * len(DTYPES) * len(SIZES) * REPS
    for r in res:
        assert r["calls"] == calls and r["posted"] == calls, (r["calls"], r["posted"])
        for key, bits in r["prepared"].items():
            assert torch.equal(bits, r["large"][key]), (key, bits[:6], r["large"][key][:6])
    for key in res[0]["prepared"]:
        assert all(torch.equal(r["prepared"][key], res[0]["prepared"][key]) for r in res), key


def _settings_change(rank: int, world: int) -> list:
    import flatcomm.backend as fb

    x = torch.tensor([[1e8], [1.0], [-1e8]])[rank].repeat(5)  # ordered: (1e8 + 1) - 1e8 = 0 in fp32
    seen = []
    for mode in ("ordered", "ordered", "exact", "exact", "ordered"):
        fb.configure(None, mode=mode)
        y = x.clone()
        dist.all_reduce(y)
        seen.append(y.tolist())
    return seen


def test_a_settings_change_prepares_again():
    for r in spawn.run(3, _settings_change, timeout_s=60, backend="flatcomm"):
        assert r == [[0.0] * 5, [0.0] * 5, [1.0] * 5, [1.0] * 5, [0.0] * 5], r


def _mismatch(rank: int, world: int) -> list:
    seen = []
    big = 600_000  # the pipelined path
    for n in ((9, 9), (9, 9), (9, 10), (10, 9), (9, 9), (big, big), (big, big + 1), (big, big)):
        x = torch.full((n[rank],), float(rank + 1))  # prepared on both, then each side differs
        try:
            dist.all_reduce(x)
            seen.append(x[:9].tolist())
        except ValueError as e:
            seen.append(str(e))
    for n in (1000, big):  # a prepared call keeps no caller's tensor alive
        x = torch.ones(n)
        alive = weakref.ref(x)
        dist.all_reduce(x)
        del x
        for _ in range(100):  # (the worker thread may drop its last reference a moment after the wait)
            gc.collect()
            if alive() is None:
                break
            time.sleep(0.02)
        seen.append(alive() is None)
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=sub)
    held = len(sub.prepared)
    dist.destroy_process_group(sub)
    return seen + [held, len(sub.prepared)]


def test_prepared_and_full_path_ranks_raise_the_same_named_error():
    for r in spawn.run(2, _mismatch, timeout_s=60, backend="flatcomm"):
        assert r[0] == r[1] == [3.0] * 9
        assert "ranks disagree on numel: rank 0 9, rank 1 10" in r[2], r[2]
        assert "ranks disagree on numel: rank 0 10, rank 1 9" in r[3], r[3]
        assert r[4] == r[5] == [3.0] * 9  # in step again
        assert "ranks disagree on numel: rank 0 600000, rank 1 600001" in r[6], r[6]
        assert r[7] == [3.0] * 9
        assert r[8:10] == [True, True]
        assert r[10:] == [1, 0]  # a destroyed group keeps nothing prepared


def _behind_a_queued_call(rank: int, world: int) -> list:
    from flatcomm.comm import worker

    took = []
    post_if_idle = worker.post_if_idle  # (None: the call was queued behind the others)
    worker.post_if_idle = lambda key, post, **kw: took.append(p := post_if_idle(key, post, **kw)) or p
    big = torch.full((1 << 22,), float(rank + 1))
    out = []
    for _ in range(3):
        small_x = torch.full((7,), float(rank + 1))
        work = dist.all_reduce(big, async_op=True)  # on the group's worker, in flight
        dist.all_reduce(small_x)
        work.wait()
        out.append((small_x.tolist(), bool((big == 3.0).all())))
        big.fill_(float(rank + 1))
    return [out, sum(p is None for p in took)]


def test_a_small_call_behind_queued_calls_is_queued_in_order():
    for r in spawn.run(2, _behind_a_queued_call, timeout_s=60, backend="flatcomm"):
        assert r[0] == [([3.0] * 7, True)] * 3, r
        assert r[1] >= 1  # (the 16 MB call is still in flight when the small one comes)
