"""A quantized FSDP2 weight: the sharded parameter's local tensor whose all-gather sends an encoded
payload (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), and the one-pass decode of the
gathered rows. What is quantized and why: :mod:`flatcomm.fsdp.weights`."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from ..ops.codecs import Codec, decode_rows, encode

__all__ = ["QuantizedWeight", "decode_rows_into"]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one parameter's shard is encoded: ``row_numel`` values per rank (the dim-0-padded
    shard), ``numel`` values unsharded."""
    codec: Codec
    row_numel: int
    numel: int
    name: str

    @property
    def row_bytes(self) -> int:
        return self.codec.wire_bytes(self.row_numel)


def decode_rows_into(payloads: torch.Tensor, codec: Codec, row_numel: int, out: torch.Tensor) -> None:
    """Decode row ``r`` of ``payloads`` ([R, B] uint8, one self-contained payload of ``row_numel``
    values per rank) into ``out[r*row_numel : min((r+1)*row_numel, out.numel())]`` (1-D,
    fp32/bf16/fp16), in one pass (``flatcomm.ops.decode_rows``). Rows wholly past the end of
    ``out`` (ranks that hold only padding of a short parameter) are not read."""
    used = -(-out.numel() // row_numel)
    decode_rows(payloads[:used], codec, row_numel, out)


class QuantizedWeight(torch.Tensor):
    """A sharded parameter's local tensor (the same storage) whose FSDP2 all-gather sends an encoded
    payload (see the module docstring). Every op on it returns a plain tensor."""

    _fc_spec: _Spec
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __new__(cls, local: torch.Tensor, spec: _Spec) -> "QuantizedWeight":
        t = torch.Tensor._make_subclass(cls, local, local.requires_grad)
        t._fc_spec = spec
        return t

    def __deepcopy__(self, memo: Dict[int, Any]) -> "QuantizedWeight":
        out = QuantizedWeight(self.detach().clone(), self._fc_spec)  # copy.deepcopy(model) keeps the wrapping
        memo[id(self)] = out
        return out

    def fsdp_pre_all_gather(self, mesh: Any) -> Tuple[Tuple[torch.Tensor, ...], Any]:
        s = self._fc_spec
        flat = self.reshape(-1)
        if flat.numel() < s.row_numel:  # a dim-0-padded shard: the padding rows are zeros
            flat = torch.cat([flat, flat.new_zeros(s.row_numel - flat.numel())])
        return (encode(flat, s.codec),), None

    def fsdp_post_all_gather(self, all_gather_outputs: Tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None):
        s = self._fc_spec
        (data,) = all_gather_outputs
        if data.dtype != torch.uint8 or data.numel() % s.row_bytes != 0:
            raise RuntimeError(f"flatcomm: parameter {s.name!r}: gathered {data.numel()} {data.dtype} values, "
                               f"not whole payloads of {s.row_bytes} bytes")
        rows = data.view(-1, s.row_bytes)
        if rows.shape[0] * s.row_numel < s.numel:
            raise RuntimeError(f"flatcomm: parameter {s.name!r}: {rows.shape[0]} pieces of {s.row_numel} values "
                               f"cannot hold its {s.numel}")
        if out is not None:
            # FSDP re-fills the same parameter every gather; autograd saved it in forward, so the
            # version must not move (FSDP's own copy-out does the same).
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                decode_rows_into(rows, s.codec, s.row_numel, out.view(-1))
            return None
        full = torch.empty(s.numel, dtype=param_dtype, device=data.device)
        decode_rows_into(rows, s.codec, s.row_numel, full)
        return full, (full,)
