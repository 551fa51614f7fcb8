"""Multi-process tests of flatcomm.collectives on gloo (1, 2, 3 and 4 ranks).

Process start-up dominates on a small machine, so each world size is ONE spawn: every rank runs all
the sections below (``_rank_main``) and returns a list of named checks; each pytest item then
asserts one section of one world size. Rank 0 computes the oracles:

* a float64 reference (sum / mean of the inputs) with an error bound derived from the codec
  (per stage: int8/int4 half a block step, bf16/fp16 half an ulp, sign |v| + block max, topk |v|,
  plus fp32 rounding of the ordered sum and of the output dtype);
* a bitwise single-process simulation of the documented plan (shards and chunks aligned to the
  codec block, every piece encoded separately, decoded and summed in source-rank order) using the
  flatcomm kernels, so any plumbing error (wrong piece, wrong order, wrong scale) shows as a bit
  difference;
* flatcomm.exact_sum for exact mode.
"""
from __future__ import annotations

import random
import time
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import flatcomm
from flatcomm.tools import spawn
from flatcomm import collectives as C
from flatcomm.comm import groups, layout, pipeline
from flatcomm.ops import reference as R
from flatcomm.ops.codecs import CODECS, Codec, decode, decode_sum, encode

from _support.collectives import (Checks, _expect, _identical_across_ranks, _Log, _with_delays, gather, inputs,
                                  same_bits)

WORLDS = (1, 2, 3, 4)
SECTIONS = ("accuracy", "chunks", "determinism", "exact", "error_feedback", "async", "bad_input")

# ---- helpers shared by ranks and oracles --------------------------------------------------------------


def align_of(codec: str) -> int:
    return Codec(codec).align


def blockmax(v: torch.Tensor, bs: int) -> torch.Tensor:
    """Per-element max of |v| over its block (blocks of bs from index 0)."""
    n = v.numel()
    nb = -(-n // bs)
    padded = torch.nn.functional.pad(v.abs(), (0, nb * bs - n))
    return padded.view(nb, bs).amax(1).repeat_interleave(bs)[:n]


def codec_bound(v: torch.Tensor, codec: str, grid: List[int]) -> torch.Tensor:
    """float64 bound on |v - decode(encode(v))| per element; blocks start at each grid point."""
    v = v.double()
    out = torch.empty_like(v)
    bs = Codec(codec).block_size
    for a, b in zip(grid[:-1], grid[1:]):
        if b <= a:
            continue
        p = v[a:b]
        if codec == "fp32":
            e = torch.zeros_like(p)
        elif codec == "bf16":
            e = p.abs() * 2.0**-8 + 2.0**-133
        elif codec == "fp16":
            e = p.abs() * 2.0**-11 + 2.0**-24
        elif codec in ("int8", "int4"):
            qmax = R.QMAX[codec]
            e = blockmax(p, bs) / qmax * (0.5 + qmax * 2.0**-21) * (1 + 2.0**-20) + qmax * 2.0**-149
        elif codec == "sign" or Codec(codec).chunked:  # decoded: sign(v) * a mean |v| of the block
            e = p.abs() + blockmax(p, bs)
        else:  # topk: kept values exact, others dropped
            e = p.abs()
        out[a:b] = e
    return out


def out_rounding(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return v.abs() * 2.0**-8 + 2.0**-133
    if dtype == torch.float16:
        return v.abs() * 2.0**-11 + 2.0**-24
    return torch.zeros_like(v)


def plan_pieces(bounds: List[int], chunks: int, align: int) -> List[List[Tuple[int, int]]]:
    """Per shard, its (start, end) pieces: chunks aligned to ``align`` from the shard start."""
    pieces = []
    for d in range(len(bounds) - 1):
        cb = C.shard_bounds(bounds[d + 1] - bounds[d], chunks, align)
        pieces.append([(bounds[d] + cb[j], bounds[d] + cb[j + 1]) for j in range(chunks)])
    return pieces


def grid_of(pieces: List[List[Tuple[int, int]]], n: int) -> List[int]:
    return sorted({0, n} | {a for ps in pieces for a, _ in ps})


# ---- simulations (single process, flatcomm kernels, bit for bit) --------------------------------------


def sim_reduce_scatter(xs, codec, scale, chunks, out_dtype) -> torch.Tensor:
    world, n = len(xs), xs[0].numel()
    m = n // world
    c = Codec(codec)
    pieces = plan_pieces([r * m for r in range(world + 1)], chunks, align_of(codec))
    out = torch.empty(n, dtype=out_dtype)
    for ps in pieces:
        for a, b in ps:
            if b > a:
                pay = torch.stack([encode(x[a:b], c) for x in xs])
                out[a:b] = decode_sum(pay, c, b - a, scale=scale).to(out_dtype)
    return out


def sim_all_reduce(xs, codec, scale, chunks) -> torch.Tensor:
    world, n = len(xs), xs[0].numel()
    c = Codec(codec)
    al = align_of(codec)
    pieces = plan_pieces(C.shard_bounds(n, world, al), chunks, al)
    out = torch.empty(n, dtype=xs[0].dtype)
    for ps in pieces:
        for a, b in ps:
            if b > a:
                pay = torch.stack([encode(x[a:b], c) for x in xs])
                if not c.reencodes_fused:  # topk, sparse, sparse4: re-selected from the shard's sum
                    p2 = encode(decode_sum(pay, c, b - a, scale=scale), c)
                else:
                    p2 = decode_sum(pay, c, b - a, scale=scale, reencode=c)
                out[a:b] = decode(p2, c, b - a, dtype=out.dtype)
    return out


def bound_reduce(xs, codec, scale, grid) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference, bound) for one encode stage and an ordered fp32 sum times scale."""
    world = len(xs)
    ref = sum(x.double() for x in xs) * scale
    enc = sum(codec_bound(x, codec, grid) for x in xs) * scale
    mag = sum(x.double().abs() for x in xs) * scale + enc
    rnd = mag * (world + 1) * 2.0**-24 * (1 + 2.0**-20) + 2.0**-140
    return ref, enc + rnd


# ---- the rank program ------------------------------------------------------------------------------------


SIZES = (1, 7, 1000, 30011)


def _accuracy(log: _Log, rank: int, world: int) -> None:
    """reduce_scatter / all_reduce / all_gather of every codec against float64 and a bitwise plan."""
    # Up to 2 ranks every case; 3 and 4 ranks (uneven and empty shards, more sources per sum) the
    # cases whose path depends on the world size: every codec at a size below one shard per rank
    # and at a ragged multi-chunk size, the output dtypes on one cast and one blockwise codec, the
    # raw payloads at a size below the ranks and a ragged one. op and output rounding do not
    # depend on the world size: 2 ranks cover them in full.
    full = world <= 2
    cases = []
    for codec in CODECS:
        for n, op in ([(n, op) for n in SIZES for op in ("avg", "sum")] if full else [(7, "avg"), (30011, "sum")]):
            cases.append((codec, n, op, 3 if n > 1000 else 1, torch.float32))
        if full or codec in ("fp32", "int8"):
            cases.append((codec, 1000, "avg", 2, torch.bfloat16))
            cases.append((codec, 1000, "sum", 2, torch.float16))
    # Raw payloads on dtype-matched data, one chunk: the zero-copy path (sends the caller's tensor,
    # equal shards gather straight into it); 4099 leaves a ragged last shard (staged fallback).
    for codec, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for n in ((1, 7, 768, 4099, 30011) if full else (7, 4099)):
            cases.append((codec, n, "avg", 1, dtype))
    for codec, n, op, chunks, dtype in cases:
        # Tiny gather pieces on the raw cases: many pieces, shards ending inside a piece.
        pipeline.GATHER_PIECE_BYTES = 4096 if chunks == 1 and codec in ("fp32", "bf16", "fp16") else 8 << 20
        scale = 1.0 / world if op == "avg" else 1.0
        tag = f"acc/{codec}/{n}/{op}/{dtype}/{world}"
        # all_reduce
        xs = inputs(tag, world, n, dtype)
        t = xs[rank].clone()
        C.all_reduce(t, codec=codec, op=op, chunks=chunks)
        name = f"all_reduce {codec} n={n} op={op} chunks={chunks} {dtype}"
        _identical_across_ranks(log, "accuracy", name + " same bits on all ranks", t)
        if rank == 0:
            log.bitwise("accuracy", name + " == plan", t, sim_all_reduce(xs, codec, scale, chunks))
            al = align_of(codec)
            grid = grid_of(plan_pieces(C.shard_bounds(n, world, al), chunks, al), n)
            ref, b1 = bound_reduce(xs, codec, scale, grid)
            if codec == "fp32":
                b2 = torch.zeros_like(ref)
            else:  # the second stage encodes s, |s - ref| <= b1: its codec error is bounded via |ref| + b1
                b2 = codec_bound(ref.abs() + b1, codec, grid)
            total = b1 + b2
            total = total + out_rounding(ref.abs() + total, dtype)
            log.close("accuracy", name + " vs float64", t, ref, total * (1 + 1e-9))
        # reduce_scatter (output numel m; input world * m)
        m = max(1, n // world)
        xs = inputs(tag + "/rs", world, world * m, dtype)
        out = torch.empty(m, dtype=dtype)
        C.reduce_scatter(out, xs[rank].clone(), codec=codec, op=op, chunks=chunks)
        shards = gather(out)
        if rank == 0:
            got = torch.cat(shards).to(dtype)
            name = f"reduce_scatter {codec} m={m} op={op} chunks={chunks} {dtype}"
            log.bitwise("accuracy", name + " == plan", got, sim_reduce_scatter(xs, codec, scale, chunks, dtype))
            grid = grid_of(plan_pieces([r * m for r in range(world + 1)], chunks, align_of(codec)), world * m)
            ref, b1 = bound_reduce(xs, codec, scale, grid)
            total = b1 + out_rounding(ref.abs() + b1, dtype)
            log.close("accuracy", name + " vs float64", got, ref, total * (1 + 1e-9))
        # all_gather (reduce_scatter's output size per rank)
        xs = inputs(tag + "/ag", world, m, dtype)
        out = torch.empty(world * m, dtype=dtype)
        C.all_gather(out, xs[rank].clone(), codec=codec)
        _identical_across_ranks(log, "accuracy", f"all_gather {codec} m={m} {dtype} same bits on all ranks", out)
        if rank == 0:
            name = f"all_gather {codec} m={m} {dtype}"
            sim = torch.cat([decode(encode(x, codec), codec, m, dtype=dtype) for x in xs])
            log.bitwise("accuracy", name + " == plan", out, sim)
            ref = torch.cat([x.double() for x in xs])
            b = torch.cat([codec_bound(x, codec, [0, m]) for x in xs])
            log.close("accuracy", name + " vs float64", out, ref, (b + out_rounding(ref.abs() + b, dtype)) * (1 + 1e-9))


def _chunks(log: _Log, rank: int, world: int) -> None:
    """chunks=1 and chunks=3 give the same bits for every codec whose blocks are the same (all but
    topk, which selects per piece); auto chunking too; also tiny tensors with more chunks than
    blocks, and numel 0."""
    n = 90001
    for codec in CODECS:
        if codec == "topk":
            continue
        for op in ("avg", "sum"):
            xs = inputs(f"chunks/{codec}/{op}", world, n)
            res = []
            for ch in (1, 3, 5):
                t = xs[rank].clone()
                C.all_reduce(t, codec=codec, op=op, chunks=ch)
                res.append(t)
            log.add("chunks", f"all_reduce {codec} {op}: chunks 1 == 3 == 5",
                    same_bits(res[0], res[1]) and same_bits(res[0], res[2]))
            out1, out3 = torch.empty(n // world), torch.empty(n // world)
            src = xs[rank][: world * (n // world)].clone()
            C.reduce_scatter(out1, src, codec=codec, op=op, chunks=1)
            C.reduce_scatter(out3, src, codec=codec, op=op, chunks=3)
            log.add("chunks", f"reduce_scatter {codec} {op}: chunks 1 == 3", same_bits(out1, out3))
    # auto chunking (several chunks for 4M values) against chunks=1, with error feedback
    big = inputs("chunks/auto", world, 1 << 22)[rank]
    a, b = big.clone(), big.clone()
    ra, rb = C.ErrorFeedback.zeros(big.numel()), C.ErrorFeedback.zeros(big.numel())
    C.all_reduce(a, codec="int8", chunks=1, residual=ra)
    C.all_reduce(b, codec="int8", residual=rb)
    auto = layout._auto_chunks(max(1, big.numel() // world), Codec("int8"), "ordered")
    log.add("chunks", f"all_reduce int8 4M values: auto ({auto} chunks) == chunks=1",
            auto > 1 and same_bits(a, b) and same_bits(ra.client, rb.client) and same_bits(ra.server, rb.server))
    # more chunks than values, and empty tensors
    for codec in CODECS:
        for n in (0, 1, 5):
            xs = inputs(f"chunks/tiny/{codec}/{n}", world, n)
            t = xs[rank].clone()
            try:
                C.all_reduce(t, codec=codec, op="sum", chunks=4)
                ok = rank != 0 or same_bits(t, sim_all_reduce(xs, codec, 1.0, 4))
                log.add("chunks", f"all_reduce {codec} n={n} chunks=4", ok)
            except Exception as e:  # noqa: BLE001
                log.add("chunks", f"all_reduce {codec} n={n} chunks=4", False, repr(e)[:300])


def _determinism(log: _Log, rank: int, world: int) -> None:
    """Same bits on every rank and every repetition, with random delays before the call and
    between chunks, and with several asynchronous collectives in flight at once."""
    n = 40000
    rng = random.Random(1000 + rank)
    runs: Dict[str, List[torch.Tensor]] = {}
    for rep in range(3):
        undo = _with_delays(rep * 100 + rank, 0.004)
        try:
            for codec in CODECS:
                x = inputs(f"det/{codec}", world, n)[rank]
                time.sleep(rng.random() * 0.01)
                t = x.clone()
                C.all_reduce(t, codec=codec, chunks=3)
                runs.setdefault(f"all_reduce {codec}", []).append(t)
            for mode in ("ordered", "exact"):
                x = inputs(f"det/rs/{mode}", world, world * 10000)[rank]
                out = torch.empty(10000)
                time.sleep(rng.random() * 0.01)
                C.reduce_scatter(out, x.clone(), mode=mode, chunks=3)
                runs.setdefault(f"reduce_scatter fp32 {mode}", []).append(out)
            # several collectives in flight: two async, then a synchronous one, then waits
            xa, xb, xc = (inputs(f"det/async/{i}", world, n)[rank].clone() for i in range(3))
            ha = C.all_reduce(xa, codec="int8", chunks=3, async_op=True)
            time.sleep(rng.random() * 0.01)
            hb = C.all_reduce(xb, mode="exact", chunks=2, async_op=True)
            C.all_reduce(xc, chunks=3)
            ha.wait()
            hb.wait()
            for k, v in (("async int8", xa), ("async exact", xb), ("sync after async", xc)):
                runs.setdefault(k, []).append(v)
        finally:
            undo()
    for k, v in runs.items():
        log.add("determinism", f"{k}: same bits in 3 delayed runs", all(same_bits(v[0], u) for u in v[1:]))
        if k.startswith("reduce_scatter"):  # shards differ by rank: check them against the oracle
            shards = gather(v[0])
            if rank == 0:
                ys = inputs(f"det/rs/{k.split()[-1]}", world, world * 10000)
                ref = (sim_reduce_scatter(ys, "fp32", 1.0 / world, 3, torch.float32) if k.endswith("ordered")
                       else flatcomm.exact_sum(torch.stack(ys)) * (1.0 / world))
                log.bitwise("determinism", f"{k} == oracle", torch.cat(shards), ref)
        else:
            _identical_across_ranks(log, "determinism", f"{k}: same bits on all ranks", v[0])
    # the in-flight ones are also right (not just repeatable)
    xs = inputs("det/async/2", world, n)
    if rank == 0:
        log.bitwise("determinism", "sync after async == plan", runs["sync after async"][0],
                    sim_all_reduce(xs, "fp32", 1.0 / world, 3))
        xs = inputs("det/async/1", world, n)
        log.bitwise("determinism", "async exact == exact_sum / world", runs["async exact"][0],
                    flatcomm.exact_sum(torch.stack(xs)) * (1.0 / world))


def _exact(log: _Log, rank: int, world: int) -> None:
    """Exact mode: the same bits whichever rank holds which input; equal to exact_sum."""
    perms = [list(range(world)), list(reversed(range(world)))]
    if world > 2:
        perms.append(random.Random(world).sample(range(world), world))
    for kind in ("mixed", "wide"):
        for dtype in (torch.float32, torch.bfloat16):
            n = 5003
            xs = inputs(f"exact/{kind}/{dtype}", world, n, dtype)
            if world > 1 and kind == "wide":  # heavy cancellation: rank 1 holds -x0 + tiny
                xs[1] = (-xs[0].float() + xs[1].float() * 2.0**-20).to(dtype)
            for op in ("sum", "avg"):
                scale = 1.0 if op == "sum" else 1.0 / world
                results = []
                for p in perms:
                    t = xs[p[rank]].clone()
                    C.all_reduce(t, mode="exact", op=op, chunks=2)
                    results.append(t)
                    m = 512  # a multiple of the exact block: reduce_scatter grid lines up too
                    ys = inputs(f"exact/rs/{kind}/{dtype}", world, world * m, dtype)
                    out = torch.empty(m, dtype=dtype)
                    C.reduce_scatter(out, ys[p[rank]].clone(), mode="exact", op=op, chunks=2)
                    results.append(out)
                name = f"exact {kind} {dtype} {op}"
                log.add("exact", f"{name}: all_reduce same bits under rank permutations",
                        all(same_bits(results[0], results[2 * i]) for i in range(len(perms))))
                log.add("exact", f"{name}: reduce_scatter same bits under rank permutations",
                        all(same_bits(results[1], results[2 * i + 1]) for i in range(len(perms))))
                _identical_across_ranks(log, "exact", f"{name}: same bits on all ranks", results[0])
                ref = flatcomm.exact_sum(torch.stack(xs))
                ref = (ref * scale if scale != 1.0 else ref).to(dtype)
                log.bitwise("exact", f"{name}: all_reduce == exact_sum", results[0], ref)
                shards = gather(results[1])
                if rank == 0:
                    ref = flatcomm.exact_sum(torch.stack(ys))
                    ref = (ref * scale if scale != 1.0 else ref).to(dtype)
                    log.bitwise("exact", f"{name}: reduce_scatter == exact_sum", torch.cat(shards).to(dtype), ref)


def _error_feedback(log: _Log, rank: int, world: int) -> None:
    """With ErrorFeedback the running average of int8/sign all_reduce outputs of a fixed input
    converges to the true mean like 1/steps, and sum(outputs) + residuals == steps * mean."""
    n = 2048
    # sign uses 32-value blocks: with 256 its residuals take ~1000 steps to reach their bound
    # (a transient, not a loss: the identity below holds at every step)
    for codec, steps, early in ((Codec("int8"), 100, 10), (Codec("sign", 32), 400, 100)):
        xs = inputs(f"ef/{codec.name}", world, n, kind="normal")
        mean = sum(x.double() for x in xs) / world
        ef = C.ErrorFeedback.zeros(n)
        acc = torch.zeros(n, dtype=torch.float64)
        errs = {}
        for t in range(1, steps + 1):
            y = xs[rank].clone()
            C.all_reduce(y, codec=codec, residual=ef)
            acc += y.double()
            if t in (1, early, steps):
                errs[t] = float((acc / t - mean).abs().max() / mean.abs().max())
        plain = xs[rank].clone()
        C.all_reduce(plain, codec=codec)
        e_plain = float((plain.double() - mean).abs().max() / mean.abs().max())
        t1, t2 = early, steps
        # like 1/steps: k times the steps, at least k/2 times smaller error (not a plateau)
        ok = errs[t2] < errs[t1] / (t2 / t1 / 2) and errs[t2] < e_plain / 10
        log.add("error_feedback", f"{codec.name}: time-average error shrinks like 1/steps", ok,
                f"err@1 {errs[1]:.3g} @{t1} {errs[t1]:.3g} @{t2} {errs[t2]:.3g}; without EF {e_plain:.3g}")
        # nothing lost: sum of outputs + server residuals + scale * client residuals == steps * mean
        clients = gather(ef.client)
        servers = gather(ef.server)
        if rank == 0:
            total = acc + sum(s.double() for s in servers) + sum(c.double() for c in clients) / world
            gap = float((total - steps * mean).abs().max() / (steps * mean.abs().max()))
            log.add("error_feedback", f"{codec.name}: outputs + residuals == steps x mean", gap < 1e-5, f"rel gap {gap:.3g}")


def _async(log: _Log, rank: int, world: int) -> None:
    """async_op=True returns at once (even with a late peer); wait() and the future give the
    tensor; errors surface on wait()."""
    n = 1 << 21
    x = inputs("async", world, n)
    t = x[rank].clone()
    if world > 1:
        dist.barrier()
        if rank == 1:
            time.sleep(0.5)
    t0 = time.perf_counter()
    h = C.all_reduce(t, async_op=True, chunks=4)
    call_s = time.perf_counter() - t0
    done_at_once = h.is_completed()
    got = h.wait()
    fut = h.get_future().wait()
    if rank == 0:
        log.add("async", "all_reduce call returns at once", call_s < 0.25, f"call took {call_s:.3f} s")
        if world > 1:
            log.add("async", "handle not completed right after the call (late peer)", not done_at_once)
    log.add("async", f"rank {rank}: wait() and get_future().wait() return the tensor", got is t and fut is t)
    if rank == 0:
        log.bitwise("async", "async all_reduce == plan", t, sim_all_reduce(x, "fp32", 1.0 / world, 4))
    # reduce_scatter and all_gather handles
    m = 1000
    ys = inputs("async/rs", world, world * m)
    out = torch.empty(m)
    h = C.reduce_scatter(out, ys[rank].clone(), async_op=True)
    log.add("async", f"rank {rank}: reduce_scatter handle", h.get_future().wait() is out and h.wait() is out)
    ag = torch.empty(world * m)
    h = C.all_gather(ag, ys[rank][:m].clone(), async_op=True)
    log.add("async", f"rank {rank}: all_gather handle", h.wait() is ag and h.is_completed())
    ok = torch.equal(ag.view(world, m), torch.stack([y[:m] for y in ys]))
    log.add("async", f"rank {rank}: all_gather fp32 result exact", ok)
    # a mismatch in an async call raises on wait(), on every rank, and the group stays usable
    if world > 1:
        bad = torch.zeros(100 + rank)
        h = C.all_reduce(bad, async_op=True)
        try:
            h.wait(timeout=30)
            log.add("async", f"rank {rank}: async size mismatch raises on wait", False, "no error")
        except ValueError as e:
            log.add("async", f"rank {rank}: async size mismatch raises on wait", "numel" in str(e), str(e))
        try:
            h.get_future().wait()
            log.add("async", f"rank {rank}: future carries the error", False)
        except Exception as e:  # noqa: BLE001
            log.add("async", f"rank {rank}: future carries the error", "numel" in str(e), str(e)[:200])


def _bad_input(log: _Log, rank: int, world: int) -> None:
    """Mismatched calls fail with ValueError on every rank (no hang); local misuse fails at once."""
    if world > 1:
        _expect(log, "all_reduce sizes differ", ValueError,
                lambda: C.all_reduce(torch.zeros(1000 + rank)), ("numel",))
        _expect(log, "reduce_scatter sizes differ", ValueError,
                lambda: C.reduce_scatter(torch.zeros(10 + rank), torch.zeros(world * (10 + rank))), ("numel",))
        _expect(log, "all_gather sizes differ", ValueError,
                lambda: C.all_gather(torch.zeros(world * (10 + rank)), torch.zeros(10 + rank)), ("numel",))
        _expect(log, "codec differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), codec="int8" if rank == 0 else "fp32"), ("codec",))
        _expect(log, "block size differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), codec=Codec("int8", 64 if rank == 0 else 256)),
                ("block_size",))
        _expect(log, "mode differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), mode="exact" if rank == 0 else "ordered"), ("mode",))
        _expect(log, "mode differs (reduce_scatter)", ValueError,
                lambda: C.reduce_scatter(torch.zeros(256), torch.zeros(world * 256),
                                         mode="exact" if rank == 0 else "ordered"), ("mode",))
        _expect(log, "op differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), op="avg" if rank == 0 else "sum"), ("op",))
        _expect(log, "dtype differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000, dtype=torch.float32 if rank == 0 else torch.bfloat16)),
                ("dtype",))
        _expect(log, "chunks differ", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), chunks=1 + rank), ("chunks",))
        _expect(log, "exact block differs", ValueError,
                lambda: C.all_reduce(torch.zeros(1000), mode="exact", exact_block=128 if rank == 0 else 256),
                ("exact_block",))
    for dt in (torch.int32, torch.float64):
        _expect(log, f"all_reduce {dt}", TypeError, lambda: C.all_reduce(torch.zeros(100, dtype=dt)))
        _expect(log, f"reduce_scatter {dt}", TypeError,
                lambda: C.reduce_scatter(torch.zeros(10, dtype=dt), torch.zeros(10 * world, dtype=dt)))
        _expect(log, f"all_gather {dt}", TypeError,
                lambda: C.all_gather(torch.zeros(10 * world, dtype=dt), torch.zeros(10, dtype=dt)))
    _expect(log, "reduce_scatter input/output size mismatch", ValueError,
            lambda: C.reduce_scatter(torch.zeros(10), torch.zeros(10 * world + 1)))
    _expect(log, "all_gather input/output size mismatch", ValueError,
            lambda: C.all_gather(torch.zeros(10 * world + 1), torch.zeros(10)))
    for codec in ("bf16", "int8", "sign", "topk"):
        _expect(log, f"exact mode with {codec}", ValueError,
                lambda: C.all_reduce(torch.zeros(100), codec=codec, mode="exact"), ("exact",))
    _expect(log, "unknown op", ValueError, lambda: C.all_reduce(torch.zeros(100), op="max"))
    _expect(log, "unknown mode", ValueError, lambda: C.all_reduce(torch.zeros(100), mode="fast"))
    _expect(log, "residual of the wrong size", ValueError,
            lambda: C.all_reduce(torch.zeros(100), codec="int8", residual=C.ErrorFeedback.zeros(99)))
    # the group is still in step after all of that
    t = torch.full((1000,), float(rank + 1))
    C.all_reduce(t, op="sum")
    log.add("bad_input", f"rank {rank}: group usable afterwards", bool((t == world * (world + 1) / 2).all()))


_SECTIONS = {
    "accuracy": _accuracy, "chunks": _chunks, "determinism": _determinism, "exact": _exact,
    "error_feedback": _error_feedback, "async": _async, "bad_input": _bad_input,
}


def _rank_main(rank: int, world: int) -> Checks:
    log = _Log(rank)
    # One rank compresses nothing (tests/test_checkpoint.py checks that). These sections check the
    # codec path itself, so at world size 1 they run it through a real exchange (the test hook).
    groups.EXCHANGE_ALONE = world == 1
    for section, fn in _SECTIONS.items():
        t0 = time.perf_counter()
        fn(log, rank, world)  # an exception on one rank fails the whole run (spawn re-raises it)
        log.add(section, "__time__", True, f"{time.perf_counter() - t0:.2f}")
    return log.checks


# ---- pytest side ----------------------------------------------------------------------------------------

_RESULTS: Dict[int, Checks] = {}


def _results(world: int) -> Checks:
    if world not in _RESULTS:
        try:
            per_rank = spawn.run(world, _rank_main, timeout_s=90.0)
        except Exception as e:  # noqa: BLE001 - keep the failure, report it in every item
            _RESULTS[world] = [(s, "spawn", False, str(e)[-3000:]) for s in SECTIONS]
        else:
            _RESULTS[world] = [c for checks in per_rank for c in checks]
    return _RESULTS[world]


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.slow) if w == 4 else w for w in WORLDS])
def test_collectives(world: int, section: str) -> None:
    checks = [c for c in _results(world) if c[0] == section and c[1] != "__time__"]
    assert checks, f"no checks ran for {section} on {world} ranks"
    failed = [f"{name}: {msg}" for _, name, ok, msg in checks if not ok]
    assert not failed, f"{len(failed)} of {len(checks)} checks failed on {world} ranks:\n" + "\n".join(failed[:30])


def _two_rank_sums(rank: int, world: int, n: int, op: str, chunks) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + rank)
    x = torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-38, 38, (1,), generator=g))
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40, 3.4e38, -3.4e38])
    x[torch.randint(0, n, (len(specials),), generator=g)] = specials
    nans = torch.tensor([0x7fc00001 + rank, -0x400000 + rank, 0x7f800002], dtype=torch.int32)
    x[:3].view(torch.int32)[:] = nans  # NaN payloads in both ranks' shards: the add's operand order shows
    x[-3:].view(torch.int32)[:] = nans
    t = x.clone()
    C.all_reduce(t, op=op, chunks=chunks)
    return x, t


@pytest.mark.parametrize("op,chunks", [("sum", None), ("avg", 3)])
def test_two_rank_fp32_p2p_sum_has_the_kernels_bits(op, chunks):
    """The unstaged point-to-point all-reduce of two fp32 ranks gives the fused kernel's fixed-order
    sum of the two rows, bit for bit: NaN payloads (row 0's wins, in both ranks' shards), infinities,
    signed zeros and subnormals. torch's add would not do: it keeps the second operand's NaN payload
    in its vector loop. 1.5M values: past the gathered small path, and every piece a 16-byte
    multiple, so the unstaged path runs (an odd size stages)."""
    n = 1_500_000
    (x0, t0), (x1, t1) = spawn.run(2, _two_rank_sums, n, op, chunks)
    c = flatcomm.resolve("fp32")
    want = decode_sum(torch.stack([encode(x0, c), encode(x1, c)]), c, n, scale=0.5 if op == "avg" else 1.0)
    for t in (t0, t1):
        assert torch.equal(t.view(torch.int32), want.view(torch.int32))
