"""The :class:`ExactGradAccumulator` and its :class:`StepStats` (how and why: :mod:`flatcomm.reproducible`)."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._bytes import tensor_bytes
from ..comm.header import check_consistent
from .layout import GRAD_DTYPES, layout, trainable
from ..ops.sums import (
    DEFAULT_EXACT_BLOCK,
    DEFAULT_HEADROOM,
    NONFINITE_EXPONENT,
    ZERO_EXPONENT,
    exact_exponents,
    from_exact,
    to_exact,
)

# Every finite fp32 value is below 2^128: an exponent above it would only waste grid bits.
MAX_EXPONENT = 128
_ON_NONFINITE = ("skip", "raise", "nan")
TO_EXACT_CHUNK = 1 << 20  # about this many values per to_exact call (rounded to whole blocks)

__all__ = ["ExactGradAccumulator", "StepStats"]


@dataclasses.dataclass
class StepStats:
    """What the last step did (the same on every rank, except the timings and local counts)."""

    step: int = -1                 # index of the step (0-based, counts skipped steps too)
    applied: bool = False          # the grads hold the reduced mean; False: nonfinite, skipped
    replays: int = 0               # extra passes over the micro-batches (exponents had to grow)
    grown_blocks: int = 0          # blocks whose exponent had to grow this step
    nonfinite: List[str] = dataclasses.field(default_factory=list)  # params with inf/NaN grads
    digest: str = ""               # sha256 of the reduced gradient bits (or of the skip)
    local_micro_batches: int = 0   # micro-batches this rank ran (replays included)
    compute_s: float = 0.0         # time in the loop body (forward + backward)
    accumulate_s: float = 0.0      # exponents + to_exact + integer adds
    reduce_s: float = 0.0          # collectives, from_exact, digest
    wire_bytes: int = 0            # bytes this rank put into collectives (payload, not protocol)


def _check_replayed(g: torch.Tensor, first_g: Optional[torch.Tensor], step: int) -> None:
    """A replayed pass must reach the exponents of the first: the same weights and micro-batches."""
    if first_g is not None and not torch.equal(g, first_g):
        raise RuntimeError(
            f"flatcomm.reproducible: step {step}: the micro-batch gradients changed when "
            "the step was replayed (same weights, same micro-batches): the loop body is not "
            "deterministic. Call flatcomm.reproducible.configure(), keep randomness inside the "
            "body seeded (seed=...), and keep side effects out of the body.")


def _check_arguments(micro_batches: int, margin: int, span: int, on_nonfinite: str, headroom: int) -> None:
    if on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"flatcomm.reproducible: on_nonfinite must be one of {_ON_NONFINITE}, "
                         f"got {on_nonfinite!r}")
    if margin < 0 or span < 0:
        raise ValueError(f"flatcomm.reproducible: margin and span must be >= 0, got {margin}, {span}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"flatcomm.reproducible: micro_batches must be a positive int, got {micro_batches!r}")
    if micro_batches > (1 << headroom):
        raise ValueError(f"flatcomm.reproducible: {micro_batches} micro-batches exceed the 2^{headroom} "
                         f"contributions that int64 fixed point with headroom {headroom} can add")


class ExactGradAccumulator:
    """Exact, rank-count independent gradient accumulation over a fixed set of micro-batches.

    ``model``: an ``nn.Module`` (not wrapped in DDP) or an iterable of parameters (or of
    ``(name, parameter)`` pairs); parameters without ``requires_grad`` are ignored.
    ``micro_batches``: micro-batches per step M, a multiple of the world size and at most
    ``2^headroom``. ``group``: the process group (default: the world; without an initialised
    process group the accumulator runs as a single rank). ``margin`` / ``span``: exponent
    prediction, see the module docstring. ``on_nonfinite``: ``"skip"`` (grads ``None``),
    ``"raise"`` or ``"nan"``. ``seed``: per-micro-batch RNG seed base (``None``: leave the RNG
    alone). ``digest``: compute :attr:`StepStats.digest` (sha256 of the gradient bytes).
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Iterable],
        micro_batches: int,
        *,
        group=None,
        margin: int = 4,
        span: int = 0,
        on_nonfinite: str = "skip",
        seed: Optional[int] = 0,
        digest: bool = True,
        block_size: int = DEFAULT_EXACT_BLOCK,
        headroom: int = DEFAULT_HEADROOM,
    ):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError("flatcomm.reproducible: pass the plain module, not a DistributedDataParallel "
                            "wrapper (its all-reduce would average rank-dependent fp32 sums)")
        named = trainable(model)
        if not named:
            raise ValueError("flatcomm.reproducible: no parameter requires a gradient")
        _check_arguments(micro_batches, margin, span, on_nonfinite, headroom)
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        if micro_batches % self.world:
            raise ValueError(
                f"flatcomm.reproducible: micro_batches ({micro_batches}) must be a multiple of the world "
                f"size ({self.world}) so that every rank gets the same number of micro-batches; "
                f"use e.g. {self._suggest(micro_batches, self.world)}")
        self.micro_batches_per_step = micro_batches
        self.margin, self.span = margin, span
        self.on_nonfinite, self.seed, self.digest = on_nonfinite, seed, digest
        self.block, self.headroom = block_size, headroom
        self._chunk = max(1, TO_EXACT_CHUNK // block_size) * block_size

        self._build(named, block_size)
        self.step_count = 0
        self.stats = StepStats()
        self._active: Optional[object] = None
        self._check_consistent()

    # ---- construction helpers -------------------------------------------------------------------

    def _build(self, named: List[Tuple[str, torch.nn.Parameter]], block_size: int) -> None:
        """The flat layout of the parameters and the accumulation buffers (one device, float dtypes)."""
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"flatcomm.reproducible: parameters on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        bad = sorted({str(p.dtype) for _, p in named if p.dtype not in GRAD_DTYPES})
        if bad:
            raise TypeError(f"flatcomm.reproducible: parameter dtypes must be float32, bfloat16 or float16, got {bad}")
        self.names = [n for n, _ in named]
        self._groups, block_param = layout(named, block_size, self.device)
        start = sum(g.flat.numel() for g in self._groups)
        self.numel = start                      # padded
        nblocks = start // block_size
        self._block_param = torch.tensor(block_param, dtype=torch.int64, device=self.device)
        self._exponents = torch.full((nblocks,), ZERO_EXPONENT, dtype=torch.int32, device=self.device)
        self._gmax = torch.empty(nblocks, dtype=torch.int32, device=self.device)
        self._acc = torch.zeros(start, dtype=torch.int64, device=self.device)
        self._views = [[g.flat[o:o + p.numel()].view_as(p) for p, o in zip(g.params, g.offsets)]
                       for g in self._groups]

    @staticmethod
    def _suggest(m: int, w: int) -> str:
        lo = (m // w) * w
        return " or ".join(str(v) for v in (lo, lo + w) if v > 0)

    def _check_consistent(self) -> None:
        if self.world == 1:
            return
        # one tiny all-gather, clear error on mismatch
        check_consistent(self.group, [
            ("parameter numel (padded)", self.numel), ("micro_batches", self.micro_batches_per_step),
            ("margin", self.margin), ("span", self.span), ("block_size", self.block),
            ("headroom", self.headroom), ("on_nonfinite", _ON_NONFINITE.index(self.on_nonfinite)),
            ("seed (mod 2^62)", -1 if self.seed is None else self.seed % (1 << 62)),
            ("step", self.step_count),
        ], self.device)

    # ---- the step -------------------------------------------------------------------------------

    @property
    def local_indices(self) -> List[int]:
        """The micro-batches this rank runs each step: rank, rank + W, ..."""
        return list(range(self.rank, self.micro_batches_per_step, self.world))

    def micro_batches(self) -> Iterator[int]:
        """One training step: yields this rank's micro-batch indices (in [0, M)); run forward and
        ``backward()`` for micro-batch i in the loop body. When the loop ends, every parameter's
        ``.grad`` holds the exact mean gradient over all M micro-batches (same bits on every rank
        and every rank count) and :attr:`stats` describes the step. On a replay step (the first
        step, and steps whose gradient outgrew the exponents) the body runs twice for each index:
        keep side effects other than ``backward()`` idempotent (record losses by index, not by
        appending). Leaving the loop early (break, exception) clears the grads.
        """
        stats = StepStats(step=self.step_count)
        self.stats = stats
        token = object()
        self._active = token      # an abandoned earlier loop must not touch this step's grads
        decided = False
        first_g: Optional[torch.Tensor] = None
        try:
            while True:
                yield from self._one_pass(stats)
                t0 = time.perf_counter()
                g = self._reduce(stats)
                _check_replayed(g, first_g, stats.step)
                nonfinite = g == NONFINITE_EXPONENT
                if bool(nonfinite.any()):
                    decided = True
                    self._nonfinite(g, nonfinite, stats)   # may raise (on_nonfinite="raise")
                    stats.reduce_s += time.perf_counter() - t0
                    break
                grow = g > self._exponents
                if bool(grow.any()):
                    stats.grown_blocks = max(stats.grown_blocks, int(grow.sum()))
                    torch.maximum(self._exponents, g, out=self._exponents)
                    first_g = g
                    stats.replays += 1
                    stats.reduce_s += time.perf_counter() - t0
                    continue
                decided = True
                self._finish(g, stats)
                stats.reduce_s += time.perf_counter() - t0
                break
        finally:
            if self._active is token:
                self._active = None
                if decided:
                    self.step_count += 1
                else:  # left early: no reduction happened, the grads are one micro-batch's
                    self._clear_grads()

    # ---- pieces of the step -----------------------------------------------------------------------

    def _one_pass(self, stats: StepStats) -> Iterator[int]:
        """One pass over this rank's micro-batches (yielded to the loop body), each accumulated."""
        self._acc.zero_()
        self._gmax.fill_(ZERO_EXPONENT)
        local_overflow = False
        for i in self.local_indices:
            self._bind_zeroed_grads()
            t0 = time.perf_counter()
            if self.seed is None:
                yield i
            else:
                with self._seeded(i):
                    yield i
            t1 = time.perf_counter()
            local_overflow = self._accumulate(local_overflow)
            stats.compute_s += t1 - t0
            stats.accumulate_s += time.perf_counter() - t1
            stats.local_micro_batches += 1

    def _reduce(self, stats: StepStats) -> torch.Tensor:
        """The exponents' MAX over ranks (returned); the integer SUM goes out with it (one round
        trip instead of two; on the rare steps that replay or skip, its result is simply not used)."""
        g = self._gmax.clone()
        sum_work = self._all_reduce(self._acc, dist.ReduceOp.SUM, stats, async_op=True)
        self._wait(self._all_reduce(g, dist.ReduceOp.MAX, stats, async_op=True))
        self._wait(sum_work)
        return g

    def _bind_zeroed_grads(self) -> None:
        for g, views in zip(self._groups, self._views):
            g.flat.zero_()
            for p, v in zip(g.params, views):
                # backward() adds into an existing grad in place (0 + g == g), so it lands in flat.
                p.grad = v

    def _clear_grads(self) -> None:
        for g in self._groups:
            for p in g.params:
                p.grad = None

    @contextlib.contextmanager
    def _seeded(self, i: int):
        # Seeds the CPU generator (and the parameters' CUDA device's) directly: torch.manual_seed
        # would also queue a lazy seeding of every CUDA device, recording a stack trace each call.
        s = hashlib.blake2b(f"{self.seed}/{self.step_count}/{i}".encode(), digest_size=8).digest()
        seed = int.from_bytes(s, "little") >> 1
        gens = [torch.default_generator]
        if self.device.type == "cuda":
            gens.append(torch.cuda.default_generators[self.device.index or 0])
        states = [g.get_state() for g in gens]
        try:
            for g in gens:
                g.manual_seed(seed)
            yield
        finally:
            for g, st in zip(gens, states):
                g.set_state(st)

    def _accumulate(self, overflow: bool) -> bool:
        """Adds the current grads (one micro-batch) into the int64 accumulator, unless some block
        exceeds its exponent here or did earlier this pass; always keeps the running block max."""
        for g, views in zip(self._groups, self._views):
            for p, v in zip(g.params, views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():  # backward replaced it (e.g. a hook, or set_to_none in the body)
                    if p.grad is None:
                        v.zero_()
                    else:
                        v.copy_(p.grad)
                    p.grad = v
        for g in self._groups:
            b0, b1 = g.start // self.block, (g.start + g.flat.numel()) // self.block
            e = exact_exponents(g.flat, self.block)
            gm = self._gmax[b0:b1]
            torch.maximum(gm, e, out=gm)
            if overflow:
                continue
            ex = self._exponents[b0:b1]
            if bool((e > ex).any()):
                overflow = True  # this pass will be replayed: stop converting
                continue
            # In chunks: the transient int64 image stays small (TO_EXACT_CHUNK values) for any model.
            for a in range(0, g.flat.numel(), self._chunk):
                b = min(g.flat.numel(), a + self._chunk)
                self._acc[g.start + a:g.start + b] += to_exact(
                    g.flat[a:b], ex[a // self.block:b // self.block], self.block, self.headroom)
        return overflow

    def _all_reduce(self, t: torch.Tensor, op, stats: StepStats, async_op: bool = False):
        if self.world == 1:
            return None
        stats.wire_bytes += t.numel() * t.element_size()
        return dist.all_reduce(t, op, group=self.group, async_op=async_op)

    @staticmethod
    def _wait(work) -> None:
        if work is not None:
            work.wait()

    def _finish(self, g: torch.Tensor, stats: StepStats) -> None:
        h = hashlib.sha256() if self.digest else None
        for grp, views in zip(self._groups, self._views):
            b0, b1 = grp.start // self.block, (grp.start + grp.flat.numel()) // self.block
            total = from_exact(self._acc[grp.start:grp.start + grp.flat.numel()],
                               self._exponents[b0:b1], self.block, self.headroom)
            mean = total / self.micro_batches_per_step      # fp32, once
            grp.flat.copy_(mean)                            # parameter dtype, once
            for p, v in zip(grp.params, views):
                p.grad = v
            if h is not None:
                h.update(tensor_bytes(grp.flat))
        stats.applied = True
        stats.digest = h.hexdigest() if h is not None else ""
        self._predict(g)

    def _predict(self, g: torch.Tensor) -> None:
        """Exponents for the next step from this step's agreed block maxima."""
        per_param = torch.full((len(self.names),), ZERO_EXPONENT, dtype=torch.int32, device=g.device)
        per_param.scatter_reduce_(0, self._block_param, g, "amax")
        floor = per_param[self._block_param] - self.span
        nxt = torch.maximum(g, floor) + self.margin
        self._exponents = nxt.clamp_(ZERO_EXPONENT, MAX_EXPONENT).to(torch.int32)

    def _nonfinite(self, g: torch.Tensor, nonfinite: torch.Tensor, stats: StepStats) -> None:
        params = sorted(set(self._block_param[nonfinite].tolist()))
        stats.nonfinite = [self.names[i] for i in params]
        stats.applied = False
        stats.digest = hashlib.sha256(b"nonfinite:" + tensor_bytes(g)).hexdigest()
        # The exponents of the finite blocks are still a fine prediction; nonfinite ones keep theirs.
        if self.on_nonfinite == "raise":
            self._clear_grads()
            shown = ", ".join(stats.nonfinite[:8]) + (" ..." if len(stats.nonfinite) > 8 else "")
            raise FloatingPointError(
                f"flatcomm.reproducible: step {stats.step}: non-finite gradient (inf/NaN) in {len(params)} "
                f"parameter(s): {shown}; every rank raises this at the same step")
        if self.on_nonfinite == "nan":
            for grp, views in zip(self._groups, self._views):
                grp.flat.fill_(float("nan"))
                for p, v in zip(grp.params, views):
                    p.grad = v
        else:
            self._clear_grads()

    # ---- state ------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, object]:
        """The exponent prediction and the step counter (the same on every rank, for any world
        size). Save it with the checkpoint: a run resumed without it would choose other exponents
        (and other per-micro-batch seeds) for the next step than the uninterrupted run."""
        return {"exponents": self._exponents.cpu().clone(), "step": self.step_count,
                "numel": self.numel, "block_size": self.block, "headroom": self.headroom}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if (state["numel"], state["block_size"], state["headroom"]) != (self.numel, self.block, self.headroom):
            raise ValueError(
                "flatcomm.reproducible: state_dict is for numel/block_size/headroom "
                f"{(state['numel'], state['block_size'], state['headroom'])}, this accumulator has "
                f"{(self.numel, self.block, self.headroom)}")
        self._exponents = state["exponents"].to(device=self.device, dtype=torch.int32).clone()
        self.step_count = int(state["step"])

    # ---- accounting -------------------------------------------------------------------------------

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this accumulator holds: the grad storage (the parameters' ``.grad`` are views of
        it, so it replaces the usual grads), the int64 accumulator (the real overhead: 8 bytes per
        value), exponents and index tables, and the transient ``to_exact`` result (one chunk)."""
        return {
            "grad_flat": sum(g.flat.numel() * g.flat.element_size() for g in self._groups),
            "int64_accumulator": self._acc.numel() * 8,
            "exponents": 3 * self._exponents.numel() * 4 + self._block_param.numel() * 8,
            "to_exact_transient": min(self._chunk, max(g.flat.numel() for g in self._groups)) * 8,
            "parameters": sum(p.numel() * p.element_size() for g in self._groups for p in g.params),
        }
