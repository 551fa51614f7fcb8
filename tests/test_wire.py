"""The wire handshake (flatcomm.comm.wire): ranks whose flatcomm would send rows of different
layouts fail with the same clear error on every rank when flatcomm makes the group's private copy,
instead of one of them aborting inside gloo at the first call header of another length."""
from __future__ import annotations

import hashlib

import pytest
import torch

from flatcomm.comm import header, header_table, wire
from flatcomm.tools import spawn

# The row layout that WIRE_VERSION names. A change to the header's fields, reason bytes or slot
# changes this: bump wire.WIRE_VERSION and write the new pair here.
LAYOUTS = {3: "faa92f3b2f59"}


def _layout() -> str:
    desc = repr((header.FIELDS, header_table.REASON_BYTES, header_table._FIXED, header_table.MAGIC,
                 header.SLOT_MAX_BYTES, header.SLOT_TABLE_BYTES, header.KINDS))
    return hashlib.sha256(desc.encode()).hexdigest()[:12]


def test_the_header_layout_is_the_one_its_wire_version_names():
    assert LAYOUTS.get(wire.WIRE_VERSION) == _layout(), (
        f"the call header's layout changed ({_layout()}): bump flatcomm.comm.wire.WIRE_VERSION and pin it here")


def test_a_handshake_row_has_a_fixed_length():
    assert wire.row().shape == (wire.WORDS,) == (4,)
    assert wire.row(package="0.1.0")[2] != wire.row(package="0.2.0")[2]


def _skewed(rank: int, world: int, skew: str, how: str) -> list:
    import torch.distributed as dist

    import flatcomm

    if rank == world - 1:  # the last rank runs "another flatcomm"
        other = {"version": wire.row(version=wire.WIRE_VERSION + 1), "package": wire.row(package="9.9.9"),
                 "foreign": torch.tensor([1, 2, 3, 4])}[skew]
        wire.row = lambda: other.clone()
    errors = []
    for _ in range(2):  # refused again, never cached half made
        try:
            t = torch.ones(33)
            if how == "backend":
                dist.all_reduce(t)
            else:
                flatcomm.all_reduce(t, codec="fp32")
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}")
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("skew", ["version", "package", "foreign"])
def test_ranks_of_different_wires_get_the_same_clear_error(world, skew):
    how = "backend" if skew == "version" else "collectives"
    results = spawn.run(world, _skewed, skew, how, timeout_s=30, backend="flatcomm" if how == "backend" else "gloo")
    for errors in results:
        for err in errors:
            assert err is not None and err.startswith("RuntimeError: flatcomm: the ranks of a group run flatcomm "
                                                      "versions whose messages differ"), err
            assert "install the same flatcomm on every rank" in err
            if skew == "foreign":
                assert "not flatcomm's handshake" in err
    assert len({tuple(e) for e in results}) == 1  # the same words on every rank
