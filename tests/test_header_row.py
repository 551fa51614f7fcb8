"""flatcomm.comm.header_table.row builds a call's row from a cached template (its call number and payload
written in): it must equal the row built field by field, and no row may share memory with the
template or another row (the exchange reads a row while the next call builds its own)."""
from __future__ import annotations

import random

import pytest
import torch

from flatcomm.comm import header, header_table


def test_row_from_the_template_is_the_row_built_field_by_field():
    rng = random.Random(3)
    names = header.FIELDS
    for _ in range(200):
        fields = [(n, rng.randrange(-2**62, 2**62)) for n in rng.sample(names, rng.randrange(len(names) + 1))]
        slot = rng.choice([0, 16, 4096, 16384])
        payload = torch.randint(0, 256, (rng.randrange(slot + 1),), dtype=torch.uint8) if slot else None
        call, status = rng.randrange(2**40), rng.choice([header.OK, header.FAILED_VALUE])
        got = header.row(call, status, fields, names, "", slot, payload)
        want = header_table._built(call, status, fields, names, "", slot, payload)
        assert torch.equal(got, want)
        got.fill_(-1)  # written by a caller: the next row from the same template is untouched
        assert torch.equal(header.row(call, status, fields, names, "", slot, payload), want)


def test_rows_with_a_reason_are_built_whole():
    long = "x" * (header.REASON_BYTES + 9)
    for reason in ("bad numel", long):
        fields = [("numel", 3)]
        got = header.row(4, header.FAILED_VALUE, fields, header.FIELDS, reason, 64)
        assert torch.equal(got, header_table._built(4, header.FAILED_VALUE, fields, header.FIELDS, reason, 64, None))
        shown = header_table._reason(header_table._reason_of(got.view(1, -1), 0, len(header.FIELDS)))
        assert shown.startswith(reason[:20])


def test_the_template_cache_is_bounded():
    for i in range(header_table._TEMPLATES_MAX + 10):
        header.row(i, header.OK, [("numel", i)], header.FIELDS)
    assert len(header_table._TEMPLATES) <= header_table._TEMPLATES_MAX


def test_every_field_is_named_by_the_record():
    """A call's (name, value) pairs are built through comm.fields' record: a name it lacks raises,
    and every builder's names are FIELDS' (so the row layout is written once)."""
    from flatcomm.comm import fields, signature
    from flatcomm.ops.codecs import Codec

    with pytest.raises(KeyError, match="no call header field"):
        fields.pairs(topk=1)
    built = signature.signature(3, 7, Codec("int8"), "exact", 0.5, torch.float16, 2,
                                signature.exact_fields("exact", 256, 2) + [signature.device_field(torch.device("cpu"))]
                                + signature.codec_fields(Codec("sparse", keep=64), intra=True))
    assert [n for n, _ in built if n not in fields.FIELDS] == []
    assert fields.HeaderFields.of(built).intra_block_size == 4096 and fields.HeaderFields.of(built).chunks == 2
