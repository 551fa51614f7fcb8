"""The handshake that makes version skew a clear error instead of an abort inside gloo.

Every call header (:mod:`flatcomm.comm.header`) is a row of a length fixed by the fields, the
reason bytes and the payload slot of *this* flatcomm; gloo's all-gather of rows of different
lengths aborts the receiving process ("Received data size doesn't match expected size"). So when
flatcomm makes a group's private copy, before any header travels, the members all-gather a row of
:data:`WORDS` values whose length never changes: a magic, :data:`WIRE_VERSION` and a hash of the
package's version. Any difference raises the same error on every member, naming who runs what.

Bump :data:`WIRE_VERSION` with any change to a header's row or a payload's format
(``tests/test_wire.py`` pins the row's layout to it).
"""
from __future__ import annotations

import zlib
from typing import List, Optional

import torch

from .._version import __version__

__all__ = ["WIRE_VERSION", "WORDS", "handshake", "row"]

MAGIC = 0x66637769  # "fcwi"
WIRE_VERSION = 3  # 3: a header's count of agreed plans is 1 + the count (0: none)
WORDS = 4  # never changes: a row of another length is the abort this handshake exists to prevent


def row(version: int = WIRE_VERSION, package: str = __version__) -> torch.Tensor:
    """This process's handshake row."""
    return torch.tensor([MAGIC, version, zlib.crc32(package.encode()), 0], dtype=torch.int64)


def _device(pg) -> torch.device:
    try:
        pg._get_backend(torch.device("cpu"))
        return torch.device("cpu")
    except Exception:  # noqa: BLE001 - e.g. an NCCL-only group: its rows travel on the device
        return torch.device("cuda", torch.cuda.current_device())


def handshake(pg, size: int, mine: Optional[torch.Tensor] = None) -> None:
    """All-gather the members' rows on ``pg`` (``size`` members; blocking, bounded by ``pg``'s own
    timeout) and raise on every member unless all are equal. ``mine``: this member's row (tests)."""
    mine = (row() if mine is None else mine).to(_device(pg))
    table = torch.empty(size * WORDS, dtype=torch.int64, device=mine.device)
    pg.all_gather_single(table, mine).wait()
    rows: List[List[int]] = table.view(size, WORDS).tolist()
    if all(r == rows[0] for r in rows):
        return
    seen = "; ".join(f"rank {k}: {_shown(r)}" for k, r in enumerate(rows))
    raise RuntimeError(f"flatcomm: the ranks of a group run flatcomm versions whose messages differ ({seen}): "
                       f"install the same flatcomm on every rank")


def _shown(r: List[int]) -> str:
    if r[0] != MAGIC:
        return "not flatcomm's handshake (an older flatcomm, or another program)"
    return f"wire version {r[1]}, package version hash {r[2]:08x}"
