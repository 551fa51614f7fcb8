"""The host side of csrc/cuda/kernels.cu for the cupy path: launch shapes and parameter packing
(see :mod:`flatcomm.ops.cupy_backend`)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

try:
    import numpy as np
except ImportError:  # cupy needs numpy: without it only the registration runs
    np = None  # type: ignore[assignment]

from .kernels import (
    CHUNKED, CODEC_IDS, DECODE_SUM_ARGS, DTYPES, ENCODE_PARAMS, EXACT_ARGS, F32, INT4, INT8, SIGN,
    K_CAST_TILE, K_REG_MAX_BLOCK, K_SCAN_THREADS, K_THREADS, K_TOPK_BINS, K_TOPK_CHUNK, K_TOPK_TILE, K_WARPS,
    MAX_BLOCK, MAX_SPARSE_CHUNK, MAX_TOPK_NUMEL, MIN_BLOCK, NON_TOPK, ORDERED_SUM_ARGS, STOCHASTIC, SUM_SOURCE, TOPK, X_SOURCE,
    al16, ceil_div, grid_for, is_blockwise, sparse_threads, k_encode, k_encode_sum, k_t, layout, pack, seed_key,
    topk_scratch_layout,
)

__all__ = [
    "Launch", "LaunchError", "Launches"
]

# ---- launches (the host side of csrc/cuda/kernels.cu) ---------------------------------------------

class LaunchError(RuntimeError):
    pass


Launch = Tuple[str, int, int, int, Tuple[object, ...]]  # kernel, grid, threads, shared bytes, args


class Launches:
    """The launches of kernels.cu, given raw device pointers. `run(kernel, grid, threads, smem,
    args)` launches one kernel and `memset(ptr, nbytes)` zeroes device memory, both on the current
    stream; the cupy launcher and the tests' recorder supply them. Invalid arguments (the kernels'
    own preconditions, normally caught by the op checks first) raise LaunchError, launching nothing."""

    def __init__(self, run: Callable[..., None], memset: Callable[[int, int], None]) -> None:
        self.run = run
        self.memset = memset

    @staticmethod
    def _valid_block(c: int, block: int) -> bool:
        return not is_blockwise(c) or (MIN_BLOCK <= block <= MAX_BLOCK and block % MIN_BLOCK == 0)

    @staticmethod
    def _valid_topk(n: int, k: int) -> bool:
        return 0 <= k <= n <= MAX_TOPK_NUMEL

    @staticmethod
    def _valid_sparse(c: int, block: int, k: int) -> bool:
        return c not in CHUNKED or (MIN_BLOCK <= block <= MAX_SPARSE_CHUNK and block % MIN_BLOCK == 0 and 1 <= k <= block)

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            raise LaunchError(f"flatcomm: CUDA {what} failed: invalid argument")

    def _run_encode(self, c: int, src_name: str, src: np.ndarray, e: dict, vec: bool,
                    rows: Optional[int] = None) -> None:
        """rows: the codec of decode_sum_encode's rows (None: encode, from x)."""
        co = layout(c, e["n"], e["block"], 0)[1]
        stochastic = bool(e["stochastic"]) and c in STOCHASTIC
        vec = vec and al16(e["payload"]) and (e["residual"] == 0 or al16(e["residual"]))
        # encode_kernel's register paths (device.cuh encode_in_registers): one warp per block, no
        # smem; int8/int4 (Src::kChunked) and sign (Src::kScalar) from x or non-topk rows
        regs = e["block"] <= K_REG_MAX_BLOCK and c in (INT8, INT4, SIGN) and rows != TOPK
        if is_blockwise(c):
            block, wpg = e["block"], 1 if regs else min(e["block"] // 32, K_WARPS)
        else:
            block, wpg = K_CAST_TILE, K_WARPS
        groups = K_WARPS // wpg
        p = pack(ENCODE_PARAMS, payload=e["payload"], residual=e["residual"], n=e["n"], block=block,
                 codes_offset=co, key=seed_key(e["seed"]), warps_per_group=wpg, groups=groups,
                 stochastic=stochastic, vec=vec)
        self.run(src_name, grid_for(ceil_div(e["n"], block), groups), K_THREADS, 0 if regs else groups * block * 4,
                 (p, src))

    def encode(self, e: dict) -> None:
        """e: x, x_dtype, residual, payload, n, codec, block, k, stochastic, seed, scratch."""
        if e["codec"] == TOPK:
            return self.encode_topk(e)
        self._check(e["x_dtype"] in DTYPES and e["codec"] in CODEC_IDS.values()
                    and self._valid_block(e["codec"], e["block"])
                    and self._valid_sparse(e["codec"], e["block"], e["k"]), "encode")
        if e["n"] <= 0:
            return
        if e["codec"] in CHUNKED:
            co = layout(e["codec"], e["n"], e["block"], e["k"])[1]
            self.run(k_t("sparse_encode_kernel", e["x_dtype"]), grid_for(ceil_div(e["n"], e["block"]), 1),
                     sparse_threads(e["block"]), 0, (np.uint64(e["x"]), np.uint64(e["residual"]), np.uint64(e["payload"]),
                                    np.int64(e["n"]), np.int32(e["codec"]), np.int64(e["block"]), np.int64(e["k"]),
                                    np.int64(co)))
            return
        self._run_encode(e["codec"], k_encode(e["codec"], e["x_dtype"]), pack(X_SOURCE, x=e["x"]), e,
                         al16(e["x"]))

    def encode_topk(self, e: dict) -> None:
        n, k = e["n"], e["k"]
        self._check(e["codec"] == TOPK and e["x_dtype"] in DTYPES and self._valid_topk(n, k), "encode (topk)")
        if n == 0:
            return
        self._check(e["scratch"] != 0 and al16(e["scratch"]), "encode (topk)")
        sl = topk_scratch_layout(n)
        base = e["scratch"]
        v, hist, st, counts, cand = (base + sl[part] for part in ("v", "hist", "state", "counts", "cand"))
        nchunks = ceil_div(n, K_TOPK_CHUNK)
        self.memset(hist, sl["counts"] - sl["hist"])
        vec = al16(e["x"]) and (e["residual"] == 0 or al16(e["residual"]))
        hist_grid = min(grid_for(n, 4 * K_THREADS), 1024)
        I64, U64, I32 = np.int64, np.uint64, np.int32
        h = [U64(hist + p * K_TOPK_BINS * 8) for p in range(3)]
        # kernels.cu encode_topk: pass 0 over v, then the candidates (values in the selected first
        # digit) only, then the ordered compaction
        self.run(k_t("topk_fill_kernel", e["x_dtype"]), hist_grid, K_THREADS, 0,
                 (U64(e["x"]), U64(e["residual"]), I64(n), U64(v), h[0], np.bool_(vec)))
        self.run(k_t("topk_select_kernel"), 1, K_THREADS, 0, (h[0], I32(0), I64(k), U64(st)))
        self.run(k_t("topk_compact_kernel"), grid_for(nchunks, 1), K_THREADS, 0,
                 (U64(v), I64(n), U64(st), U64(counts), U64(cand), h[1]))
        self.run(k_t("topk_select_kernel"), 1, K_THREADS, 0, (h[1], I32(1), I64(k), U64(st)))
        self.run(k_t("topk_cand_hist_kernel"), hist_grid, K_THREADS, 0, (U64(v), U64(st), U64(cand), h[2]))
        self.run(k_t("topk_select_kernel"), 1, K_THREADS, 0, (h[2], I32(2), I64(k), U64(st)))
        self.run(k_t("topk_cand_count_kernel"), hist_grid, K_THREADS, 0, (U64(v), U64(st), U64(cand), U64(counts)))
        self.run(k_t("topk_scan_kernel"), 1, K_SCAN_THREADS, 0, (U64(counts), I64(nchunks)))
        co = layout(TOPK, n, 0, k)[1]
        self.run(k_t("topk_write_kernel"), grid_for(nchunks, 1), K_THREADS, 0,
                 (U64(v), I64(n), U64(st), U64(counts), U64(e["payload"]), U64(e["payload"] + co),
                  U64(e["residual"])))

    def decode(self, d: dict) -> None:
        """d: payload, n, codec, block, k, out, out_dtype."""
        c, n = d["codec"], d["n"]
        self._check(d["out_dtype"] in DTYPES and c in CODEC_IDS.values() and self._valid_block(c, d["block"])
                    and (c != TOPK or self._valid_topk(n, d["k"])) and self._valid_sparse(c, d["block"], d["k"]),
                    "decode")
        if n <= 0:
            return
        co = layout(c, n, d["block"], d["k"])[1]
        I64, U64 = np.int64, np.uint64
        if c == TOPK:
            self.run(k_t("topk_decode_kernel", d["out_dtype"]), grid_for(n, K_TOPK_TILE), K_THREADS, 0,
                     (U64(d["payload"]), I64(0), I64(1), I64(n), I64(d["k"]), I64(co), np.float32(1.0),
                      U64(d["out"])))
        elif c in CHUNKED:
            self.run(k_t("sparse_decode_kernel", d["out_dtype"]), grid_for(ceil_div(n, d["block"]), 1),
                     sparse_threads(d["block"]), 0, (U64(d["payload"]), I64(0), I64(1), I64(n), np.int32(c), I64(d["block"]),
                                    I64(d["k"]), I64(co), np.float32(1.0), U64(d["out"])))
        else:
            vec = al16(d["payload"]) and al16(d["out"])
            self.run(k_t("decode_kernel", c, d["out_dtype"]), grid_for(n, 16 * K_THREADS), K_THREADS, 0,
                     (U64(d["payload"]), I64(co), I64(d["block"]), I64(n), U64(d["out"]), np.bool_(vec)))

    def decode_rows(self, d: dict) -> None:
        """d: the fields of DecodeRowsArgs."""
        c, m, n = d["codec"], d["row_numel"], d["n"]
        self._check(d["out_dtype"] in DTYPES and c in NON_TOPK and self._valid_block(c, d["block"]) and m >= 1
                    and d["rows"] >= 1 and n >= 1 and ceil_div(n, m) == d["rows"], "decode_rows")
        co = layout(c, m, d["block"], 0)[1]
        vec = (al16(d["payloads"]) and d["row_stride"] % 16 == 0 and al16(d["out"])
               and (m * self._esize(d["out_dtype"])) % 16 == 0)
        I64, U64 = np.int64, np.uint64
        self.run(k_t("decode_rows_kernel", c, d["out_dtype"]), grid_for(d["rows"] * ceil_div(m, 4), K_THREADS),
                 K_THREADS, 0, (U64(d["payloads"]), I64(d["row_stride"]), I64(d["rows"]), I64(m), I64(n), I64(co),
                                I64(d["block"]), U64(d["out"]), np.bool_(vec)))

    def _check_sum(self, a: dict, what: str) -> None:
        c = a["codec"]
        self._check(c in CODEC_IDS.values() and self._valid_block(c, a["block"]) and a["rows"] >= 0
                    and (c != TOPK or self._valid_topk(a["n"], a["k"]))
                    and self._valid_sparse(c, a["block"], a["k"]), what)

    @staticmethod
    def _rows_aligned(a: dict) -> bool:
        return al16(a["payloads"]) and a["row_stride"] % 16 == 0

    def decode_sum(self, a: dict) -> None:
        """a: the fields of DecodeSumArgs."""
        self._check_sum(a, "decode_sum")
        if a["n"] <= 0:
            return
        c, n = a["codec"], a["n"]
        co = layout(c, n, a["block"], a["k"])[1]
        I64, U64 = np.int64, np.uint64
        if c == TOPK:
            self.run(k_t("topk_decode_kernel", F32), grid_for(n, K_TOPK_TILE), K_THREADS, 0,
                     (U64(a["payloads"]), I64(a["row_stride"]), I64(a["rows"]), I64(n), I64(a["k"]), I64(co),
                      np.float32(a["scale"]), U64(a["out"])))
        elif c in CHUNKED:
            self.run(k_t("sparse_decode_kernel", F32), grid_for(ceil_div(n, a["block"]), 1), sparse_threads(a["block"]), 0,
                     (U64(a["payloads"]), I64(a["row_stride"]), I64(a["rows"]), I64(n), np.int32(c), I64(a["block"]),
                      I64(a["k"]), I64(co), np.float32(a["scale"]), U64(a["out"])))
        else:
            vec = self._rows_aligned(a) and al16(a["out"])
            self.run(k_t("decode_sum_kernel", c), grid_for(n, 16 * K_THREADS), K_THREADS, 0,
                     (pack(DECODE_SUM_ARGS, **a), I64(co), np.bool_(vec)))

    def decode_sum_encode(self, a: dict, e: dict) -> None:
        self._check_sum(a, "decode_sum_encode")
        self._check(a["codec"] not in CHUNKED, "decode_sum_encode")
        self._check(e["codec"] in NON_TOPK and self._valid_block(e["codec"], e["block"]) and e["n"] == a["n"],
                    "decode_sum_encode")
        if a["n"] <= 0:
            return
        co = layout(a["codec"], a["n"], a["block"], a["k"])[1]
        src = pack(SUM_SOURCE, codes_offset=co)
        for k, v in a.items():
            src["a"][k] = v
        self._run_encode(e["codec"], k_encode_sum(e["codec"], a["codec"]), src, e, self._rows_aligned(a),
                         rows=a["codec"])

    @staticmethod
    def _esize(dt: int) -> int:
        return 4 if dt == F32 else 2

    def ordered_sum(self, a: dict) -> None:
        self._check(a["dtype"] in DTYPES and a["rows"] >= 0, "ordered_sum")
        if a["n"] <= 0:
            return
        vec = al16(a["x"]) and (a["row_stride"] * self._esize(a["dtype"])) % 16 == 0 and al16(a["out"])
        self.run(k_t("ordered_sum_kernel", a["dtype"]), grid_for(a["n"], 4 * K_THREADS), K_THREADS, 0,
                 (pack(ORDERED_SUM_ARGS, **a), np.bool_(vec)))

    def _exact_x_aligned(self, a: dict) -> bool:
        return al16(a["x"]) and (a["row_stride"] * self._esize(a["dtype"])) % 16 == 0 and a["block"] % 4 == 0

    def exact_exponents(self, a: dict) -> None:
        self._check(a["dtype"] in DTYPES and a["block"] > 0 and a["rows"] >= 0, "exact_exponents")
        if a["n"] <= 0:
            return
        self.run(k_t("exact_exponents_kernel", a["dtype"]), grid_for(ceil_div(a["n"], a["block"]), K_WARPS),
                 K_THREADS, 0, (pack(EXACT_ARGS, **a), np.bool_(self._exact_x_aligned(a))))

    def to_fixed(self, a: dict, bad: int) -> None:
        """bad: device int64 counter, cleared here, then the number of values over their exponent."""
        self._check(a["dtype"] in DTYPES and a["block"] > 0 and bad != 0, "to_exact")
        self.memset(bad, 8)
        if a["n"] <= 0:
            return
        vec = al16(a["x"]) and al16(a["fixed"])
        self.run(k_t("to_fixed_kernel", a["dtype"]), grid_for(a["n"], 4 * K_THREADS), K_THREADS, 0,
                 (pack(EXACT_ARGS, **a), np.uint64(bad), np.bool_(vec)))

    def from_fixed(self, a: dict) -> None:
        self._check(a["block"] > 0, "from_exact")
        if a["n"] <= 0:
            return
        vec = al16(a["fixed"]) and al16(a["out"])
        self.run(k_t("from_fixed_kernel"), grid_for(a["n"], 4 * K_THREADS), K_THREADS, 0,
                 (pack(EXACT_ARGS, **a), np.bool_(vec)))

    def exact_sum(self, a: dict) -> None:
        self._check(a["dtype"] in DTYPES and a["block"] > 0 and a["rows"] >= 0, "exact_sum")
        if a["n"] <= 0:
            return
        vec = self._exact_x_aligned(a) and al16(a["out"])
        self.run(k_t("exact_sum_kernel", a["dtype"]), grid_for(ceil_div(a["n"], a["block"]), K_WARPS),
                 K_THREADS, 0, (pack(EXACT_ARGS, **a), np.bool_(vec)))
