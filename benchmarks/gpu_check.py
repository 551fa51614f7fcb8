"""GPU check of flatcomm: CUDA results bitwise equal to the CPU kernels, plus CUDA throughput.

Correctness: every op of torch.ops.flatcomm (encode, encode_into, decode, decode_into, decode_sum,
decode_sum_into, decode_sum_encode, decode_sum_encode_into, ordered_sum, exact_exponents, to_exact,
from_exact, exact_sum), called through the public API (flatcomm.encode / decode / decode_sum and
flatcomm.sums), for every codec, input dtype, decode output dtype, block size and size of the sweep,
on fresh random inputs (seed printed) with an all-zero block, subnormal and near-max blocks, and
inf / NaN blocks. The same inputs run on the CPU (the reference) and on the device; payloads,
residuals, decoded values and sums must match BIT FOR BIT (stochastic rounding included: the RNG is
counter-based). Device outputs of the *_into variants are poisoned first (all bytes 0xFF, a NaN for
floats) so an element the kernel forgets to write shows; functional outputs get the same poison
through the caching allocator (a poisoned block of the output's size is freed just before the call,
best effort). About a third of the cases use device tensors at a 4-byte (uint8 payloads) or
one-element offset, so the kernels' non-vectorised paths run too.

Timing (CUDA events, warm-up, median of --reps): Tensor.copy_ as the bandwidth baseline, then each
op and codec at 16M and 64M fp32 elements, with the bytes the op must move, GB/s and the ratio to
copy_. Target: fused int8 encode + error feedback at 64M >= 0.8x copy_. Bytes per fp32 element:
copy_ 8; encode+EF 12 (x, residual in and out) + payload; encode 4 + payload; decode payload + 4;
decode_sum W payloads + 4; decode_sum_encode+EF W payloads + 8 + payload; ordered_sum / exact_sum
4 W + 4; exact_exponents 4 W; to_exact 4 + 8; from_exact 8 + 4 (+ exponents).

    python3 benchmarks/gpu_check.py                     # full check + timing (CUDA), ~1-2 min on an H200
    python3 benchmarks/gpu_check.py --json out.json
    python3 benchmarks/gpu_check.py --sanitize          # tiny sizes, every op once (compute-sanitizer)
    python3 benchmarks/gpu_check.py --cupy              # the cupy / NVRTC path vs CPU and compiled kernels
    python3 benchmarks/gpu_check.py --collectives       # collectives over NCCL (world size 1) vs gloo on CPU
    python3 benchmarks/gpu_check.py --self-test         # CPU vs CPU, small sizes: tests this script
    python3 benchmarks/gpu_check.py --device cpu        # CPU vs CPU, the full sweep

cupy / NVRTC (--cupy; the self-test runs it CPU against CPU): the kernels of flatcomm/cupy_backend.py,
compiled at run time, registered over the compiled CUDA kernels for a short sweep against the CPU,
then compared directly with the compiled kernels (encode + EF and decode, every codec), and the int8
encode + EF timed on both. On a build without CUDA kernels where flatcomm uses the NVRTC path, the
plain full check tests that path against the CPU.

Collectives (--collectives; the self-test runs it with gloo on CPU): flatcomm.collectives on CUDA
tensors over a world-size-1 NCCL group vs the same calls on CPU tensors over gloo, bitwise: all_reduce
fp32 / int8 / sign with error feedback at 1 and 3 chunks, fp32 (zero-copy, staged, exact mode),
reduce_scatter fp32 / int8, all_gather int8, results of async_op=True consumed on another stream after
get_future().wait() / Handle.wait(), inputs written behind a busy caller stream, and three DDP steps
with flatcomm.ddp.register(model, "int8"); each also with the exchange forced through NCCL.

Exit status: 0 all equal, 1 failures (or interrupted), 2 no CUDA device / flatcomm built without CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

fc = None  # flatcomm, imported in main() so this file imports without a built extension

OPS = ("encode", "encode_into", "decode", "decode_into", "decode_sum", "decode_sum_into",
       "decode_sum_encode", "decode_sum_encode_into", "ordered_sum", "exact_exponents", "to_exact",
       "from_exact", "exact_sum")
CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "sign", "topk")
BLOCKWISE = ("int8", "int4", "sign")
STOCHASTIC = ("int8", "int4", "bf16")
REENCODE = ("fp32", "bf16", "fp16", "int8", "int4", "sign")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DT_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
HEADROOM = 12  # flatcomm.sums.DEFAULT_HEADROOM (checked in main)
MAX_PRINTED_FAILURES = 60


@dataclasses.dataclass
class Config:
    sizes: Tuple[int, ...]
    blocks: Tuple[int, ...]          # codec blocks (int8 / int4 / sign, and reencode)
    exact_blocks: Tuple[int, ...]    # exact_* blocks (any 1..4096)
    dtypes: Tuple[torch.dtype, ...]
    topk_ratios: Tuple[float, ...]
    variants: Tuple[str, ...]        # input kinds, see make_x
    big_n: int                       # from this size on: only the "nonfinite" variant, fewer combos
    full_reencode_max_n: int         # decode_sum_encode: every reencode codec up to this size
    timing_sizes: Tuple[int, ...]
    reps: int


FULL = Config(sizes=(1, 31, 97, 4099, 65537, (1 << 20) + 3), blocks=(32, 256, 4096),
              exact_blocks=(7, 32, 256, 4096), dtypes=DTYPES, topk_ratios=(0.01, 0.3),
              variants=("mixed", "edge", "nonfinite"), big_n=1 << 20, full_reencode_max_n=4099,
              timing_sizes=(1 << 24, 1 << 26), reps=20)
SANITIZE = Config(sizes=(1, 97, 4099), blocks=(32, 4096), exact_blocks=(7, 256), dtypes=DTYPES,
                  topk_ratios=(0.3,), variants=("nonfinite",), big_n=1 << 62, full_reencode_max_n=0,
                  timing_sizes=(), reps=0)
SELF_TEST = Config(sizes=(1, 31, 97, 4099), blocks=(32, 256, 4096), exact_blocks=(7, 32, 256, 4096),
                   dtypes=DTYPES, topk_ratios=(0.01, 0.3), variants=("mixed", "edge", "nonfinite"),
                   big_n=4099, full_reencode_max_n=97, timing_sizes=(1 << 14,), reps=2)


class Interrupted(Exception):
    pass


class ContextBroken(Exception):
    """The CUDA context raised a sticky error (illegal address, device assert): nothing after runs."""


# ---------------------------------------------------------------------------------------------------
# Inputs


def _finfo(dtype):
    fi = torch.finfo(dtype)
    mant = round(-math.log2(fi.eps))  # 23 / 7 / 10 stored mantissa bits
    return float(fi.max), float(fi.tiny), float(fi.tiny) * float(fi.eps), mant


EDGE_KINDS = ("zero", "sub", "max", "single", "mixed_scale")
NONFINITE_KINDS = EDGE_KINDS + ("inf", "nan", "ninf")


def _special(kind: str, seg: torch.Tensor, dtype, g: torch.Generator) -> None:
    """Overwrite seg (float64, a block or a few elements) with one kind of special values."""
    m = seg.numel()
    if m == 0:
        return
    big, tiny, sub_min, mant = _finfo(dtype)
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    pos = int(torch.randint(0, m, (1,), generator=g))
    if kind == "zero":  # all zero, some -0.0
        seg.copy_(0.0 * sign)
    elif kind == "sub":  # subnormals of the dtype only
        k = torch.randint(1, 1 << mant, (m,), generator=g).double()
        seg.copy_(sign * k * sub_min)
        seg[pos] = sub_min
    elif kind == "max":  # magnitudes in [max/4, max], the max itself included
        seg.copy_(sign * big * (0.25 + 0.75 * torch.rand(m, generator=g).double()))
        seg[pos] = -big if m > 1 else big
    elif kind == "single":  # one value, rest +0
        seg.zero_()
        seg[pos] = float(sign[0]) * 1.5
    elif kind == "mixed_scale":  # one huge value with tiny ones
        seg.copy_(sign * tiny * torch.rand(m, generator=g).double())
        seg[pos] = big / 2
    elif kind == "inf":
        seg[pos] = math.inf
    elif kind == "ninf":
        seg[pos] = -math.inf
    elif kind == "nan":
        seg[pos] = math.nan
    else:
        raise ValueError(kind)


def make_x(g: torch.Generator, n: int, dtype, variant: str, block: int, rows: int = 0) -> torch.Tensor:
    """Random inputs ([n], or [rows, n] if rows) in dtype.

    mixed: gaussian times 2^[-12, 12], 5% zeros, a few magnitude ties (topk tie-break, clamps).
    edge: mixed plus blocks (of `block` elements) that are all zero, subnormal, near the dtype's max,
    a single value, one huge among tiny ones. nonfinite: edge plus blocks with +inf, -inf, NaN.
    When there are fewer blocks than kinds, the kinds go to a few random elements instead.
    """
    if rows:
        return torch.stack([make_x(g, n, dtype, variant, block) for _ in range(rows)])
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 13, (n,), generator=g).float())
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    if n >= 8:
        i = torch.randint(0, n, (4,), generator=g)
        x[i] = x[i[0]].abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])
    x = x.to(dtype).double()
    if variant != "mixed":
        kinds = EDGE_KINDS if variant == "edge" else NONFINITE_KINDS
        nb = -(-n // block)
        if nb > len(kinds):  # block 0 stays random; the kinds go to blocks in a random order
            order = torch.randperm(nb - 1, generator=g)[: len(kinds)] + 1
            for kind, b in zip(kinds, order.tolist()):
                _special(kind, x[b * block: (b + 1) * block], dtype, g)
        else:
            for kind in kinds:
                i = int(torch.randint(0, n, (1,), generator=g))
                _special(kind, x[i: i + max(1, min(8, n // 8))], dtype, g)
    return x.to(dtype)


def make_residual(g: torch.Generator, n: int, variant: str, block: int) -> torch.Tensor:
    """fp32 residual: small values; for "nonfinite" also a block near the fp32 max (v may overflow)
    and one NaN (the non-finite rule keeps a block's residual as it was)."""
    r = torch.randn(n, generator=g) * 0.01 * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    if variant == "nonfinite" and n >= 2:
        nb = -(-n // block)
        b = int(torch.randint(0, nb, (1,), generator=g))
        seg = r[b * block: min(n, (b + 1) * block)]
        seg[: max(1, seg.numel() // 2)] = 3.0e38
        r[int(torch.randint(0, n, (1,), generator=g))] = math.nan
    return r


# ---------------------------------------------------------------------------------------------------
# Comparison


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    if t.is_floating_point():
        return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])
    return t


# The one exception to bitwise equality (csrc/cuda/README.md): which NaN. A GPU writes the canonical
# NaN 0x7fffffff for every NaN that arithmetic produces; x86 keeps an operand's sign and payload.
# Where NaNs are is still compared exactly; so are the payload bytes that are not values (block
# scales, whose NaN is a stored constant, codes and topk indices).
_CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _both_nan(ref: torch.Tensor, got: torch.Tensor, layout: Optional[Tuple[int, str, int, int]]) -> torch.Tensor:
    """Flat mask over the elements of ref: True where ref and got are both NaN (as values)."""
    if ref.is_floating_point():
        return (torch.isnan(ref) & torch.isnan(got)).reshape(-1)
    mask = torch.zeros(ref.numel(), dtype=torch.bool)
    if ref.dtype != torch.uint8 or layout is None:
        return mask
    n, codec, _, k = layout
    if codec in _CAST_DTYPES:
        dt, start, count = _CAST_DTYPES[codec], 0, n
    elif codec == "topk":
        dt, start, count = torch.float32, -(-4 * k // 16) * 16, k
    else:
        return mask
    size = torch.empty(0, dtype=dt).element_size()
    end = start + count * size
    ra = ref.reshape(-1)[start:end].contiguous().view(dt)
    ga = got.reshape(-1)[start:end].contiguous().view(dt)
    mask[start:end] = (torch.isnan(ra) & torch.isnan(ga)).repeat_interleave(size)
    return mask


def _fmt(t: torch.Tensor, i: int) -> str:
    v = t.reshape(-1)[i]
    if t.dtype == torch.uint8:
        return f"0x{int(v):02x}"
    if t.is_floating_point():
        b = bits(v.reshape(1)).item() & ((1 << (8 * t.element_size())) - 1)
        return f"{v.item()!r} (0x{b:0{2 * t.element_size()}x})"
    return repr(v.item())


def _region(n: int, codec: Optional[str], block: int, k: int, byte: int) -> str:
    """Which part of a payload a byte is in (header = scales / topk indices)."""
    if codec is None:
        return ""
    if codec in ("fp32", "bf16", "fp16"):
        data_end = n * (4 if codec == "fp32" else 2)
        return " (values)" if byte < data_end else " (padding)"
    if codec == "topk":
        off = -(-4 * k // 16) * 16
        return " (indices)" if byte < 4 * k else " (padding)" if byte < off else \
            " (values)" if byte < off + 4 * k else " (padding)"
    nb = -(-n // block)
    off = -(-4 * nb // 16) * 16
    bits_per = {"int8": 8, "int4": 4, "sign": 1}[codec]
    if byte < 4 * nb:
        return f" (scale of block {byte // 4})"
    if byte < off:
        return " (header padding)"
    if byte < off + -(-n * bits_per // 8):
        elem = (byte - off) * 8 // bits_per
        return f" (codes, element {elem}, block {elem // block})"
    return " (padding)"


class Checker:
    def __init__(self, device: torch.device, max_seconds: float, verbose: bool, quiet: bool = False) -> None:
        self.dev = device
        self.quiet = quiet
        self.cuda = device.type == "cuda"
        # without the caching allocator (compute-sanitizer runs) freed poison is not reused
        self.caching = self.cuda and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0")
        self.deadline = time.monotonic() + max_seconds
        self.verbose = verbose
        self.passed: Dict[str, int] = {op: 0 for op in OPS}
        self.failed: Dict[str, int] = {op: 0 for op in OPS}
        self.failures: List[dict] = []
        self.cases = 0
        self.skipped_cases = 0
        self.broken: Optional[str] = None
        self.stage = ("", "")  # (op, note) of the call in progress: an exception is charged to it

    def at(self, op: str, note: str = "") -> None:
        self.stage = (op, note)

    # -- device tensors ---------------------------------------------------------------------------
    def to_dev(self, t: Optional[torch.Tensor], misalign: bool = False) -> Optional[torch.Tensor]:
        """A fresh device copy of t; with misalign, at a 4-byte (uint8) or 1-element offset into a
        larger buffer, so the pointer is not 16-byte aligned."""
        if t is None:
            return None
        if not misalign:
            return t.to(self.dev, copy=True)
        v = self.empty(tuple(t.shape), t.dtype, True)
        v.copy_(t)
        return v

    def empty(self, shape, dtype, misalign: bool = False) -> torch.Tensor:
        if isinstance(shape, int):
            shape = (shape,)
        numel = math.prod(shape)
        if not misalign:
            return torch.empty(shape, dtype=dtype, device=self.dev)
        off = 4 if dtype == torch.uint8 else 1
        buf = torch.empty(numel + off, dtype=dtype, device=self.dev)
        return buf[off:].view(shape)

    def poisoned(self, shape, dtype, misalign: bool = False) -> torch.Tensor:
        t = self.empty(shape, dtype, misalign)
        t.view(torch.uint8).fill_(0xFF)
        return t

    def prepoison(self, *nbytes: int) -> None:
        """Free 0xFF-filled blocks of these sizes, so the op's own output allocations (caching
        allocator, same stream) likely land on poison. Best effort; a no-op on the CPU."""
        if not self.caching:
            return
        bufs = [torch.full((max(1, int(nb)),), 0xFF, dtype=torch.uint8, device=self.dev) for nb in nbytes]
        del bufs

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    # -- results ----------------------------------------------------------------------------------
    def fail(self, op: str, case: str, msg: str) -> None:
        self.failed[op] = self.failed.get(op, 0) + 1
        self.failures.append({"op": op, "case": case, "error": msg})
        if self.quiet:
            return
        if len(self.failures) <= MAX_PRINTED_FAILURES:
            print(f"FAIL {op} [{case}]: {msg}", flush=True)
        elif len(self.failures) == MAX_PRINTED_FAILURES + 1:
            print("... (further failures are counted, and listed in the JSON)", flush=True)

    def check(self, op: str, case: str, what: str, ref: torch.Tensor, got: torch.Tensor,
              layout: Optional[Tuple[int, str, int, int]] = None) -> bool:
        """Bitwise ref == got, except that any NaN equals any NaN in floating outputs and in the value
        regions of payloads (see _both_nan). layout = (n, codec, block, k) names payload regions in
        messages."""
        if ref.dtype != got.dtype or tuple(ref.shape) != tuple(got.shape):
            self.fail(op, case, f"{what}: {got.dtype}{tuple(got.shape)} != expected {ref.dtype}{tuple(ref.shape)}")
            return False
        a, b = bits(ref), bits(got)
        if torch.equal(a, b):
            self.passed[op] = self.passed.get(op, 0) + 1
            return True
        differ = (a != b).reshape(-1) & ~_both_nan(ref.cpu(), got.cpu(), layout)
        if not bool(differ.any()):
            self.passed[op] = self.passed.get(op, 0) + 1
            return True
        diff = differ.nonzero().flatten()
        i = int(diff[0])
        where = _region(layout[0], layout[1], layout[2], layout[3], i) if layout else ""
        self.fail(op, case, f"{what}: {diff.numel()} of {a.numel()} differ; first at {i}{where}: "
                            f"got {_fmt(got.cpu(), i)}, expected {_fmt(ref, i)}")
        return False

    def run(self, op: str, case: str, fn: Callable[[], None]) -> None:
        """One case: fn does the reference and device calls and the checks; an exception is a
        failure of op (the rest of the case is skipped); a broken CUDA context stops everything."""
        if self.broken:
            self.skipped_cases += 1
            return
        if time.monotonic() > self.deadline:
            self.skipped_cases += 1
            return
        self.cases += 1
        self.stage = (op, "")
        try:
            fn()
            self.sync()
        except (Interrupted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            text = str(e).strip()
            msg = f"raised {type(e).__name__}: {text.splitlines()[0] if text else ''}"
            if self.stage[1]:
                msg = f"{self.stage[1]} {msg}"
            if self.verbose:
                traceback.print_exc()
            self.fail(self.stage[0] or op, case, msg)
            if self.cuda:
                try:
                    torch.cuda.synchronize(self.dev)
                    torch.zeros(1, device=self.dev).add_(1).item()
                except Exception as e2:  # noqa: BLE001
                    self.broken = f"{type(e2).__name__}: {str(e2).strip().splitlines()[0]}"
                    print(f"CUDA context is broken after [{op} {case}]: {self.broken}; "
                          "stopping the correctness sweep", flush=True)
                    raise ContextBroken(self.broken) from e


# ---------------------------------------------------------------------------------------------------
# Cases


class Sweep:
    def __init__(self, ck: Checker, cfg: Config, seed: int) -> None:
        self.ck = ck
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self.counter = 0

    def next_misalign(self) -> bool:
        self.counter += 1
        return self.counter % 3 == 2

    def seed(self) -> int:
        return int(torch.randint(0, 1 << 62, (1,), generator=self.g))

    # encode / encode_into -------------------------------------------------------------------------
    def encode(self, x, codec, b, ratio, residual, stochastic, desc) -> torch.Tensor:
        """Returns the CPU payload (for the decode cases); None if the reference failed."""
        ck = self.ck
        seed = self.seed()
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio, stochastic=stochastic, seed=seed)
        desc = f"{desc} res={'y' if residual is not None else 'n'} stoch={'y' if stochastic else 'n'}" \
               f"{' misaligned' if mis else ''} seed={seed}"
        n = x.numel()
        k = fc.resolve(codec, b, ratio).k(n)
        lay = (n, codec, b, k)
        out: List[torch.Tensor] = []

        def case():
            ck.at("encode", "cpu reference")
            r_ref = residual.clone() if residual is not None else None
            p_ref = fc.encode(x, codec, residual=r_ref, **kw)
            out.append(p_ref)
            ck.at("encode")
            xd = ck.to_dev(x, mis)
            rd = ck.to_dev(residual, mis)
            ck.prepoison(p_ref.numel())
            p = fc.encode(xd, codec, residual=rd, **kw)
            ck.check("encode", desc, "payload", p_ref, p, lay)
            if residual is not None:
                ck.check("encode", desc, "residual", r_ref, rd)
            ck.check("encode", desc, "x unchanged", x, xd)
            ck.at("encode_into")
            rd2 = ck.to_dev(residual, mis)
            buf = ck.poisoned(p_ref.numel(), torch.uint8, mis)
            ret = fc.encode(xd, codec, residual=rd2, out=buf, **kw)
            if ret.data_ptr() != buf.data_ptr():
                ck.fail("encode_into", desc, "out= did not return the out tensor")
            ck.check("encode_into", desc, "payload (poisoned out)", p_ref, buf, lay)
            if residual is not None:
                ck.check("encode_into", desc, "residual", r_ref, rd2)

        ck.run("encode", desc, case)
        return out[0] if out else None

    # decode / decode_into -------------------------------------------------------------------------
    def decode(self, p_ref, codec, n, b, ratio, dtype, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio)
        desc = f"{desc} -> {DT_NAME[dtype]}{' misaligned' if mis else ''}"

        def case():
            ck.at("decode", "cpu reference")
            ref = fc.decode(p_ref, codec, n, dtype=dtype, **kw)
            ck.at("decode")
            pd = ck.to_dev(p_ref, mis)
            ck.prepoison(ref.numel() * ref.element_size())
            ck.check("decode", desc, "values", ref, fc.decode(pd, codec, n, dtype=dtype, **kw))
            ck.at("decode_into")
            out = ck.poisoned(n, dtype, mis)
            fc.decode(pd, codec, n, out=out, **kw)
            ck.check("decode_into", desc, "values (poisoned out)", ref, out)
            ck.check("decode", desc, "payload unchanged", p_ref, pd)

        ck.run("decode", desc, case)

    # decode_sum / decode_sum_into ------------------------------------------------------------------
    def decode_sum(self, P, codec, n, b, ratio, scale, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio, scale=scale)
        desc = f"{desc} W={P.shape[0]} scale={scale:g}{' misaligned' if mis else ''}"

        def case():
            ck.at("decode_sum", "cpu reference")
            ref = fc.decode_sum(P, codec, n, **kw)
            ck.at("decode_sum")
            Pd = ck.to_dev(P, mis)
            ck.prepoison(4 * n)
            ck.check("decode_sum", desc, "sum", ref, fc.decode_sum(Pd, codec, n, **kw))
            ck.at("decode_sum_into")
            out = ck.poisoned(n, torch.float32, mis)
            fc.decode_sum(Pd, codec, n, out=out, **kw)
            ck.check("decode_sum_into", desc, "sum (poisoned out)", ref, out)

        ck.run("decode_sum", desc, case)

    # decode_sum_encode / _into ---------------------------------------------------------------------
    def decode_sum_encode(self, P, codec, n, b, ratio, scale, rc, rb, residual, stochastic, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        seed = self.seed()
        kw = dict(block_size=b, ratio=ratio, scale=scale, reencode=rc, reencode_block_size=rb,
                  stochastic=stochastic, seed=seed)
        desc = (f"{desc} W={P.shape[0]} scale={scale:g} -> {rc} B{rb} res={'y' if residual is not None else 'n'} "
                f"stoch={'y' if stochastic else 'n'}{' misaligned' if mis else ''} seed={seed}")
        lay = (n, rc, rb, 0)

        def case():
            ck.at("decode_sum_encode", "cpu reference")
            r_ref = residual.clone() if residual is not None else None
            ref = fc.decode_sum(P, codec, n, residual=r_ref, **kw)
            ck.at("decode_sum_encode")
            Pd = ck.to_dev(P, mis)
            rd = ck.to_dev(residual, mis)
            ck.prepoison(ref.numel())
            got = fc.decode_sum(Pd, codec, n, residual=rd, **kw)
            ck.check("decode_sum_encode", desc, "payload", ref, got, lay)
            if residual is not None:
                ck.check("decode_sum_encode", desc, "residual", r_ref, rd)
            ck.at("decode_sum_encode_into")
            rd2 = ck.to_dev(residual, mis)
            buf = ck.poisoned(ref.numel(), torch.uint8, mis)
            fc.decode_sum(Pd, codec, n, residual=rd2, out=buf, **kw)
            ck.check("decode_sum_encode_into", desc, "payload (poisoned out)", ref, buf, lay)
            if residual is not None:
                ck.check("decode_sum_encode_into", desc, "residual", r_ref, rd2)

        ck.run("decode_sum_encode", desc, case)

    # ordered_sum ----------------------------------------------------------------------------------
    def ordered_sum(self, X, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        desc = f"{desc} W={X.shape[0]}{' misaligned' if mis else ''}"

        def case():
            ck.at("ordered_sum", "cpu reference")
            ref = fc.ordered_sum(X)
            ck.at("ordered_sum")
            Xd = ck.to_dev(X, mis)
            ck.prepoison(4 * X.shape[1])
            ck.check("ordered_sum", desc, "sum", ref, fc.ordered_sum(Xd))

        ck.run("ordered_sum", desc, case)

    # exact family ---------------------------------------------------------------------------------
    def exact(self, X, eb, headroom, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        W, n = X.shape
        desc = f"{desc} W={W} eblock={eb} headroom={headroom}{' misaligned' if mis else ''}"
        nb = -(-n // eb)

        def case():
            ck.at("exact_exponents", "cpu reference")
            E = fc.exact_exponents(X, eb)
            ck.at("exact_exponents")
            Xd = ck.to_dev(X, mis)
            ck.prepoison(4 * nb)
            ck.check("exact_exponents", desc, "exponents [W, n]", E, fc.exact_exponents(Xd, eb))
            ck.check("exact_exponents", desc, "exponents row 0",
                     fc.exact_exponents(X[0], eb), fc.exact_exponents(Xd[0], eb))
            Ed = ck.to_dev(E, mis)
            parts = []
            for r in range(W):
                ck.at("to_exact", f"row {r} cpu reference")
                ref = fc.to_exact(X[r], E, eb, headroom)
                parts.append(ref)
                ck.at("to_exact", f"row {r}")
                ck.prepoison(8 * n)
                ck.check("to_exact", desc, f"row {r}", ref, fc.to_exact(Xd[r], Ed, eb, headroom))
            acc = torch.stack(parts).sum(0)
            accd = ck.to_dev(acc, mis)
            ck.at("from_exact", "cpu reference")
            ref = fc.from_exact(acc, E, eb, headroom)
            ck.at("from_exact")
            ck.prepoison(4 * n)
            ck.check("from_exact", desc, "values", ref, fc.from_exact(accd, Ed, eb, headroom))
            ck.at("exact_sum", "cpu reference")
            ref = fc.exact_sum(X, eb, headroom)
            ck.at("exact_sum")
            ck.prepoison(4 * n)
            ck.check("exact_sum", desc, "sum", ref, fc.exact_sum(Xd, eb, headroom))

        ck.run("exact_exponents", desc, case)

    # the sweep ------------------------------------------------------------------------------------
    def codec_configs(self) -> List[Tuple[str, int, float]]:
        out = []
        for codec in CODECS:
            if codec in BLOCKWISE:
                out += [(codec, b, 0.01) for b in self.cfg.blocks]
            elif codec == "topk":
                out += [(codec, 256, r) for r in self.cfg.topk_ratios]
            else:
                out.append((codec, 256, 0.01))
        return out

    def run(self) -> None:
        cfg = self.cfg
        for n in cfg.sizes:
            t0 = time.monotonic()
            cases0 = self.ck.cases
            variants = ("nonfinite",) if n >= cfg.big_n else cfg.variants
            for dtype in cfg.dtypes:
                for variant in variants:
                    self.run_group(n, dtype, variant)
            print(f"  n={n:<8} {self.ck.cases - cases0:5d} cases in {time.monotonic() - t0:6.1f} s; "
                  f"{sum(self.ck.failed.values())} failed checks so far", flush=True)

    def run_group(self, n: int, dtype, variant: str) -> None:
        cfg, g = self.cfg, self.g
        big = n >= cfg.big_n
        base = f"n={n} {DT_NAME[dtype]} {variant}"
        rot = 0
        for codec, b, ratio in self.codec_configs():
            if self.ck.broken or self.ck.out_of_time():
                self.ck.skipped_cases += 1
                continue
            cdesc = f"{base} {codec}" + (f" B{b}" if codec in BLOCKWISE else "") + \
                    (f" ratio={ratio:g}" if codec == "topk" else "")
            rot += 1
            try:
                self.codec_group(n, dtype, variant, codec, b, ratio, cdesc, rot)
            except (Interrupted, KeyboardInterrupt, ContextBroken):
                raise
            except Exception as e:  # noqa: BLE001  (input generation or a reference call in the harness)
                if self.ck.verbose:
                    traceback.print_exc()
                self.ck.fail("encode", cdesc, f"harness error {type(e).__name__}: {e}")
        if self.ck.broken or self.ck.out_of_time():
            return
        # sums
        for W in ((1, 3, 8) if not big else (4,)):
            self.ordered_sum(make_x(g, n, dtype, variant, 256, rows=W), base)
        for i, eb in enumerate(cfg.exact_blocks):
            W = (1, 3, 8, 2)[i % 4]
            headroom = (HEADROOM, 3, 38, HEADROOM)[i % 4]
            self.exact(make_x(g, n, dtype, variant, eb, rows=W), eb, headroom, base)

    def codec_group(self, n, dtype, variant, codec, b, ratio, cdesc, rot) -> None:
        """encode (4 kinds), decode (3 dtypes), decode_sum and decode_sum_encode for one codec."""
        cfg, g = self.cfg, self.g
        big = n >= cfg.big_n
        x = make_x(g, n, dtype, variant, b)
        r = make_residual(g, n, variant, b)
        # encode: with and without error feedback, deterministic and stochastic rounding
        plain = self.encode(x, codec, b, ratio, None, False, cdesc)
        self.encode(x, codec, b, ratio, r, False, cdesc)
        stoch = None
        if codec in STOCHASTIC:
            stoch = self.encode(x, codec, b, ratio, r if big else None, True, cdesc)
            if not big:
                self.encode(x, codec, b, ratio, r, True, cdesc)
        # decode into every output dtype
        for p, tag in ((plain, ""), (stoch, " stoch")):
            if p is None:
                continue
            for od in DTYPES:
                self.decode(p, codec, n, b, ratio, od, cdesc + tag)
        # decode_sum over W payloads of fresh inputs (W = 0 included)
        W = (3, 1, 0, 5)[rot % 4] if not big else 3
        rows = [make_x(g, n, dtype, variant, b) for _ in range(W)]
        P = torch.stack([fc.encode(xr, codec, block_size=b, ratio=ratio) for xr in rows]) if W else \
            torch.zeros(0, fc.wire_bytes(codec, n, block_size=b, ratio=ratio), dtype=torch.uint8)
        scale = 1.0 if rot % 2 else 1.0 / max(W, 1)
        self.decode_sum(P, codec, n, b, ratio, scale, cdesc)
        # decode_sum_encode: every reencode codec for small n and fp32 inputs, else a rotation
        if n <= cfg.full_reencode_max_n and dtype == torch.float32:
            targets = REENCODE
        else:
            targets = tuple(dict.fromkeys([REENCODE[(rot + CODECS.index(codec)) % len(REENCODE)],
                                           codec if codec != "topk" else "int8"]))
        for rc in targets:
            rb = b if codec in BLOCKWISE else cfg.blocks[(rot + REENCODE.index(rc)) % len(cfg.blocks)]
            res = make_residual(g, n, variant, rb)
            self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, None, False, cdesc)
            self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, res, False, cdesc)
            if rc in STOCHASTIC:
                self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, res, True, cdesc)


def negative_controls(device: torch.device) -> List[str]:
    """Self-test of the harness: the comparison must flag poison, single-bit flips, -0 vs +0, NaN
    payload bits, shape / dtype mismatches and exceptions; misaligned buffers must really be
    misaligned. Returns the problems found (empty = the harness works)."""
    problems: List[str] = []
    ck = Checker(device, 1e9, False, quiet=True)
    ref = torch.tensor([1.0, -0.0, float("nan"), 2.5])
    poisoned = ck.poisoned(4, torch.float32)
    cases = [
        ("poisoned out", ref, poisoned),
        ("+0 vs -0", ref, torch.tensor([1.0, 0.0, float("nan"), 2.5])),
        ("NaN vs a number", ref, torch.tensor([1.0, -0.0, 2.5, 2.5])),
        ("a number vs NaN", torch.tensor([1.0, -0.0, 2.5, 2.5]), ref),
        ("NaN in a payload's codes", torch.full((48,), 0xFF, dtype=torch.uint8),
         torch.full((48,), 0xFF, dtype=torch.uint8).index_put_((torch.tensor([20]),), torch.tensor([0x7F], dtype=torch.uint8))),
        ("bit flip", torch.arange(40, dtype=torch.uint8), torch.arange(40, dtype=torch.uint8) ^ (
            torch.arange(40) == 37).to(torch.uint8)),
        ("shape", ref, ref[:3].clone()),
        ("dtype", ref, ref.to(torch.bfloat16)),
        ("bf16 poison", ref.to(torch.bfloat16), ck.poisoned(4, torch.bfloat16)),
    ]
    for what, a, b in cases:
        if ck.check("encode", "negative control", what, a, b.to(device), (33, "int8", 32, 0)):
            problems.append(f"check() missed: {what}")
    if not ck.check("encode", "negative control", "equal NaNs", ref, ref.clone().to(device)):
        problems.append("check() flagged identical bits")
    # Which NaN is not compared (a GPU's canonical 0x7fffffff vs x86's propagated payload)...
    other_nan = ref.clone().view(torch.int32).index_put_(
        (torch.tensor([2]),), torch.tensor([0x7FFFFFFF], dtype=torch.int32)).view(torch.float32)
    if not ck.check("encode", "negative control", "other NaN bits", ref, other_nan.to(device)):
        problems.append("check() flagged a NaN with other bits (sign / payload)")
    # ... in floating outputs and in the value region of a cast payload, but not in other bytes.
    p_ref = torch.tensor([0.5, float("nan")]).view(torch.uint8)
    p_got = torch.tensor([0.5, -float("nan")]).view(torch.uint8)
    if not ck.check("encode", "negative control", "fp32 payload NaN bits", p_ref, p_got.to(device), (2, "fp32", 0, 0)):
        problems.append("check() flagged NaN bits in a cast payload's values")
    before = sum(ck.failed.values())
    ck.run("decode", "negative control", lambda: fc.decode(torch.zeros(3, dtype=torch.uint8), "int8", 100))
    if sum(ck.failed.values()) != before + 1:
        problems.append("run() did not record an exception as a failure")
    for dt in (torch.uint8, torch.float32, torch.bfloat16, torch.int64):
        t = ck.empty((3, 5), dt, True)
        if t.data_ptr() % 16 == 0 or not t.is_contiguous() or tuple(t.shape) != (3, 5):
            problems.append(f"misaligned {dt} buffer is aligned or malformed")
    src = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    if not torch.equal(ck.to_dev(src, True).cpu(), src) or ck.to_dev(src).data_ptr() == src.data_ptr():
        problems.append("to_dev() does not copy")
    return problems


# ---------------------------------------------------------------------------------------------------
# Timing


class Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.dev = device
        self.cuda = device.type == "cuda"
        self.reps = reps

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(self.dev)
            return statistics.median(s.elapsed_time(e) for s, e in ev)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def run_timing(device: torch.device, sizes: Sequence[int], reps: int, W: int = 4) -> Tuple[List[dict], Optional[dict]]:
    timer = Timer(device, reps)
    rows: List[dict] = []
    target = None
    print(f"  {'op':<34} {'numel':>6} {'ms':>9} {'moved MB':>9} {'GB/s':>8} {'x copy':>7}", flush=True)
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, device=device, generator=g)
        residual = torch.randn(n, device=device, generator=g) * 0.01
        out = torch.empty(n, device=device)
        src, dst = torch.randn(n, device=device, generator=g), torch.empty(n, device=device)
        label = f"{n / (1 << 20):.0f}M" if n >= 1 << 20 else f"{n / 1024:.0f}K"
        copy_gbps = 0.0

        def row(name: str, nbytes: int, fn: Callable[[], object]) -> dict:
            nonlocal copy_gbps
            try:
                ms = timer.median_ms(fn)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001  (recorded; a broken context stops the table)
                text = str(e).strip()
                rr = {"op": name, "numel": n, "error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"}
                rows.append(rr)
                print(f"  {name:<34} {label:>6}   ERROR {rr['error']}", flush=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # raises if the context is gone
                return rr
            gbps = nbytes / ms / 1e6
            copy_gbps = copy_gbps or gbps  # the first row is the copy_ baseline
            rr = {"op": name, "numel": n, "ms": ms, "bytes": nbytes, "GB/s": gbps, "x_copy": gbps / copy_gbps}
            rows.append(rr)
            print(f"  {name:<34} {label:>6} {ms:9.3f} {nbytes / 1e6:9.1f} {gbps:8.1f} {rr['x_copy']:7.2f}",
                  flush=True)
            return rr

        row("copy_ (baseline, 8 B/elem)", 8 * n, lambda: dst.copy_(src))
        for codec in CODECS:
            c = fc.resolve(codec)
            wire = c.wire_bytes(n)
            payload = torch.empty(wire, dtype=torch.uint8, device=device)
            rr = row(f"encode+EF {codec}", 12 * n + wire, lambda: fc.encode(x, c, residual=residual, out=payload))
            if codec == "int8" and n == max(sizes):
                ratio = rr.get("x_copy", 0.0)
                target = {"op": rr["op"], "numel": n, "x_copy": ratio, "required": 0.8, "ok": ratio >= 0.8,
                          "error": rr.get("error")}
            if codec in STOCHASTIC:
                row(f"encode+EF {codec} stochastic", 12 * n + wire,
                    lambda: fc.encode(x, c, residual=residual, stochastic=True, seed=1, out=payload))
            row(f"encode {codec}", 4 * n + wire, lambda: fc.encode(x, c, out=payload))
            row(f"decode {codec} -> f32", wire + 4 * n, lambda: fc.decode(payload, c, n, out=out))
            P = payload.unsqueeze(0).repeat(W, 1)
            row(f"decode_sum {codec} W={W}", W * wire + 4 * n, lambda: fc.decode_sum(P, c, n, out=out))
            if codec != "topk":
                res2 = torch.zeros(n, device=device)
                row(f"decode_sum_encode+EF {codec} W={W}", W * wire + 8 * n + wire,
                    lambda: fc.decode_sum(P, c, n, reencode=c, residual=res2, out=payload))
                del res2
            del payload, P
        X = torch.randn(W, n, device=device, generator=g)
        row(f"ordered_sum W={W}", 4 * W * n + 4 * n, lambda: fc.ordered_sum(X))
        nb = -(-n // 256)
        row(f"exact_exponents W={W}", 4 * W * n + 4 * nb, lambda: fc.exact_exponents(X))
        E = fc.exact_exponents(X)
        row("to_exact", 4 * n + 4 * nb + 8 * n, lambda: fc.to_exact(X[0], E))
        acc = fc.to_exact(X[0], E)
        row("from_exact", 8 * n + 4 * nb + 4 * n, lambda: fc.from_exact(acc, E))
        row(f"exact_sum W={W}", 4 * W * n + 4 * n, lambda: fc.exact_sum(X))
        del x, residual, out, src, dst, X, E, acc
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, target


# ---------------------------------------------------------------------------------------------------
# The cupy / NVRTC path (flatcomm/cupy_backend.py): the same kernel sources compiled at run time.

CUPY_CFG = Config(sizes=(1, 97, 4099, 65537), blocks=(32, 256), exact_blocks=(7, 256), dtypes=DTYPES,
                  topk_ratios=(0.3,), variants=("nonfinite",), big_n=1 << 62, full_reencode_max_n=97,
                  timing_sizes=(), reps=0)


def cupy_section(device: torch.device, seed: int, max_seconds: float, reps: int, timing_n: int,
                 self_test: bool = False) -> dict:
    """NVRTC kernels vs the CPU (the sweep, with the NVRTC ops registered over the compiled CUDA
    kernels for the time of it), vs the compiled kernels directly (every codec's encode + EF and
    decode on one input), and the int8 encode + EF time of both. With self_test (CPU, no cupy) both
    "paths" are the CPU kernels: it exercises this code, not the NVRTC kernels."""
    from flatcomm import _ops, cupy_backend as cb

    out: dict = {"cuda_path": _ops.cuda_path(), "kernels": len(cb.kernel_names())}
    t0 = time.monotonic()
    if self_test:
        nvrtc_ops = None
        print("   self-test: no cupy / GPU here, both paths are the CPU kernels", flush=True)
    else:
        nvrtc_ops = cb.make_ops()
        launcher = nvrtc_ops.k.run.__self__
        nk = launcher.precompile(device.index or 0)
        out["compile_seconds"] = round(time.monotonic() - t0, 1)
        print(f"   NVRTC compiled {nk} kernels in {out['compile_seconds']} s (cupy caches them on disk)",
              flush=True)

    # 1. the sweep, CPU reference vs the NVRTC ops on the device
    lib = None
    if nvrtc_ops is not None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overriding the compiled CUDA kernels on purpose
            lib = cb.register(nvrtc_ops, "CUDA")
    ck = Checker(device, max_seconds, verbose=False)
    try:
        try:
            Sweep(ck, dataclasses.replace(CUPY_CFG), seed).run()
        except ContextBroken:
            pass
    finally:
        if lib is not None:
            lib._destroy()  # the compiled kernels take the CUDA key back
    npass, nfail = sum(ck.passed.values()), sum(ck.failed.values())
    out.update(sweep_passed=npass, sweep_failed=nfail, sweep_skipped=ck.skipped_cases,
               sweep_unchecked=[op for op in OPS if ck.passed[op] + ck.failed[op] == 0],
               failures=ck.failures[:50])
    print(f"   sweep, NVRTC vs cpu: {npass} passed, {nfail} failed ({ck.cases} cases)", flush=True)

    # 2. NVRTC vs compiled on the same device tensors, every codec
    compiled = torch.ops.flatcomm
    nv = nvrtc_ops if nvrtc_ops is not None else compiled
    g = torch.Generator().manual_seed(seed)
    n = 100_003
    x = torch.randn(n, generator=g).to(device)
    r0 = (torch.randn(n, generator=g) * 0.01).to(device)
    diffs = []
    for codec in CODECS:
        c = fc.resolve(codec, 256, 0.05)
        k = c.k(n)
        for stoch in ((False, True) if codec in STOCHASTIC else (False,)):
            ra, rb = r0.clone(), r0.clone()
            pa = compiled.encode(x, codec, 256, k, ra, stoch, 11)
            pb = nv.encode(x, codec, 256, k, rb, stoch, 11)
            da = compiled.decode(pa, codec, n, 256, k, torch.float32)
            db = nv.decode(pb, codec, n, 256, k, torch.float32)
            for what, a, b in (("payload", pa, pb), ("residual", ra, rb), ("decoded", da, db)):
                if not torch.equal(bits(a.cpu()), bits(b.cpu())):
                    diffs.append(f"{codec}{' stochastic' if stoch else ''} {what}")
    out["vs_compiled_diffs"] = diffs
    print(f"   NVRTC vs compiled kernels, encode+EF and decode of every codec: "
          f"{'bitwise equal' if not diffs else 'DIFFER: ' + ', '.join(diffs)}", flush=True)

    # 3. int8 encode + EF, both paths
    timer = Timer(device, max(reps, 2))
    xt = torch.randn(timing_n, device=device)
    rt = torch.zeros(timing_n, device=device)
    pt = torch.empty(fc.wire_bytes("int8", timing_n), dtype=torch.uint8, device=device)
    src, dst = torch.randn(timing_n, device=device), torch.empty(timing_n, device=device)
    ms_copy = timer.median_ms(lambda: dst.copy_(src))
    ms_a = timer.median_ms(lambda: compiled.encode_into(xt, "int8", 256, 0, rt, False, 0, pt))
    ms_b = timer.median_ms(lambda: nv.encode_into(xt, "int8", 256, 0, rt, False, 0, pt))
    nbytes = 12 * timing_n + pt.numel()
    out["timing"] = {"numel": timing_n, "copy_ms": ms_copy, "compiled_ms": ms_a, "nvrtc_ms": ms_b,
                     "compiled_x_copy": nbytes / ms_a / (8 * timing_n / ms_copy),
                     "nvrtc_x_copy": nbytes / ms_b / (8 * timing_n / ms_copy)}
    print(f"   int8 encode+EF at {timing_n}: compiled {ms_a:.3f} ms, NVRTC {ms_b:.3f} ms "
          f"(copy_ {ms_copy:.3f} ms; x copy: {out['timing']['compiled_x_copy']:.2f} / "
          f"{out['timing']['nvrtc_x_copy']:.2f})", flush=True)
    out["ok"] = not nfail and not diffs and not ck.broken
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


# ---------------------------------------------------------------------------------------------------
# The collectives on CUDA tensors over NCCL: streams, CUDA-aware futures, the DDP hook.

SPIN_CYCLES = 20_000_000  # torch.cuda._sleep before writing an input: ~10 ms of a busy caller stream


def collectives_section(device: torch.device, seed: int, max_seconds: float, self_test: bool = False) -> dict:
    """flatcomm.collectives on ``device`` tensors over a world-size-1 NCCL group, bitwise against the
    same calls on CPU tensors over gloo (world size 1 too, same process, file:// rendezvous). With
    self_test (CPU) the "device" group is a second gloo group: it exercises this code, not NCCL.

    Every case runs twice: as flatcomm does at world size 1 (local copies), and with
    ``collectives._EXCHANGE_ALONE``, which sends through torch.distributed anyway so that the NCCL
    calls and their stream hand-offs run on a one-GPU machine. On CUDA every input is written on the
    caller's stream behind a ~10 ms ``torch.cuda._sleep`` over a NaN poison, so a collective that does
    not wait for the caller's stream reads NaN; asynchronous results are read on another stream right
    after ``get_future().wait()`` or ``Handle.wait()``, so a future that is not CUDA-aware reads them
    before the collective has run; some callers run on a non-default stream."""
    import contextlib
    import shutil
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist
    from flatcomm import collectives as C
    from flatcomm import ddp as fddp

    cuda = device.type == "cuda"
    if not dist.is_available():
        return {"skipped": "torch.distributed is not available"}
    if cuda and not dist.is_nccl_available():
        return {"skipped": "torch.distributed has no NCCL"}
    if dist.is_initialized():
        return {"skipped": "a default process group already exists"}
    t0 = time.monotonic()
    out: dict = {"passed": 0, "failed": 0, "failures": [], "skipped_cases": 0}
    tmp = tempfile.mkdtemp(prefix="flatcomm_gpu_check_")
    if cuda:
        if device.index is None:  # torch.cuda.set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{tmp}/rendezvous",
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        dev_group = dist.new_group([0], backend="nccl" if cuda else "gloo")
        cpu_group = dist.new_group([0], backend="gloo")
        g = torch.Generator().manual_seed(seed)
        other = torch.cuda.Stream(device) if cuda else None  # where async results are consumed
        caller = torch.cuda.Stream(device) if cuda else None  # a non-default caller stream

        def on(stream):
            return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

        def stage(dev: torch.device, *xs: torch.Tensor) -> List[torch.Tensor]:
            """The xs on dev. On CUDA each is written on the current stream behind a spin, over NaN,
            after all the uploads (a pageable upload may wait for the stream and hide the spins)."""
            if dev.type != "cuda":
                return [x.clone() for x in xs]
            srcs = [x.to(dev) for x in xs]
            torch.cuda.synchronize(dev)
            outs = []
            for src in srcs:
                d = torch.full_like(src, float("nan"))
                torch.cuda._sleep(SPIN_CYCLES)
                d.copy_(src)
                outs.append(d)
            return outs

        def consume(run, dev: torch.device, how: str):
            """run(async_op) -> (handle or None, tensors the call writes); their values, read on the
            caller's stream (sync) or on another one after the future's / handle's wait (CUDA)."""
            h, ts = run(how != "sync")
            if how == "sync" or dev.type != "cuda":
                if how == "future":
                    h.get_future().wait()
                elif how == "handle":
                    h.wait()
                vals = [t.clone() for t in ts]
            else:
                with torch.cuda.stream(other):
                    if how == "future":
                        h.get_future().wait()
                    else:
                        h.wait()
                    vals = [t.clone() for t in ts]
                torch.cuda.synchronize(dev)
            return [v.cpu() for v in vals]

        def compare(name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
            bad = [i for i, (a, b) in enumerate(zip(got, want))
                   if a.shape != b.shape or not torch.equal(bits(a), bits(b))]
            if bad or len(got) != len(want):
                where = []
                for i in bad[:3]:
                    a, b = got[i].reshape(-1), want[i].reshape(-1)
                    if a.shape != b.shape:
                        where.append(f"tensor {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                        continue
                    j = int((bits(a) != bits(b)).nonzero()[0])
                    where.append(f"tensor {i}: {int((bits(a) != bits(b)).sum())} of {a.numel()} differ, "
                                 f"first [{j}] {_fmt(a, j)} vs cpu {_fmt(b, j)}")
                fail(f"{name}: " + "; ".join(where or ["count mismatch"]))
            else:
                out["passed"] += 1

        def fail(msg: str) -> None:
            out["failed"] += 1
            out["failures"].append(msg)
            print(f"   FAIL {msg}", flush=True)

        def both_exchange_paths(label: str, body: Callable[[str], None]) -> None:
            """body(label) once through flatcomm's own exchange and once via dist (_EXCHANGE_ALONE),
            within the time budget; an exception is that case's failure."""
            for alone in (False, True):
                lab = label.replace("]", ", via dist]") if alone else label
                if time.monotonic() - t0 > max_seconds:
                    out["skipped_cases"] += 1
                    continue
                C._EXCHANGE_ALONE = alone
                try:
                    body(lab)
                except Exception as e:  # noqa: BLE001
                    fail(f"{lab}: {type(e).__name__}: {e}")
                finally:
                    C._EXCHANGE_ALONE = False

        def run_case(name: str, make_run, how: str, on_caller: bool) -> None:
            """make_run(dev, group) -> run(async_op); compared device (as `how`) vs cpu (sync)."""
            def body(label: str) -> None:
                want = consume(make_run(torch.device("cpu"), cpu_group), torch.device("cpu"), "sync")
                with on(caller if on_caller else None):
                    got = consume(make_run(device, dev_group), device, how)
                compare(label, got, want)

            both_exchange_paths(f"{name} [{how}{', caller stream' if on_caller else ''}]", body)

        hows = ("sync", "future", "handle")
        k = 0

        def how_next():
            nonlocal k
            k += 1
            return hows[k % 3], k % 2 == 0

        # all_reduce: fp32 / int8 / sign, with error feedback, chunks 1 and 3, two steps each
        for codec in ("fp32", "int8", "sign"):
            for chunks in (1, 3):
                n = 1000 if chunks == 1 else 300_001
                xs = [torch.randn(n, generator=g) * 3 for _ in range(2)]
                rc, rs = torch.randn(n, generator=g) * 0.01, torch.randn(n, generator=g) * 0.01

                def make_run(dev, group, codec=codec, chunks=chunks, xs=xs, rc=rc, rs=rs):
                    rcd, rsd, t = stage(dev, rc, rs, xs[0])
                    ef = C.ErrorFeedback(rcd, rsd)
                    # step 1 synchronous, step 2 as the case says (its input is staged after step 1)
                    C.all_reduce(t, codec=codec, chunks=chunks, residual=ef, group=group)
                    t.copy_(stage(dev, xs[1])[0])

                    def run(async_op):
                        return C.all_reduce(t, codec=codec, chunks=chunks, residual=ef, group=group,
                                            async_op=async_op), [t, ef.client, ef.server]
                    return run

                how, oc = how_next()
                run_case(f"all_reduce {codec} chunks={chunks} n={n} +EF", make_run, how, oc)
        # fp32 without residual: the zero-copy path (one chunk) and the staged one; exact mode
        for chunks, mode in ((1, "ordered"), (3, "ordered"), (3, "exact")):
            x = torch.randn(300_001, generator=g)

            def make_run(dev, group, x=x, chunks=chunks, mode=mode):
                (t,) = stage(dev, x)
                return lambda a: (C.all_reduce(t, codec="fp32", chunks=chunks, mode=mode, group=group,
                                               async_op=a), [t])

            how, oc = how_next()
            run_case(f"all_reduce fp32 {mode} chunks={chunks} no EF", make_run, how, oc)
        # reduce_scatter: fp32 (zero-copy and staged), int8 with a residual; all_gather int8 + EF
        for codec, chunks, ef in (("fp32", None, False), ("fp32", 3, False), ("int8", 3, True)):
            x = torch.randn(300_001, generator=g)
            r = torch.randn(300_001, generator=g) * 0.01

            def make_run(dev, group, x=x, r=r, codec=codec, chunks=chunks, ef=ef):
                dst, res, src = stage(dev, torch.zeros(x.numel()), r, x)
                res = res if ef else None
                return lambda a: (C.reduce_scatter(dst, src, codec=codec, chunks=chunks, residual=res,
                                                   group=group, async_op=a), [dst] + ([res] if ef else []))

            how, oc = how_next()
            run_case(f"reduce_scatter {codec} chunks={chunks or 'auto'}{' +EF' if ef else ''}", make_run, how, oc)
        x, r = torch.randn(4099, generator=g), torch.randn(4099, generator=g) * 0.01

        def make_run(dev, group):
            dst, res, src = stage(dev, torch.zeros(4099), r, x)
            return lambda a: (C.all_gather(dst, src, codec="int8", residual=res, group=group, async_op=a),
                              [dst, res])

        how, oc = how_next()
        run_case("all_gather int8 +EF", make_run, how, oc)

        # one DDP model, three steps, flatcomm.ddp.register(model, "int8"): the gradients are exact
        # in fp32 on both devices (dyadic values), so the hook's results must match bitwise.
        def dyadic(shape, den):
            return torch.randint(-8, 9, shape, generator=g).float() / den

        w = [dyadic((48, 64), 8), dyadic((48,), 8), dyadic((16, 48), 8), dyadic((16,), 8)]
        batches = [(dyadic((8, 64), 4), torch.randint(-2, 3, (8, 16), generator=g).float()) for _ in range(3)]

        def ddp_grads(dev, group):
            model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
            with torch.no_grad():
                for p, v in zip(model.parameters(), w):
                    p.copy_(v)
            model.to(dev)
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.01)
            st = fddp.register(net, "int8")
            grads = []
            for xb, tb in batches:
                model.zero_grad()
                (net(xb.to(dev)) * tb.to(dev)).sum().backward()
                grads += [p.grad.detach().clone().cpu() for p in model.parameters()]
            steps = len(st.stats()["steps"])
            if steps != len(batches):  # the hook must have run (and finished) on every step
                raise RuntimeError(f"the flatcomm hook recorded {steps} steps on {dev}, expected {len(batches)}")
            return grads

        both_exchange_paths("DDP int8 hook, 3 steps [hook]", lambda label: compare(
            label, ddp_grads(device, dev_group), ddp_grads(torch.device("cpu"), cpu_group)))
    finally:
        C._EXCHANGE_ALONE = False
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    out["ok"] = out["failed"] == 0
    out["seconds"] = round(time.monotonic() - t0, 1)
    backend = "NCCL" if cuda else "gloo (CPU: not NCCL)"
    print(f"   collectives, {device} over {backend} vs cpu over gloo, world size 1: {out['passed']} passed, "
          f"{out['failed']} failed, {out['skipped_cases']} skipped ({out['seconds']} s)", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1))
    try:
        info["flatcomm"] = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in fc.build_info().items()}
    except Exception as e:  # noqa: BLE001
        info["flatcomm"] = f"build_info failed: {e}"
    return info


def main(argv: Optional[List[str]] = None) -> int:
    global fc
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="device checked against the CPU (default cuda)")
    ap.add_argument("--self-test", action="store_true",
                    help="CPU vs CPU on small sizes (tests this script, < 1 min)")
    ap.add_argument("--sanitize", action="store_true",
                    help="tiny sizes, every op once, no timing (for compute-sanitizer)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: random, printed)")
    ap.add_argument("--max-seconds", type=float, default=1e9,
                    help="correctness time budget: cases after it are skipped (and counted)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-correctness", action="store_true")
    ap.add_argument("--sizes", default=None, help="correctness sizes, comma-separated (overrides)")
    ap.add_argument("--timing-sizes", default=None, help="timing sizes, comma-separated (overrides)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per op (median)")
    ap.add_argument("--cupy", action="store_true",
                    help="only the cupy / NVRTC section (needs cupy and a CUDA build; the self-test runs it too)")
    ap.add_argument("--collectives", action="store_true",
                    help="only the collectives section: CUDA tensors over a world-size-1 NCCL group vs CPU "
                         "over gloo, streams, futures, a DDP step (the self-test runs it with gloo)")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks for exceptions")
    args = ap.parse_args(argv)

    if args.self_test:
        args.device = "cpu"
        cfg = dataclasses.replace(SELF_TEST)
    elif args.cupy or args.collectives:
        cfg = dataclasses.replace(SANITIZE)
        args.no_timing = args.no_correctness = True
    elif args.sanitize:
        cfg = dataclasses.replace(SANITIZE)
        args.no_timing = True
    else:
        cfg = dataclasses.replace(FULL)
    if args.device == "cpu" and not args.self_test and not args.timing_sizes:
        cfg.timing_sizes = (1 << 20,)
    if args.sizes:
        cfg.sizes = tuple(int(float(s)) for s in args.sizes.split(","))
    if args.timing_sizes:
        cfg.timing_sizes = tuple(int(float(s)) for s in args.timing_sizes.split(","))
    if args.reps:
        cfg.reps = args.reps

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.version.cuda="
              f"{torch.version.cuda}, torch.cuda.is_available() is False). This check needs a GPU; "
              "on a CPU-only machine run `python benchmarks/gpu_check.py --self-test` instead.",
              file=sys.stderr)
        return 2
    try:
        import flatcomm as _fc
    except ImportError as e:
        print(f"gpu_check: cannot import flatcomm: {e}", file=sys.stderr)
        return 2
    fc = _fc
    global HEADROOM
    HEADROOM = int(fc.sums.DEFAULT_HEADROOM)
    env = environment(device)
    built = env["flatcomm"].get("devices", []) if isinstance(env["flatcomm"], dict) else []
    nvrtc_only = False
    try:
        nvrtc_only = fc._ops.cuda_path().startswith("nvrtc")
    except AttributeError:
        pass
    if device.type == "cuda" and "cuda" not in built and not (nvrtc_only and not args.cupy):
        print(f"gpu_check: flatcomm was built without CUDA kernels (build_info devices = {built}); "
              "rebuild with FLATCOMM_CUDA=1 python3 setup.py build_ext --inplace", file=sys.stderr)
        return 2

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    mode = ("self-test" if args.self_test else "sanitize" if args.sanitize else "cupy" if args.cupy
            else "collectives" if args.collectives else "full")
    print(f"== gpu_check ({mode}): {device} vs cpu, seed {seed} (rerun with --seed {seed})", flush=True)
    print("   " + json.dumps(env), flush=True)

    result: dict = {"mode": mode, "seed": seed, "env": env, "config": {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()
        if k != "dtypes"}}
    result["config"]["dtypes"] = [DT_NAME[d] for d in cfg.dtypes]

    def on_term(signum, frame):  # timeout(1) sends SIGTERM: stop, but still write the JSON
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    ck = Checker(device, args.max_seconds, args.verbose)
    t_start = time.monotonic()
    status = 0
    try:
        if args.self_test:
            problems = negative_controls(device)
            print(f"\n== harness negative controls: {'ok' if not problems else problems}", flush=True)
            result["negative_controls"] = problems or "ok"
            if problems:
                status = 1
        if not args.no_correctness:
            print(f"\n== correctness: {device} bitwise vs cpu; sizes {list(cfg.sizes)}, blocks "
                  f"{list(cfg.blocks)}, dtypes {[DT_NAME[d] for d in cfg.dtypes]}", flush=True)
            try:
                Sweep(ck, cfg, seed).run()
            except ContextBroken:
                pass
            result["correctness_seconds"] = round(time.monotonic() - t_start, 1)
        if not args.no_timing and cfg.timing_sizes and not ck.broken:
            clock = "CUDA events" if device.type == "cuda" else "perf_counter"
            print(f"\n== timing on {device}: median of {cfg.reps} ({clock}), bytes the op must move; "
                  "x copy = GB/s / copy_ GB/s", flush=True)
            try:
                rows, target = run_timing(device, cfg.timing_sizes, cfg.reps)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                print(f"timing aborted: {type(e).__name__}: {e}", flush=True)
                rows, target = [{"error": f"timing aborted: {type(e).__name__}: {e}"}], None
                status = 1
            result["timing"] = rows
            result["target"] = target
            if target:
                verdict = "MET" if target["ok"] else "MISSED"
                if device.type != "cuda":
                    verdict += " (informational: the target is for CUDA)"
                print(f"\n   TARGET {verdict}: {target['op']} at {target['numel']} elements = "
                      f"{target['x_copy']:.2f}x copy bandwidth (required >= {target['required']})", flush=True)
        if args.cupy or args.self_test:
            print("\n== cupy / NVRTC path vs the CPU and the compiled kernels", flush=True)
            try:
                cres = cupy_section(device, seed, max(args.max_seconds - (time.monotonic() - t_start), 20),
                                    cfg.reps, 1 << 26 if device.type == "cuda" else 1 << 16,
                                    self_test=args.self_test)
            except (Interrupted, KeyboardInterrupt):
                raise
            except ImportError as e:
                cres = {"skipped": f"{type(e).__name__}: {e}"}
                print(f"   skipped: {cres['skipped']}", flush=True)
            except Exception as e:  # noqa: BLE001
                cres = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"   FAILED: {cres['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
            result["cupy"] = cres
            if cres.get("ok") is False:
                status = 1
            if args.cupy:
                print(f"\ncupy: {'ok' if cres.get('ok') else cres.get('skipped') or 'FAILED'}", flush=True)
        if args.collectives or args.self_test:
            print("\n== collectives: streams, CUDA-aware futures, DDP hook (world size 1)", flush=True)
            try:
                kres = collectives_section(device, seed, max(args.max_seconds - (time.monotonic() - t_start), 20),
                                           self_test=args.self_test)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                kres = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(f"   FAILED: {kres['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
            if "skipped" in kres:
                print(f"   skipped: {kres['skipped']}", flush=True)
            result["collectives"] = kres
            if kres.get("ok") is False:
                status = 1
            if args.collectives:
                print(f"\ncollectives: {'ok' if kres.get('ok') else kres.get('skipped') or 'FAILED'}", flush=True)
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"\ngpu_check: interrupted ({e}); writing what was done", flush=True)
        result["interrupted"] = str(e)
        status = 1

    n_pass, n_fail = sum(ck.passed.values()), sum(ck.failed.values())
    result.update(passed=n_pass, failed=n_fail, cases=ck.cases, skipped_cases=ck.skipped_cases,
                  per_op={op: {"passed": ck.passed.get(op, 0), "failed": ck.failed.get(op, 0)} for op in OPS},
                  failures=ck.failures[:1000], context_broken=ck.broken,
                  seconds=round(time.monotonic() - t_start, 1))
    if not args.no_correctness:
        print("\n== correctness summary (checks per op: passed / failed)")
        for op in OPS:
            print(f"   {op:<24} {ck.passed.get(op, 0):6d} / {ck.failed.get(op, 0)}")
        missing = [op for op in OPS if ck.passed.get(op, 0) + ck.failed.get(op, 0) == 0]
        if missing and not result.get("interrupted") and not ck.skipped_cases:
            print(f"   ops never checked: {missing}")
            result["unchecked_ops"] = missing
            status = 1
        if ck.skipped_cases:
            why = "CUDA context broken" if ck.broken else "--max-seconds budget"
            print(f"   {ck.skipped_cases} cases skipped ({why})")
        print(f"\n{n_pass} passed, {n_fail} failed  ({ck.cases} cases, seed {seed}, "
              f"{result['seconds']} s)", flush=True)
        if n_fail or ck.broken:
            status = 1
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
