"""Gradient codecs: encode with fused error feedback, decode, and fused decode-and-sum.

Codecs: ``fp32``, ``bf16``, ``fp16`` (casts), ``int8``, ``int4`` (symmetric, one fp32 scale per
block), ``sign`` (1 bit per value, scale = mean |v| of the block), ``topk`` (the ``ratio`` share of
largest magnitudes, sent as uint32 index + fp32 value) and ``sparse`` / ``sparse4`` (the ``keep``
largest of every chunk of ``block_size`` values, positions Elias-Fano coded, values as a sign and a
1- or 3-bit level of a per-chunk table of mean magnitudes: csrc/core/sparse.h). An encoded payload is one contiguous uint8
tensor (scales and indices inline), so a single collective moves it; its size is ``wire_bytes``.

Non-finite values: if ``v = x + residual`` holds an inf or NaN in a block, every value of that block
decodes to NaN (an AMP GradScaler downstream sees the overflow) and the block's residual keeps its
previous value. Cast codecs and topk apply the rule per element (fp16 also overflows to inf above
65504, bf16 near the fp32 maximum).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Dict, Optional, Union, overload

import torch

from .codec_names import unknown_codec
from .native import extension, ops

__all__ = [
    "BLOCKWISE", "CODECS", "Codec", "CodecFacts", "CodecLike", "DEFAULT_BLOCK_SIZE", "DEFAULT_SPARSE_CHUNK",
    "DEFAULT_SPARSE_KEEP", "DEFAULT_TOPK_RATIO", "MAX_BLOCK", "MAX_NUMEL", "MAX_SPARSE_CHUNK", "MIN_BLOCK", "NOMINAL_REL_ERROR",
    "PRECISION", "STOCHASTIC", "TABLE", "WEIGHT_CODECS", "decode", "decode_rows",
    "decode_sum", "encode", "reencode_sum", "resolve", "wire_bytes"
]


@dataclasses.dataclass(frozen=True)
class CodecFacts:
    """One row of the codec table: what the kernels know of a codec (``csrc/core/dispatch.h``
    ``FLATCOMM_CODECS``, reported by ``_C.constants()``) and what the layers above decide about it
    (:data:`_POLICY`)."""

    name: str
    id: int  # its position in the C++ list; on the wire in the consistency check
    kind: str  # "cast", "scaled_int", "scaled_sign", "sparse" (topk) or "chunk_sparse" (sparse, sparse4)
    bits: int  # cast: per value; scaled and chunk_sparse: per code; sparse: per entry
    stochastic: bool  # encode takes stochastic=True
    dtype: Optional[torch.dtype]  # the dtype a cast codec stores, else None
    nominal_rel_error: Optional[float]  # for codec="auto" and the backoffs; None: never chosen
    weights: bool  # FSDP2 quantized weight all-gathers may use it


# The layers' decisions per codec, one row each. nominal_rel_error: ||x - decode(encode(x))|| / ||x||
# for Gaussian x with flatcomm's default blocks (absmax scaling: int8 step max/127, int4 max/7, sign
# at the block's mean magnitude: sqrt(1 - 2/pi)); only codecs with one are candidates of
# codec="auto" and the backoffs. weights: the decoded weights stay usable (sign and topk would
# replace them).
_POLICY: Dict[str, Dict[str, Any]] = {
    "fp32": {"nominal_rel_error": 0.0, "weights": True},
    "bf16": {"nominal_rel_error": 0.0023, "weights": True},
    "fp16": {"nominal_rel_error": None, "weights": True},
    "int8": {"nominal_rel_error": 0.0065, "weights": True},
    "int4": {"nominal_rel_error": 0.12, "weights": True},
    "sign": {"nominal_rel_error": 0.60, "weights": False},
    "topk": {"nominal_rel_error": None, "weights": False},
    "sparse": {"nominal_rel_error": None, "weights": False},
    "sparse4": {"nominal_rel_error": None, "weights": False},
    "sparse1": {"nominal_rel_error": None, "weights": False},
}


def _table() -> Dict[str, CodecFacts]:
    k = extension.constants()
    dtypes = {k["dtype_f32"]: torch.float32, k["dtype_bf16"]: torch.bfloat16, k["dtype_f16"]: torch.float16}
    missing = [row["name"] for row in k["codecs"] if row["name"] not in _POLICY]
    if missing:  # a codec added to the C++ list without its Python row (csrc/README.md, "Adding a codec")
        raise ImportError(f"flatcomm: codec(s) {', '.join(missing)} of the C++ list have no row in "
                          "flatcomm/ops/codecs.py _POLICY")
    return {row["name"]: CodecFacts(row["name"], row["id"], row["kind"], row["bits"], row["stochastic"],
                                    dtypes.get(row["dtype"]), **_POLICY[row["name"]])
            for row in k["codecs"]}


# The codec table, in the order of the C++ codec ids. Every codec list and property of the package
# comes from it: everything above imports them from here.
TABLE = _table()
CODECS = tuple(TABLE)
BLOCKWISE = tuple(c for c, f in TABLE.items() if f.kind in ("scaled_int", "scaled_sign"))  # one scale per block
# The codecs the auto-tuner and the backoffs choose from, most precise first.
_ERRORS: Dict[str, float] = {c: f.nominal_rel_error for c, f in TABLE.items() if f.nominal_rel_error is not None}
PRECISION = tuple(sorted(_ERRORS, key=_ERRORS.__getitem__))
NOMINAL_REL_ERROR = {c: _ERRORS[c] for c in PRECISION}
WEIGHT_CODECS = tuple(c for c, f in TABLE.items() if f.weights)  # fsdp.weights
STOCHASTIC = tuple(c for c, f in TABLE.items() if f.stochastic)
# The limits of the C++ core (csrc/core/codec.h), read from it: never copied by hand
# (tests/test_codec_table.py scans the sources for literal copies).
_LIMITS = extension.constants()
MIN_BLOCK: int = _LIMITS["min_block"]  # blockwise block sizes: multiples of MIN_BLOCK in [MIN_BLOCK, MAX_BLOCK]
MAX_BLOCK: int = _LIMITS["max_block"]  # (also the largest exact-mode block: csrc/ops_common.h)
# Shards of a non-blockwise codec start on multiples of this many values: the smallest block, so
# their payload pieces stay multiples of the core's 16-byte alignment for every cast dtype.
_CAST_ALIGN = MIN_BLOCK

# 256 values per scale: wire overhead 1.6% for int8 (4 B per 256 B), and fast on CPU (the block and
# its codes stay in L1). `python -m flatcomm.tools.bench.kernels --block-sizes` shows the trade-off measured.
DEFAULT_BLOCK_SIZE = 256
DEFAULT_TOPK_RATIO = 0.01
# Chunked sparse codecs (sparse, sparse4; csrc/core/sparse.h): chunks are multiples of MIN_BLOCK up to
# MAX_SPARSE_CHUNK (4,096: a position fits 12 bits). Default: SparseLoCo's production setting, the 64
# largest of every 4,096 values (1.56%).
MAX_SPARSE_CHUNK: int = _LIMITS["max_sparse_chunk"]
DEFAULT_SPARSE_CHUNK = MAX_SPARSE_CHUNK
DEFAULT_SPARSE_KEEP = 64
# Largest numel (csrc/core/codec.h kMaxNumel): every payload size below it fits in int64.
MAX_NUMEL: int = _LIMITS["max_numel"]


@dataclasses.dataclass(frozen=True)
class Codec:
    """A codec with its parameters. ``block_size`` is used by int8/int4/sign (default 256) and is
    the chunk of sparse/sparse4 (default 4096), ``ratio`` is used by topk, ``keep`` (values kept per
    chunk, default 64, or the chunk if smaller) by sparse/sparse4."""

    name: str
    block_size: int = None  # type: ignore[assignment]  # None: the codec's default
    ratio: float = DEFAULT_TOPK_RATIO
    # None: min(64, block_size) for sparse/sparse4. Not in repr: reprs of the other codecs (and the
    # checkpoint fingerprints made from them) stay as they were.
    keep: int = dataclasses.field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in CODECS:
            raise ValueError(unknown_codec(self.name, CODECS))
        if self.block_size is None:
            chunked = TABLE[self.name].kind == "chunk_sparse"
            object.__setattr__(self, "block_size", DEFAULT_SPARSE_CHUNK if chunked else DEFAULT_BLOCK_SIZE)
        if self.keep is None:
            bs = self.block_size if isinstance(self.block_size, numbers.Integral) else DEFAULT_SPARSE_KEEP
            object.__setattr__(self, "keep", min(DEFAULT_SPARSE_KEEP, int(bs)))
        if isinstance(self.keep, bool) or not isinstance(self.keep, numbers.Integral):
            raise TypeError(f"flatcomm: keep must be an int, got {self.keep!r}")
        object.__setattr__(self, "keep", int(self.keep))
        # Types first: a float block size would be truncated on its way to the kernels, a string
        # ratio would fail deep inside a comparison.
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, numbers.Integral):
            raise TypeError(f"flatcomm: block_size must be an int, got {self.block_size!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, numbers.Real):
            raise TypeError(f"flatcomm: topk ratio must be a number, got {self.ratio!r}")
        object.__setattr__(self, "block_size", int(self.block_size))
        object.__setattr__(self, "ratio", float(self.ratio))
        if self.name in BLOCKWISE and not (MIN_BLOCK <= self.block_size <= MAX_BLOCK
                                           and self.block_size % MIN_BLOCK == 0):
            raise ValueError(f"flatcomm: block_size must be a multiple of {MIN_BLOCK} in [{MIN_BLOCK}, "
                             f"{MAX_BLOCK}], got {self.block_size}")
        if self.sparse and not (0.0 < self.ratio <= 1.0):
            raise ValueError(f"flatcomm: topk ratio must be in (0, 1], got {self.ratio}")
        if self.chunked and not (MIN_BLOCK <= self.block_size <= MAX_SPARSE_CHUNK
                                 and self.block_size % MIN_BLOCK == 0):
            raise ValueError(f"flatcomm: {self.name} chunk (block_size) must be a multiple of {MIN_BLOCK} in "
                             f"[{MIN_BLOCK}, {MAX_SPARSE_CHUNK}], got {self.block_size}")
        if self.chunked and not 1 <= self.keep <= self.block_size:
            raise ValueError(f"flatcomm: {self.name} keep must be in [1, block_size={self.block_size}], got {self.keep}")

    @property
    def facts(self) -> CodecFacts:
        """This codec's row of :data:`TABLE`."""
        return TABLE[self.name]

    @property
    def lossless(self) -> bool:
        """Decoding gives back every fp32 value bit for bit (a cast to fp32)."""
        return self.facts.dtype == torch.float32

    @property
    def cast(self) -> bool:
        """The payload is the values themselves, cast to :attr:`dtype` (fp32, bf16, fp16)."""
        return self.facts.kind == "cast"

    @property
    def sparse(self) -> bool:
        """Sends a selection of the values, as index + value (topk)."""
        return self.facts.kind == "sparse"

    @property
    def chunked(self) -> bool:
        """Keeps the ``keep`` largest of every chunk of ``block_size`` values (sparse, sparse4)."""
        return self.facts.kind == "chunk_sparse"

    @property
    def blockwise(self) -> bool:
        """One scale per ``block_size`` values (int8, int4, sign)."""
        return self.name in BLOCKWISE

    @property
    def stochastic(self) -> bool:
        """``encode`` can round stochastically (``stochastic=True``)."""
        return self.facts.stochastic

    @property
    def for_weights(self) -> bool:
        """FSDP2 quantized weight all-gathers may use it (:data:`WEIGHT_CODECS`)."""
        return self.facts.weights

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The dtype a cast codec sends (its payload is the values themselves), else None."""
        return self.facts.dtype

    @property
    def align(self) -> int:
        """Shards and chunks start on multiples of this many values, so blocks line up with the
        whole tensor."""
        return self.block_size if self.blockwise or self.chunked else _CAST_ALIGN

    @property
    def precision(self) -> Optional[int]:
        """Rank in :data:`PRECISION` (0: most precise), None for codecs outside it (fp16, topk)."""
        return PRECISION.index(self.name) if self.name in PRECISION else None

    @property
    def reencodes_fused(self) -> bool:
        """A sum can be re-encoded in the fused decode-sum pass; topk and the chunked sparse codecs
        re-select on the whole reduced shard instead."""
        return not self.sparse and not self.chunked

    def k(self, numel: int) -> int:
        """Values kept by topk for ``numel`` inputs, per chunk by sparse/sparse4 (0 for other codecs)."""
        if self.chunked:
            return self.keep
        if not self.sparse or numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def wire_bytes(self, numel: int) -> int:
        # The C++ side checks the same bound; this one also covers numels beyond int64.
        if not 0 <= numel <= MAX_NUMEL:
            raise ValueError(f"flatcomm: numel must be in [0, 2^56], got {numel}")
        return extension.wire_bytes(self.name, numel, self.block_size, self.k(numel))


CodecLike = Union[str, Codec]
_NAMED: Dict[str, Codec] = {}  # resolve()'s Codec of each name (every call of a collective resolves one)


def resolve(codec: CodecLike, block_size: Optional[int] = None, ratio: Optional[float] = None,
            keep: Optional[int] = None) -> Codec:
    """A :class:`Codec` from a name or a Codec, with ``block_size`` / ``ratio`` / ``keep`` overriding."""
    if isinstance(codec, Codec):
        base = codec
    elif isinstance(codec, str):
        base = _NAMED.get(codec) or _NAMED.setdefault(codec, Codec(codec))  # (frozen: one per name)
    else:
        raise TypeError(f"flatcomm: codec must be a name or a Codec, got {type(codec).__name__}")
    if block_size is None and ratio is None and keep is None:
        return base
    return dataclasses.replace(
        base,
        block_size=base.block_size if block_size is None else block_size,  # checked, not truncated
        ratio=base.ratio if ratio is None else ratio,
        # a name's default keep follows the block size given here (min(64, block_size))
        keep=keep if keep is not None else (base.keep if isinstance(codec, Codec) else None),  # type: ignore[arg-type]
    )


def wire_bytes(codec: CodecLike, numel: int, *, block_size: Optional[int] = None,
               ratio: Optional[float] = None) -> int:
    """Bytes of the payload that ``encode`` produces for ``numel`` values (a multiple of 16)."""
    return resolve(codec, block_size, ratio).wire_bytes(numel)


def encode(
    x: torch.Tensor,
    codec: CodecLike,
    *,
    residual: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
    ratio: Optional[float] = None,
    stochastic: bool = False,
    seed: int = 0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode ``x`` (fp32/bf16/fp16, contiguous, any shape) into one uint8 payload.

    With ``residual`` (fp32, same numel) this is error feedback fused in one pass: it encodes
    ``v = x + residual`` and leaves ``residual = v - decode(payload)`` in place.
    ``stochastic`` (int8, int4, bf16) rounds up or down at random with a counter-based generator
    keyed by ``(seed, element index)``: the same bits for any thread count or device.
    With ``out`` (uint8, ``wire_bytes`` long) the payload is written there and returned.
    """
    c = resolve(codec, block_size, ratio)
    k = c.k(x.numel())
    if out is None:
        return ops.encode(x, c.name, c.block_size, k, residual, stochastic, int(seed))
    ops.encode_into(x, c.name, c.block_size, k, residual, stochastic, int(seed), out)
    return out


def decode(
    payload: torch.Tensor,
    codec: CodecLike,
    numel: int,
    *,
    block_size: Optional[int] = None,
    ratio: Optional[float] = None,
    dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode a payload back to ``numel`` values of ``dtype`` (a 1-D tensor).

    With ``out`` (contiguous, ``numel`` values, fp32/bf16/fp16) the values are written there.
    """
    c = resolve(codec, block_size, ratio)
    if out is None:
        return ops.decode(payload, c.name, numel, c.block_size, c.k(numel), dtype)
    ops.decode_into(payload, c.name, numel, c.block_size, c.k(numel), out)
    return out


def decode_rows(payloads: torch.Tensor, codec: CodecLike, row_numel: int, out: torch.Tensor, *,
                block_size: Optional[int] = None) -> torch.Tensor:
    """Decode a stack of payloads into consecutive stretches of ``out``, in one pass; returns ``out``.

    ``payloads`` is ``[R, wire_bytes(codec, row_numel)]`` uint8, each row a whole payload with its own
    block scales (the all-gathered shards of a weight, say). Row r fills
    ``out.view(-1)[r * row_numel : (r + 1) * row_numel]``, cut at the end of ``out``, whose numel must
    be in ``((R - 1) * row_numel, R * row_numel]``: values past it (the padding of the last shard) are
    not written. ``out`` is contiguous fp32, bf16 or fp16; its values are those of ``decode`` of each
    row in fp32, rounded to its dtype (nearest even). Any codec but topk.
    """
    c = resolve(codec, block_size)
    ops.decode_rows_into(payloads, c.name, int(row_numel), c.block_size, out)
    return out


@overload
def decode_sum(payloads: torch.Tensor, codec: CodecLike, numel: int, *, block_size: Optional[int] = ...,
               ratio: Optional[float] = ..., scale: float = ..., reencode: None = ...,
               residual: Optional[torch.Tensor] = ..., reencode_block_size: Optional[int] = ...,
               stochastic: bool = ..., seed: int = ..., out: Optional[torch.Tensor] = ...) -> torch.Tensor: ...
@overload
def decode_sum(payloads: torch.Tensor, codec: CodecLike, numel: int, *, block_size: Optional[int] = ...,
               ratio: Optional[float] = ..., scale: float = ..., reencode: CodecLike,
               residual: Optional[torch.Tensor] = ..., reencode_block_size: Optional[int] = ...,
               stochastic: bool = ..., seed: int = ..., out: Optional[torch.Tensor] = ...) -> torch.Tensor: ...


def decode_sum(
    payloads: torch.Tensor,
    codec: CodecLike,
    numel: int,
    *,
    block_size: Optional[int] = None,
    ratio: Optional[float] = None,
    scale: float = 1.0,
    reencode: Optional[CodecLike] = None,
    residual: Optional[torch.Tensor] = None,
    reencode_block_size: Optional[int] = None,
    stochastic: bool = False,
    seed: int = 0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode ``payloads`` ([W, nbytes], one row per source rank) and sum them in fp32.

    The sum runs in ascending row order for every element (``((d0 + d1) + d2) + ...``), then is
    multiplied once by ``scale``; the result is the same bits for any thread count. Without
    ``reencode`` it returns the fp32 sum ([numel]). With ``reencode`` (any codec but topk, sparse
    and sparse4: :attr:`Codec.reencodes_fused`) the sum
    is encoded again in the same pass, with error feedback into ``residual`` if given (the second
    stage of an all-reduce), and the new payload is returned. ``out`` receives the result
    (fp32 sum, or payload) instead of a new tensor.
    """
    c = resolve(codec, block_size, ratio)
    k = c.k(numel)
    if reencode is None:
        if residual is not None:
            raise ValueError("flatcomm: decode_sum got a residual but no reencode codec")
        if out is None:
            return ops.decode_sum(payloads, c.name, numel, c.block_size, k, float(scale))
        ops.decode_sum_into(payloads, c.name, numel, c.block_size, k, float(scale), out)
        return out
    second = resolve(reencode, reencode_block_size)
    if c.chunked:  # no fused pass over chunked sparse rows yet: the same result in two passes
        total = ops.decode_sum(payloads, c.name, numel, c.block_size, k, float(scale))
        return encode(total, second, residual=residual, stochastic=stochastic, seed=seed, out=out)
    args = (payloads, c.name, numel, c.block_size, k, float(scale), second.name,
            second.block_size, residual, stochastic, int(seed))
    if out is None:
        return ops.decode_sum_encode(*args)
    ops.decode_sum_encode_into(*args, out)
    return out


def reencode_sum(payloads: torch.Tensor, codec: CodecLike, numel: int, *, scale: float = 1.0,
                 residual: Optional[torch.Tensor] = None, out: torch.Tensor) -> torch.Tensor:
    """The second stage of an all-reduce: decode and sum ``payloads`` ([W, nbytes]) in row order,
    times ``scale``, and encode the sum again with ``codec`` into ``out`` (error feedback into
    ``residual``). In the fused pass where the codec allows (:attr:`Codec.reencodes_fused`); topk
    re-selects on the whole decoded sum instead."""
    c = resolve(codec)
    if c.reencodes_fused:
        return decode_sum(payloads, c, numel, scale=scale, reencode=c, residual=residual, out=out)
    return encode(decode_sum(payloads, c, numel, scale=scale), c, residual=residual, out=out)
