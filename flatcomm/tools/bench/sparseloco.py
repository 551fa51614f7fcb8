"""SparseLoCo's outer sync as Templar runs it: the bench's baseline beside flatcomm's sparse codec (a tool).

Written from SparseLoCo's description (arXiv 2508.15706) and tplr-ai/templar's ``src/tplr/compress.py``
(the ``TopKCompressor`` and ``ChunkingTransformer`` without DCT), not from flatcomm's codecs:

* every ``sync_every`` inner steps, per parameter: the pseudo-gradient ``delta = master - weights``
  is added to a decayed error accumulator, ``e = error_decay * e + delta``;
* ``e`` is cut into chunks as Templar's ``ChunkingTransformer`` does: a matrix into tiles of
  ``h x w`` with ``h`` and ``w`` the largest divisors of its dimensions up to ``target_chunk`` (64:
  tiles of 4,096 values), a vector into runs of ``w`` values; per chunk the ``topk`` largest |e|
  (clamped to the chunk and made even, as Templar's ``_clamp_topk``) are kept;
* the kept values of a tensor are quantized to ``bins`` levels (4: 2 bits) as Templar's
  ``_quantize_values``: centred on their mean, ``scale = sigmas * sd / bins``, code =
  ``round(c / scale + bins // 2)`` clamped, decoded by a table of the bin means;
* ``e`` loses what was sent (the decoded values), the rest stays for later syncs;
* the wire: in-chunk indices packed at 12 bits (``pack_12bit_indices``), codes packed at 2 bits (the
  paper's format; Templar's code keeps one byte per code), and per tensor 6 fp32 (shift, scale,
  4-entry table); every replica's payload is all-gathered (a fixed size: ``all_gather_into_tensor``);
* every replica decodes every payload in rank order, clips each one's value norm to their median
  (``batch_decompress(clip_norm=True)``), and averages with ``scatter_reduce("mean",
  include_self=False)``: the mean over the replicas that sent the position;
* outer step without momentum: ``master -= outer_lr * mean``; the weights are set from the master.

Bytes a node sends per sync in a ring all-gather: ``(R - 1) x payload``, payload = sum over tensors of
``chunks x k x (12 + 2) / 8 + 24`` bytes (0.0273 B/param at 64 / 4,096 for the matrices).
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def largest_divisor_upto(n: int, cap: int) -> int:
    """The largest divisor of ``n`` not above ``cap`` (Templar's ``_get_smaller_split``; 1 for a prime
    ``n`` above ``cap``)."""
    if n <= cap:
        return n
    return max(d for d in range(1, cap + 1) if n % d == 0)


class Chunks:
    """How one parameter is cut into chunks: ``(rows, h, cols, w)`` tiles of a matrix (a tensor of more
    dimensions is viewed as ``shape[0] x rest``), ``(n / w, w)`` runs of a vector."""

    def __init__(self, shape: torch.Size, target: int, topk: int):
        if len(shape) >= 2:
            a, b = shape[0], int(torch.Size(shape[1:]).numel())
            self.h, self.w = largest_divisor_upto(a, target), largest_divisor_upto(b, target)
            self.grid: Tuple[int, ...] = (a // self.h, self.h, b // self.w, self.w)
        else:
            n = int(torch.Size(shape).numel())
            self.h, self.w = 1, largest_divisor_upto(n, target)
            self.grid = (n // self.w, self.w)
        self.shape, self.size = shape, self.h * self.w
        self.count = int(torch.Size(shape).numel()) // self.size
        k = max(2, min(topk, self.size))
        self.k = min(k - k % 2, self.size)  # even (12-bit pairs), as Templar's _clamp_topk

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the parameter's shape) -> ``(count, size)``."""
        if len(self.grid) == 4:
            return x.reshape(self.grid).permute(0, 2, 1, 3).reshape(self.count, self.size)
        return x.reshape(self.count, self.size)

    def join(self, c: torch.Tensor) -> torch.Tensor:
        """``(count, size)`` -> the parameter's shape."""
        if len(self.grid) == 4:
            y, h, x, w = self.grid
            return c.reshape(y, x, h, w).permute(0, 2, 1, 3).reshape(self.shape)
        return c.reshape(self.shape)

    def payload_bytes(self, bins: int) -> int:
        return sum(self.sizes(bins))

    def sizes(self, bins: int) -> List[int]:
        return _sizes(self.count * self.k, bins)


class FlatChunks(Chunks):
    """The whole model as one flat vector cut into runs of ``size`` values (the last one padded with
    zeros, dropped again by :meth:`join`): flatcomm's ``sparse`` chunking, for a comparison of the
    formats on the same chunks."""

    def __init__(self, numel: int, size: int, topk: int):
        self.numel, self.size, self.h, self.w = numel, size, 1, size
        self.count = -(-numel // size)
        self.shape = torch.Size([numel])
        k = max(2, min(topk, size))
        self.k = min(k - k % 2, size)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1)
        return torch.cat([x, x.new_zeros(self.count * self.size - self.numel)]).reshape(self.count, self.size)

    def join(self, c: torch.Tensor) -> torch.Tensor:
        return c.reshape(-1)[: self.numel]


def _sizes(n: int, bins: int) -> List[int]:
    """Bytes of ``n`` kept values' indices (12-bit pairs), codes and quantizer parameters."""
    return [3 * ((n + 1) // 2), (n * _bits(bins) + 7) // 8, 4 * (2 + bins)]


def _bits(bins: int) -> int:
    return max(1, (bins - 1).bit_length())


def pack12(idx: torch.Tensor) -> torch.Tensor:
    """Pairs of 12-bit indices into 3 bytes (Templar's layout: low byte of a, a's high nibble | b's low
    nibble << 4, high byte of b); an odd count (a chunk of one value) is padded with a zero."""
    i = idx.reshape(-1).to(torch.int32)
    i = torch.cat([i, i.new_zeros(i.numel() % 2)]).reshape(-1, 2)
    a, b = i[:, 0], i[:, 1]
    packed = torch.stack([a & 0xFF, ((a >> 8) & 0x0F) | ((b & 0x0F) << 4), (b >> 4) & 0xFF], 1)
    return packed.to(torch.uint8).reshape(-1)


def unpack12(packed: torch.Tensor, n: int) -> torch.Tensor:
    p = packed[: (n + 1) // 2 * 3].reshape(-1, 3).to(torch.int64)
    a = p[:, 0] | ((p[:, 1] & 0x0F) << 8)
    b = ((p[:, 1] >> 4) & 0x0F) | (p[:, 2] << 4)
    return torch.stack([a, b], 1).reshape(-1)[:n]


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``bits`` (1, 2, 4 or 8) bits, little end first in each byte."""
    per = 8 // bits
    q = q.reshape(-1).to(torch.int32)
    q = torch.cat([q, q.new_zeros((-q.numel()) % per)]).reshape(-1, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (q << shifts).sum(1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n].to(torch.int64)


def quantize(val: torch.Tensor, bins: int, sigmas: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Templar's ``_quantize_values``: codes and ``[shift, scale, table...]`` (fp32)."""
    shift = val.mean()
    c = val - shift
    sd = c.norm() / max(1.0, (c.numel() - 1)) ** 0.5
    scale = sigmas * sd / bins
    if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
        scale = torch.tensor(1.0)
    q = (c / scale + bins // 2).round().clamp(0, bins - 1).to(torch.int64)
    sums = torch.zeros(bins).scatter_add_(0, q, c)
    counts = torch.zeros(bins).scatter_add_(0, q, torch.ones_like(c))
    table = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums))
    return q, torch.cat([shift.reshape(1), scale.reshape(1), table]).float()


def dequantize(q: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    return params[2:][q] + params[0]


class SparseLoCo:
    """SparseLoCo's outer sync (Templar's format) on ``model`` trained by ``inner_optimizer``: hooks
    ``inner_optimizer.step()`` and syncs every ``sync_every`` inner steps (module docstring).

    Args:
        model: the replica (the same initial weights on every rank of ``group``).
        inner_optimizer: its torch optimizer.
        sync_every: inner steps between two syncs (H).
        topk: values kept per chunk (64).
        target_chunk: the tile side (64: 64 x 64 = 4,096 values per matrix chunk).
        bins: quantization levels (4: 2 bits).
        sigmas: the quantizer's range in standard deviations (6).
        error_decay: the error accumulator's decay (0.95).
        outer_lr: the outer step (1.0, no momentum).
        clip_norm: clip each replica's values to the median norm, as Templar's ``batch_decompress``.
        chunking: ``"tiles"`` (Templar's: per tensor, ``target_chunk`` x ``target_chunk`` tiles, runs of
            up to ``target_chunk`` for vectors) or ``"flat"`` (every parameter in one flat vector cut
            into runs of ``target_chunk ** 2`` values, as flatcomm's ``sparse``; one quantizer).
        group: the process group of the replicas (default: the world).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 topk: int = 64, target_chunk: int = 64, bins: int = 4, sigmas: float = 6.0,
                 error_decay: float = 0.95, outer_lr: float = 1.0, clip_norm: bool = True, chunking: str = "tiles",
                 group=None) -> None:
        if sync_every < 1 or bins not in (2, 4, 16, 256) or target_chunk < 1 or chunking not in ("tiles", "flat"):
            raise ValueError(f"SparseLoCo: sync_every >= 1, bins of 2, 4, 16 or 256, target_chunk >= 1 and chunking "
                             f"'tiles' or 'flat', got {sync_every}, {bins}, {target_chunk}, {chunking!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.h, self.bins, self.sigmas, self.flat = sync_every, bins, sigmas, chunking == "flat"
        self.decay, self.lr, self.clip_norm, self.group = error_decay, outer_lr, clip_norm, group
        if self.flat:
            self.chunks: List[Chunks] = [FlatChunks(sum(p.numel() for p in self.params), target_chunk ** 2, topk)]
        else:
            self.chunks = [Chunks(p.shape, target_chunk, topk) for p in self.params]
        self.master = [w.clone() for w in self._weights()]
        self.error = [torch.zeros_like(m) for m in self.master]
        self.payload_bytes = sum(c.payload_bytes(bins) for c in self.chunks)
        self.world = dist.get_world_size(group)
        self.step = self.syncs = self.wire_bytes = 0
        self.verify()  # every replica from the same weights
        self._hook = inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_inner_step())

    def _weights(self) -> List[torch.Tensor]:
        """The replica's weights now, in fp32: one tensor per parameter, or one flat one."""
        ws = [p.detach().float() for p in self.params]
        return [torch.cat([w.reshape(-1) for w in ws])] if self.flat else ws

    def _set_weights(self) -> None:
        if not self.flat:
            for p, m in zip(self.params, self.master):
                p.copy_(m)
            return
        off = 0
        for p in self.params:
            p.copy_(self.master[0][off: off + p.numel()].view_as(p))
            off += p.numel()

    def after_inner_step(self) -> None:
        self.step += 1
        if self.step % self.h == 0:
            self.sync()

    def close(self) -> None:
        self._hook.remove()

    @torch.no_grad()
    def encode(self) -> torch.Tensor:
        """This replica's payload (uint8) after the error accumulator's update; the error keeps what is
        not sent."""
        parts = []
        for w, m, e, ch in zip(self._weights(), self.master, self.error, self.chunks):
            e.mul_(self.decay).add_(m - w)
            x = ch.cut(e)
            idx = torch.topk(x.abs(), ch.k, dim=-1, largest=True, sorted=False).indices
            q, qp = quantize(torch.gather(x, 1, idx).reshape(-1), self.bins, self.sigmas)
            sent = torch.zeros_like(x).scatter_(1, idx, dequantize(q, qp).reshape(idx.shape))
            e.sub_(ch.join(sent))
            parts += [pack12(idx), pack_codes(q, _bits(self.bins)), qp.view(torch.uint8)]
        return torch.cat(parts)

    def decode_mean(self, payloads: torch.Tensor) -> List[torch.Tensor]:
        """Every replica's payload (rows of ``payloads``, rank order) decoded, norm-clipped to the
        median and averaged over the replicas that sent each position."""
        out, off = [], 0
        for ch in self.chunks:
            n = ch.count * ch.k
            sizes = ch.sizes(self.bins)
            idx, vals = [], []
            for row in payloads:
                a, b, c = torch.split(row[off: off + sum(sizes)], sizes)
                idx.append(unpack12(a, n).reshape(ch.count, ch.k))
                qp = c.clone().view(torch.float32)
                vals.append(dequantize(unpack_codes(b, n, _bits(self.bins)), qp).reshape(ch.count, ch.k))
            off += sum(sizes)
            if self.clip_norm:
                norms = torch.stack([v.norm() for v in vals])
                med = torch.median(norms)
                vals = [v * torch.clamp(med / (nv + 1e-8), max=1.0) for v, nv in zip(vals, norms)]
            agg = torch.zeros(ch.count, ch.size).scatter_reduce_(
                1, torch.cat(idx, 1), torch.cat(vals, 1), reduce="mean", include_self=False)
            out.append(ch.join(agg))
        return out

    @torch.no_grad()
    def sync(self) -> None:
        """Encode, all-gather every replica's payload, decode them all, the outer step."""
        mine = self.encode()
        assert mine.numel() == self.payload_bytes, (mine.numel(), self.payload_bytes)
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.uint8)
        _all_gather_single(gathered, mine, group=self.group)
        for m, d in zip(self.master, self.decode_mean(gathered.view(self.world, -1))):
            m.sub_(d, alpha=self.lr)
        self._set_weights()
        self.syncs += 1
        self.wire_bytes += (self.world - 1) * self.payload_bytes  # a ring all-gather: R - 1 payloads out

    def verify(self) -> None:
        """Raise unless every replica's master has the same bits."""
        h = hashlib.blake2b(digest_size=8)
        for m in self.master:
            h.update(m.numpy().tobytes())
        mine = torch.tensor([int.from_bytes(h.digest(), "little") >> 1], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        if len({int(t) for t in every}) != 1:
            raise RuntimeError(f"SparseLoCo: the replicas' masters differ: {[int(t) for t in every]}")

    @property
    def stats(self) -> Dict[str, Any]:
        return {"syncs": self.syncs, "inner_steps": self.step, "wire_bytes": self.wire_bytes,
                "payload_bytes": self.payload_bytes}


def nominal_bytes_per_param(model: torch.nn.Module, replicas: int, topk: int = 64, target_chunk: int = 64,
                            bins: int = 4, chunking: str = "tiles") -> float:
    """Bytes a node sends per parameter per sync (``(R - 1)`` payloads), from the format alone."""
    ps = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in ps)
    chunks = [FlatChunks(n, target_chunk ** 2, topk)] if chunking == "flat" else \
        [Chunks(p.shape, target_chunk, topk) for p in ps]
    return (replicas - 1) * sum(c.payload_bytes(bins) for c in chunks) / n


__all__ = ["SparseLoCo", "Chunks", "FlatChunks", "nominal_bytes_per_param", "pack12", "unpack12", "quantize",
           "dequantize",
           "largest_divisor_upto"]
