"""The fields of a call header (:mod:`flatcomm.comm.header`), with no process group: which fields a
row carries, in which order (:class:`HeaderFields`, the one list of them), and the tables their
values index (the collective kinds, modes, dtypes, device types). Every layer that writes or reads
a field takes its name and ids from here: the signature builder (:mod:`flatcomm.comm.signature`),
the header's check and its messages, and the agreed plans (:mod:`flatcomm.comm.agreed`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Tuple

import torch

from ..ops.codecs import CODECS

__all__ = ["ALL_DTYPES", "AUTO_CODEC", "DEVICE_TYPES", "DTYPES", "FIELDS", "HeaderFields", "KINDS", "KIND_IDS", "MODES",
           "name", "pairs"]

MODES = ("ordered", "exact")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone")
KINDS = {1: "reduce_scatter", 2: "all_gather", 3: "all_reduce",
         4: "two-level reduce_scatter", 5: "two-level all_gather", 6: "two-level all_reduce"}
KIND_IDS = {name: kind for kind, name in KINDS.items()}  # the one place a collective's id comes from
AUTO_CODEC = len(CODECS)  # the codec field of a two-level call whose inter codec is "auto"
# Every dtype a call header can name: flatcomm's own first (their index is the signature's dtype), then
# those of the reductions the flatcomm backend passes through (each checked by a header too).
ALL_DTYPES = DTYPES + (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                       torch.complex64, torch.complex128)


class HeaderFields(NamedTuple):
    """The fields of every call, in a row's order (a failed call sends only the first and zeros), as
    int64s; a field a call does not set is 0. The float fields travel as their float64 bits
    (:func:`flatcomm.comm.header_table.float_bits`); the intra fields are the two-level path's;
    ``reduce_op`` is a reduction the flatcomm backend passes through; ``agreed_plans`` a row's count
    of plans (:func:`flatcomm.comm.agreed.count_field`)."""

    collective: int = 0
    numel: int = 0
    codec: int = 0
    block_size: int = 0
    topk_ratio: int = 0
    mode: int = 0
    op_scale: int = 0
    dtype: int = 0
    chunks: int = 0
    exact_block: int = 0
    headroom: int = 0
    device: int = 0
    intra_codec: int = 0
    intra_block_size: int = 0
    intra_topk_ratio: int = 0
    reduce_op: int = 0
    agreed_plans: int = 0

    @classmethod
    def of(cls, fields: Iterable[Tuple[str, int]]) -> "HeaderFields":
        """The record of ``(name, value)`` pairs, names as :data:`FIELDS` spells them."""
        return cls(**{_ATTRIBUTES[name]: int(value) for name, value in fields})


# A field's name in the (name, value) pairs a call's fields are built of and in the header's
# messages ("ranks disagree on topk ratio"): its attribute's, with a space where these have one.
_SPELLED = {"topk_ratio": "topk ratio", "op_scale": "op scale", "intra_codec": "intra codec",
            "intra_block_size": "intra block_size", "intra_topk_ratio": "intra topk ratio", "reduce_op": "reduce op",
            "agreed_plans": "agreed plans"}
FIELDS: Tuple[str, ...] = tuple(_SPELLED.get(a, a) for a in HeaderFields._fields)
_ATTRIBUTES: Dict[str, str] = dict(zip(FIELDS, HeaderFields._fields))


def name(attribute: str) -> str:
    """The name (as :data:`FIELDS` spells it) of the :class:`HeaderFields` field ``attribute``."""
    return FIELDS[HeaderFields._fields.index(attribute)]


def pairs(**values: int) -> List[Tuple[str, int]]:
    """The ``(name, value)`` pairs a call's fields are built of, given by :class:`HeaderFields`
    attribute in the caller's order (a name the record lacks raises: no field is spelled twice)."""
    unknown = sorted(set(values) - set(HeaderFields._fields))
    if unknown:
        raise KeyError(f"flatcomm: no call header field {unknown}")
    return [(name(a), int(v)) for a, v in values.items()]
