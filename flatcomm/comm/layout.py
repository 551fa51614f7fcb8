"""The layout of a collective, with no process group: shards across ranks and chunks within shards
(:class:`Plan`), the automatic chunk count, and the :class:`CommStats` a call adds to. The pipeline
that runs a plan chunk by chunk is :mod:`flatcomm.comm.pipeline`'s."""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from .shards import shard_bounds
from ..ops.codecs import Codec

__all__ = ["CHUNK_TARGET_BYTES", "CommStats", "LOSSLESS_CHUNK_TARGET_BYTES", "MAX_AUTO_CHUNKS", "MIN_PIPELINE_BYTES",
           "Plan", "default_chunks", "plan", "sends_raw"]

# The automatic chunk count aims at about CHUNK_TARGET_BYTES of payload per shard and chunk, and
# pipelines (at least 2 chunks) from MIN_PIPELINE_BYTES on (measurements: docs/benchmarks.md).
# A lossless payload (fp32 ordered or exact) has no encode to hide behind the wire, and every chunk
# costs its transfers' set-up: 4 MB pieces (16.8 MB ordered on loopback, 2 ranks: 1.17x gloo's
# time, 1.55x with 1 MB pieces; on a 1 Gbit/s link within 1%, exact mode faster).
CHUNK_TARGET_BYTES = 1 << 20
LOSSLESS_CHUNK_TARGET_BYTES = 4 << 20
MIN_PIPELINE_BYTES = 512 << 10
MAX_AUTO_CHUNKS = 16


@dataclasses.dataclass
class CommStats:
    """Counters a collective adds to (pass one in, read it after). The times are host seconds:
    with CUDA tensors, of enqueueing the work (the GPU runs it later; ``exchange_s`` is ~0)."""

    calls: int = 0
    wire_bytes: int = 0  # bytes this rank put on the wire
    encode_s: float = 0.0
    exchange_s: float = 0.0  # time spent waiting for the network
    decode_s: float = 0.0

    def add(self, other: "CommStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _auto_chunks(numel: int, codec: Codec, mode: str) -> int:
    wire = 4 * numel if mode == "exact" else codec.wire_bytes(numel)  # exact: the fp32 values
    if wire < MIN_PIPELINE_BYTES:
        return 1
    target = LOSSLESS_CHUNK_TARGET_BYTES if mode == "exact" or codec.lossless else CHUNK_TARGET_BYTES
    return int(min(MAX_AUTO_CHUNKS, max(2, round(wire / target))))


def sends_raw(codec: Codec, dtype: torch.dtype, mode: str) -> bool:
    """The payload of ``codec`` is the input's own bytes (fp32 codec on fp32 data, ...)."""
    return mode == "ordered" and codec.dtype == dtype


def default_chunks(numel: int, codec: Codec, world: int, mode: str, dtype: torch.dtype,
                   kind: str = "all_reduce") -> int:
    """The chunk count a collective picks for a shard of ``numel`` values."""
    # A reduce-scatter of raw payloads sends the caller's tensor itself (no staging copy), which
    # needs one chunk: a chunk's pieces for all destinations must be one contiguous range. On a
    # slow link more chunks win: pass chunks= or codec="auto" there.
    if kind == "reduce_scatter" and sends_raw(codec, dtype, mode):
        return 1
    return _auto_chunks(numel, codec, mode)


@dataclasses.dataclass
class Plan:
    world: int
    rank: int
    bounds: List[int]          # shard boundaries (world + 1)
    chunk_bounds: List[List[int]]  # per shard, chunk boundaries relative to the shard start

    def piece(self, shard: int, chunk: int) -> Tuple[int, int]:
        base = self.bounds[shard]
        cb = self.chunk_bounds[shard]
        return base + cb[chunk], base + cb[chunk + 1]


def plan(bounds: List[int], chunks: int, align: int, rank: int) -> Plan:
    world = len(bounds) - 1
    cbs = [shard_bounds(bounds[d + 1] - bounds[d], chunks, align) for d in range(world)]
    return Plan(world, rank, bounds, cbs)
