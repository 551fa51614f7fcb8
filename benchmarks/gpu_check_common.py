"""benchmarks/gpu_check.py's shared parts: the configurations, the inputs (random values with zero,
subnormal, near-max and non-finite blocks) and the comparison (Checker: bitwise, any NaN equal to any
NaN in values, poisoned outputs, failures reported by region of the payload). Imports no flatcomm."""
from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch

OPS = ("encode", "encode_into", "decode", "decode_into", "decode_sum", "decode_sum_into",
       "decode_sum_encode", "decode_sum_encode_into", "ordered_sum", "exact_exponents", "to_exact",
       "from_exact", "exact_sum")
CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "sign", "topk", "sparse", "sparse4")
BLOCKWISE = ("int8", "int4", "sign")
SPARSE = ("sparse", "sparse4")  # chunked: `block` is the chunk; decode_sum never re-encodes them
STOCHASTIC = ("int8", "int4", "bf16")
REENCODE = ("fp32", "bf16", "fp16", "int8", "int4", "sign")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DT_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
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
              timing_sizes=(1 << 26,), reps=20)
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
    if codec in SPARSE:  # fp32 level tables (2 or 8 per chunk), then one record per chunk
        levels = 2 if codec == "sparse" else 8
        return f" (table of chunk {byte // (4 * levels)})" if byte < 4 * levels * nb else " (records or padding)"
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
