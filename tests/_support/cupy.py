"""The cupy path driven by a recording launcher (no GPU, no cupy): ops, payloads, and every kernel
launch of every op, codec and dtype."""
from __future__ import annotations

import ctypes

import torch

import flatcomm
from flatcomm.ops import cupy_backend as cb
from flatcomm.ops.codecs import CODECS

from .kernels import DTYPES


class Recorder:
    """Stands in for CupyLauncher: records launches; memsets really zero (the memory is host memory)."""

    def __init__(self) -> None:
        self.launches = []
        self.memsets = []

    def run(self, name, grid, threads, smem, args):
        self.launches.append((name, grid, threads, smem, args))

    def memset(self, ptr, nbytes):
        self.memsets.append((ptr, nbytes))
        ctypes.memset(ptr, 0, nbytes)


def make(rec=None):
    rec = rec or Recorder()
    return cb.make_ops(rec), rec


def k_of(codec, n, block=256):
    return flatcomm.resolve(codec, block, 0.3).k(n)  # topk's kept count, sparse's per chunk, else 0


def payloads(codec, n, rows=0, block=256):
    nb = flatcomm.wire_bytes(codec, n, block_size=block, ratio=0.3)
    return torch.zeros((rows, nb) if rows else (nb,), dtype=torch.uint8)


def record_all_launches():
    """Every op over every codec / dtype, recorded: covers all 132 kernel instances."""
    o, rec = make()
    n = 5000
    for dt in DTYPES:
        x = torch.randn(n).to(dt)
        r = torch.zeros(n)
        for c in CODECS:
            k = k_of(c, n)
            o.encode(x, c, 256, k, r, c in ("int8", "int4", "bf16"), 7)
            o.decode_into(payloads(c, n), c, n, 256, k, torch.empty(n, dtype=dt))
            if flatcomm.resolve(c).reencodes_fused:  # decode_rows refuses topk and the chunked codecs
                o.decode_rows_into(payloads(c, n, rows=3), c, n, 256, torch.empty(3 * n - 7, dtype=dt))
        X = x.reshape(2, -1).contiguous()
        o.ordered_sum(X)
        E = o.exact_exponents(X, 64)
        o.exact_sum(X, 64, 12)
        o.to_exact(torch.zeros(n, dtype=dt), torch.zeros(cb.ceil_div(n, 64), dtype=torch.int32), 64, 12)
    o.from_exact(torch.zeros(n, dtype=torch.int64), torch.zeros(cb.ceil_div(n, 64), dtype=torch.int32), 64, 12)
    for c in CODECS:
        k = k_of(c, n)
        P = payloads(c, n, rows=3)
        o.decode_sum(P, c, n, 256, k, 0.5)
        if not flatcomm.resolve(c).chunked:  # chunked rows: decode_sum, then encode
            for oc in (oc for oc in CODECS if flatcomm.resolve(oc).reencodes_fused):
                o.decode_sum_encode(P, c, n, 256, k, 1.0, oc, 128, torch.zeros(n), False, 3)
    return rec.launches
