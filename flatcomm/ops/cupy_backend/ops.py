"""The flatcomm ops on the cupy path: the argument checks and allocations of csrc/ops_impl.h, same
messages (see :mod:`flatcomm.ops.cupy_backend`)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    import numpy as np
except ImportError:  # cupy needs numpy: without it only the registration runs
    np = None  # type: ignore[assignment]

from ..native import extension as _C
from .kernels import BF16, CHUNKED, F16, F32, MAX_BLOCK, STOCHASTIC, TOPK, _K, _MASK64, ceil_div, topk_scratch_layout
from .launches import Launches

__all__ = [
    "OP_NAMES", "Ops", "check_contiguous", "check_exact_block", "check_exponents", "check_numel",
    "check_out", "check_payload", "check_residual", "check_same_device", "check_stochastic",
    "dtype_code", "parse_codec", "parse_reencode_codec", "precision_of", "rows_of", "wire_bytes"
]

# ---- argument checks (csrc/ops_common.h, same messages) ------------------------------------------

_SCALAR_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.bfloat16: "BFloat16",
                 torch.float16: "Half", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short",
                 torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool",
                 torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
_DT_CODE = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}


def _check(ok: bool, *msg: object) -> None:
    if not ok:
        raise RuntimeError("".join(str(m) for m in msg))


def _sname(dt: torch.dtype) -> str:
    return _SCALAR_NAMES.get(dt, str(dt).replace("torch.", ""))


def _sizes(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def parse_codec(name: str) -> int:
    return _C.parse_codec(name)


def parse_reencode_codec(name: str) -> int:
    c = parse_codec(name)
    _check(c != TOPK, "flatcomm: decode_sum_encode cannot re-encode as topk (it needs the whole sum); "
           "use decode_sum and encode")
    _check(c not in CHUNKED, "flatcomm: decode_sum_encode cannot re-encode as ", name,
           " (a chunk's selection needs the chunk's whole sum); use decode_sum and encode")
    return c


def dtype_code(dt: torch.dtype, what: str) -> int:
    _check(dt in _DT_CODE, "flatcomm: ", what, " must be float32, bfloat16 or float16, got ", _sname(dt))
    return _DT_CODE[dt]


def check_numel(n: int) -> None:
    _C.wire_bytes(F32, n, 0, 0)  # a cast codec's size checks only the numel


def wire_bytes(c: int, n: int, block: int, k: int) -> int:
    return _C.wire_bytes(c, n, block, k)


def check_contiguous(t: torch.Tensor, what: str) -> None:
    _check(t.is_contiguous(), "flatcomm: ", what, " must be contiguous")


def check_same_device(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    _check(a.device == b.device, "flatcomm: ", what, " is on ", b.device, " but the input is on ", a.device)


def check_residual(x: torch.Tensor, r: Optional[torch.Tensor]) -> None:
    if r is None:
        return
    check_same_device(x, r, "residual")
    _check(r.dtype == torch.float32, "flatcomm: residual must be float32, got ", _sname(r.dtype))
    check_contiguous(r, "residual")
    _check(r.numel() == x.numel(), "flatcomm: residual has ", r.numel(), " elements but the input has ",
           x.numel())


def check_stochastic(c: int, stochastic: bool) -> None:
    names = [_K["codec_names"][i] for i in STOCHASTIC]
    _check(not stochastic or c in STOCHASTIC, "flatcomm: stochastic rounding is available for ",
           ", ".join(names[:-1]) + " and " + names[-1], " only")


def check_payload(p: torch.Tensor, rows_dim: int, expected: int, codec: str, n: int) -> None:
    _check(p.dtype == torch.uint8, "flatcomm: payload must be uint8, got ", _sname(p.dtype))
    _check(p.dim() == rows_dim, "flatcomm: payload must be ", rows_dim, "-D, got shape ", _sizes(p))
    check_contiguous(p, "payload")
    got = p.shape[-1]
    _check(got == expected, "flatcomm: payload has ", got, " bytes per row but codec '", codec,
           "' with numel ", n, " needs ", expected)


def check_out(ref: torch.Tensor, out: torch.Tensor, numel: int, what: str) -> None:
    check_same_device(ref, out, what)
    check_contiguous(out, what)
    _check(out.numel() == numel, "flatcomm: ", what, " has ", out.numel(), " elements but ", numel,
           " are needed")


def precision_of(headroom: int) -> int:
    return _C.precision_of(headroom)


def check_exact_block(block: int) -> None:
    _check(1 <= block <= MAX_BLOCK, "flatcomm: block_size must be in [1, ", MAX_BLOCK, "], got ", block)


def check_exponents(x: torch.Tensor, e: torch.Tensor, n: int, block: int) -> None:
    check_same_device(x, e, "exponents")
    _check(e.dtype == torch.int32, "flatcomm: exponents must be int32, got ", _sname(e.dtype))
    check_contiguous(e, "exponents")
    _check(e.numel() == ceil_div(n, block), "flatcomm: exponents has ", e.numel(), " entries but numel ", n,
           " with block_size ", block, " needs ", ceil_div(n, block))


def rows_of(x: torch.Tensor) -> Tuple[int, int]:
    _check(x.dim() in (1, 2), "flatcomm: expected a 1-D or 2-D [rows, n] tensor, got shape ", _sizes(x))
    return (x.shape[0] if x.dim() == 2 else 1), x.shape[-1]


# ---- the ops (csrc/ops_impl.h) --------------------------------------------------------------------

def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


class _Guard:
    def __init__(self, t: torch.Tensor) -> None:
        self.g = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self.g is not None:
            self.g.__enter__()

    def __exit__(self, *exc):
        if self.g is not None:
            self.g.__exit__(*exc)


class Ops:
    """The 14 flatcomm ops over a Launches; the same checks, allocations and argument structs as
    OpsImpl<B> in csrc/ops_impl.h."""

    def __init__(self, launches: Launches) -> None:
        self.k = launches

    @staticmethod
    def zero_padding(payload: torch.Tensor, c: int, n: int, block: int, k: int) -> None:
        lay = _C.wire_layout(c, n, block, k)
        co, total, head_end, data_end = lay["codes_offset"], lay["total"], lay["head_end"], lay["data_end"]
        if co > head_end:
            payload.narrow(0, head_end, co - head_end).zero_()
        if total > data_end:
            payload.narrow(0, data_end, total - data_end).zero_()

    def encode_into(self, x, codec, block_size, k, residual, stochastic, seed, payload) -> None:
        with _Guard(x):
            c = parse_codec(codec)
            dt = dtype_code(x.dtype, "x")
            check_contiguous(x, "x")
            check_residual(x, residual)
            check_stochastic(c, stochastic)
            n = x.numel()
            check_same_device(x, payload, "payload")
            check_payload(payload, 1, wire_bytes(c, n, block_size, k), codec, n)
            if n == 0:
                return
            self.zero_padding(payload, c, n, block_size, k)
            e = dict(x=_ptr(x), x_dtype=dt, residual=_ptr(residual), payload=_ptr(payload), n=n, codec=c,
                     block=block_size, k=k, stochastic=bool(stochastic), seed=seed & _MASK64, scratch=0)
            if c == TOPK:
                scratch = torch.empty(topk_scratch_layout(n)["total"], dtype=torch.uint8, device=x.device)
                e["scratch"] = _ptr(scratch)
                self.k.encode_topk(e)
            else:
                self.k.encode(e)

    def encode(self, x, codec, block_size, k, residual, stochastic, seed) -> torch.Tensor:
        with _Guard(x):
            c = parse_codec(codec)
            payload = torch.empty(wire_bytes(c, x.numel(), block_size, k), dtype=torch.uint8, device=x.device)
            self.encode_into(x, codec, block_size, k, residual, stochastic, seed, payload)
            return payload

    def decode_into(self, payload, codec, numel, block_size, k, out) -> None:
        with _Guard(payload):
            c = parse_codec(codec)
            odt = dtype_code(out.dtype, "out")
            check_payload(payload, 1, wire_bytes(c, numel, block_size, k), codec, numel)
            check_out(payload, out, numel, "out")
            self.k.decode(dict(payload=_ptr(payload), n=numel, codec=c, block=block_size, k=k, out=_ptr(out),
                               out_dtype=odt))

    def decode_rows_into(self, payloads, codec, row_numel, block_size, out) -> None:
        with _Guard(payloads):
            c, row_bytes = _C.decode_rows_layout(codec, row_numel, block_size)
            odt = dtype_code(out.dtype, "out")
            check_payload(payloads, 2, row_bytes, codec, row_numel)
            check_same_device(payloads, out, "out")
            check_contiguous(out, "out")
            _C.check_rows_cover(payloads.shape[0], row_numel, out.numel())
            self.k.decode_rows(dict(payloads=_ptr(payloads), row_stride=row_bytes, rows=payloads.shape[0],
                                    row_numel=row_numel, codec=c, block=block_size, out=_ptr(out), out_dtype=odt,
                                    n=out.numel()))

    def decode(self, payload, codec, numel, block_size, k, dtype) -> torch.Tensor:
        with _Guard(payload):
            dtype_code(dtype, "dtype")
            check_numel(numel)
            out = torch.empty(numel, dtype=dtype, device=payload.device)
            self.decode_into(payload, codec, numel, block_size, k, out)
            return out

    @staticmethod
    def _sum_args(payloads, c, n, block, k, scale, name) -> dict:
        check_payload(payloads, 2, wire_bytes(c, n, block, k), name, n)
        return dict(payloads=_ptr(payloads), row_stride=payloads.shape[1], rows=payloads.shape[0], n=n, codec=c,
                    block=block, k=k, scale=float(np.float32(scale)), out=0)

    def decode_sum_into(self, payloads, codec, numel, block_size, k, scale, out) -> None:
        with _Guard(payloads):
            c = parse_codec(codec)
            a = self._sum_args(payloads, c, numel, block_size, k, scale, codec)
            _check(out.dtype == torch.float32, "flatcomm: out must be float32, got ", _sname(out.dtype))
            check_out(payloads, out, numel, "out")
            a["out"] = _ptr(out)
            self.k.decode_sum(a)

    def decode_sum(self, payloads, codec, numel, block_size, k, scale) -> torch.Tensor:
        with _Guard(payloads):
            check_numel(numel)
            out = torch.empty(numel, dtype=torch.float32, device=payloads.device)
            self.decode_sum_into(payloads, codec, numel, block_size, k, scale, out)
            return out

    def decode_sum_encode_into(self, payloads, codec, numel, block_size, k, scale, out_codec, out_block_size,
                               residual, stochastic, seed, payload) -> None:
        with _Guard(payloads):
            c, oc = parse_codec(codec), parse_reencode_codec(out_codec)
            _check(c not in CHUNKED, "flatcomm: decode_sum_encode does not take ", codec,
                   " payloads yet; use decode_sum and encode")
            check_stochastic(oc, stochastic)
            a = self._sum_args(payloads, c, numel, block_size, k, scale, codec)
            if residual is not None:
                check_same_device(payloads, residual, "residual")
                _check(residual.dtype == torch.float32, "flatcomm: residual must be float32, got ",
                       _sname(residual.dtype))
                check_out(payloads, residual, numel, "residual")
            check_same_device(payloads, payload, "payload")
            check_payload(payload, 1, wire_bytes(oc, numel, out_block_size, 0), out_codec, numel)
            if numel == 0:
                return
            self.zero_padding(payload, oc, numel, out_block_size, 0)
            e = dict(x=0, x_dtype=F32, residual=_ptr(residual), payload=_ptr(payload), n=numel, codec=oc,
                     block=out_block_size, k=0, stochastic=bool(stochastic), seed=seed & _MASK64, scratch=0)
            self.k.decode_sum_encode(a, e)

    def decode_sum_encode(self, payloads, codec, numel, block_size, k, scale, out_codec, out_block_size,
                          residual, stochastic, seed) -> torch.Tensor:
        with _Guard(payloads):
            oc = parse_reencode_codec(out_codec)
            payload = torch.empty(wire_bytes(oc, numel, out_block_size, 0), dtype=torch.uint8,
                                  device=payloads.device)
            self.decode_sum_encode_into(payloads, codec, numel, block_size, k, scale, out_codec, out_block_size,
                                        residual, stochastic, seed, payload)
            return payload

    def ordered_sum(self, x) -> torch.Tensor:
        with _Guard(x):
            _check(x.dim() == 2, "flatcomm: ordered_sum expects a 2-D [rows, n] tensor, got shape ", _sizes(x))
            check_contiguous(x, "x")
            dt = dtype_code(x.dtype, "x")
            out = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
            self.k.ordered_sum(dict(x=_ptr(x), dtype=dt, rows=x.shape[0], row_stride=x.shape[1], n=x.shape[1],
                                    out=_ptr(out)))
            return out

    @staticmethod
    def _exact_args(x, block) -> dict:
        check_exact_block(block)
        check_contiguous(x, "x")
        rows, n = rows_of(x)
        return dict(x=_ptr(x), dtype=dtype_code(x.dtype, "x"), rows=rows, row_stride=n, n=n, block=block,
                    precision=0, exponents=0, fixed=0, out=0)

    def exact_exponents(self, x, block_size) -> torch.Tensor:
        with _Guard(x):
            a = self._exact_args(x, block_size)
            e = torch.empty(ceil_div(a["n"], block_size), dtype=torch.int32, device=x.device)
            a["exponents"] = _ptr(e)
            self.k.exact_exponents(a)
            return e

    def to_exact(self, x, exponents, block_size, headroom) -> torch.Tensor:
        with _Guard(x):
            _check(x.dim() == 1, "flatcomm: to_exact expects a 1-D tensor, got shape ", _sizes(x))
            a = self._exact_args(x, block_size)
            a["precision"] = precision_of(headroom)
            check_exponents(x, exponents, a["n"], block_size)
            a["exponents"] = _ptr(exponents)
            out = torch.empty(a["n"], dtype=torch.int64, device=x.device)
            a["fixed"] = _ptr(out)
            bad = torch.empty(1, dtype=torch.int64, device=x.device)
            self.k.to_fixed(a, _ptr(bad))
            # The overflow count stays on the device: an asynchronous assert, as the C++ op.
            torch._assert_async(bad.eq(0).squeeze(),
                                "flatcomm: to_exact: values exceed their block's exponent (take the exponents "
                                "from exact_exponents, reduced with MAX over all contributors)")
            return out

    def from_exact(self, acc, exponents, block_size, headroom) -> torch.Tensor:
        with _Guard(acc):
            check_exact_block(block_size)
            _check(acc.dtype == torch.int64 and acc.dim() == 1, "flatcomm: from_exact expects a 1-D int64 tensor, "
                   "got ", _sname(acc.dtype), " of shape ", _sizes(acc))
            check_contiguous(acc, "acc")
            n = acc.numel()
            check_exponents(acc, exponents, n, block_size)
            out = torch.empty(n, dtype=torch.float32, device=acc.device)
            self.k.from_fixed(dict(x=0, dtype=0, rows=0, row_stride=0, n=n, block=block_size,
                                   precision=precision_of(headroom), exponents=_ptr(exponents), fixed=_ptr(acc),
                                   out=_ptr(out)))
            return out

    def exact_sum(self, x, block_size, headroom) -> torch.Tensor:
        with _Guard(x):
            _check(x.dim() == 2, "flatcomm: exact_sum expects a 2-D [rows, n] tensor, got shape ", _sizes(x))
            a = self._exact_args(x, block_size)
            a["precision"] = precision_of(headroom)
            _check(a["rows"] <= (1 << headroom), "flatcomm: exact_sum of ", a["rows"],
                   " rows needs headroom >= log2(rows); got headroom ", headroom)
            out = torch.empty(a["n"], dtype=torch.float32, device=x.device)
            a["out"] = _ptr(out)
            self.k.exact_sum(a)
            return out


OP_NAMES = ("encode", "encode_into", "decode", "decode_into", "decode_rows_into", "decode_sum", "decode_sum_into",
            "decode_sum_encode", "decode_sum_encode_into", "ordered_sum", "exact_exponents", "to_exact",
            "from_exact", "exact_sum")
