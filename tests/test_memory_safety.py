"""A peer's payload is untrusted input: every decoder raises a clear error or gives defined values,
never writes outside its output (issue 13). The fuzzers in tests/fuzz cover arbitrary bytes under
AddressSanitizer; these are the op-level regressions of the findings, each failing before the fix.
"""
import pytest
import torch

import flatcomm

RATIO = 0.25


def topk_rows(indices_per_row, n):
    """Topk payloads ([W, nbytes]) holding the given index lists (values 1, 2, 3, ...)."""
    codec = flatcomm.ops.codecs.Codec("topk", ratio=RATIO)
    k = codec.k(n)
    rows = []
    for idx in indices_per_row:
        assert len(idx) == k
        good = flatcomm.encode(torch.randn(n), codec)  # right size, padding included
        p = good.clone()
        p[: 4 * k] = torch.tensor(idx, dtype=torch.int64).to(torch.int32).view(torch.uint8)
        rows.append(p)
    return codec, k, torch.stack(rows)


def spike_indices(n, k):
    """[0]*m + [n-1] + [0]*m: the pattern that wrote outside a stack tile (issue 13)."""
    m = (k - 1) // 2
    return [0] * m + [n - 1] + [0] * (k - 1 - m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_rejects_non_ascending_topk_indices(dtype):
    n = 4096 + 17
    k = flatcomm.ops.codecs.Codec("topk", ratio=RATIO).k(n)
    codec, k, rows = topk_rows([spike_indices(n, k)], n)
    with pytest.raises(RuntimeError, match="strictly ascending, but entry"):
        flatcomm.decode(rows[0], codec, n, dtype=dtype)


@pytest.mark.parametrize("reencode", [None, "fp32", "int8", "bf16"])
def test_decode_sum_rejects_non_ascending_topk_indices(reencode):
    n = 3 * 2048 + 5
    k = flatcomm.ops.codecs.Codec("topk", ratio=RATIO).k(n)
    good = list(range(0, 4 * k, 4))
    codec, k, rows = topk_rows([good, spike_indices(n, k)], n)
    with pytest.raises(RuntimeError, match=r"row 1\): indices must be strictly ascending"):
        flatcomm.decode_sum(rows, codec, n, reencode=reencode)


def test_duplicate_and_out_of_range_topk_indices_are_errors():
    n = 1000
    k = flatcomm.ops.codecs.Codec("topk", ratio=RATIO).k(n)
    dup = list(range(k))
    dup[5] = dup[4]
    codec, _, rows = topk_rows([dup], n)
    with pytest.raises(RuntimeError, match="entry 5 is 4 after 4"):
        flatcomm.decode(rows[0], codec, n)
    # Before: an index >= numel was silently dropped.
    far = list(range(k - 1)) + [n]
    codec, _, rows = topk_rows([far], n)
    with pytest.raises(RuntimeError, match=f"index {n} at entry {k - 1} is out of range for numel {n}"):
        flatcomm.decode_sum(rows, codec, n)
    huge = list(range(k - 1)) + [2**32 - 1]
    codec, _, rows = topk_rows([huge], n)
    with pytest.raises(RuntimeError, match="out of range"):
        flatcomm.decode(rows[0], codec, n, dtype=torch.bfloat16)


def test_valid_topk_payload_still_decodes_exactly():
    n = 5000
    x = torch.randn(n)
    codec = flatcomm.ops.codecs.Codec("topk", ratio=RATIO)
    p = flatcomm.encode(x, codec)
    d = flatcomm.decode(p, codec, n)
    kept = d != 0
    assert int(kept.sum()) == codec.k(n)
    assert torch.equal(d[kept], x[kept])
    s = flatcomm.decode_sum(torch.stack([p, p]), codec, n, scale=0.5)
    assert torch.equal(s, (d + d) * 0.5)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "sign", "topk"])
def test_wire_bytes_never_overflows(codec):
    # Before: fp32 gave 0 at 2^62, 16 at 2^62 + 4 and a negative size at 2^61.
    for n in (2**61, 2**62, 2**62 + 4, 2**63 - 1, 2**56 + 1, 2**70):
        with pytest.raises((ValueError, RuntimeError), match="numel|2\\^32"):
            flatcomm.wire_bytes(codec, n)
    if codec != "topk":
        big = flatcomm.wire_bytes(codec, 2**56)
        assert big > 0 and big % 16 == 0
        assert big >= 2**56 // 8


def test_decode_sum_with_an_overflowing_numel_is_an_error_not_a_crash():
    # Before: wire_bytes(fp32, 2^62 + 4) == 16 passed the size checks, then the decode wrote 2^62 floats.
    with pytest.raises(RuntimeError, match="numel"):
        flatcomm.decode_sum(torch.zeros(1, 16, dtype=torch.uint8), "fp32", 2**62 + 4, reencode="fp32")
    with pytest.raises(RuntimeError, match="numel"):
        flatcomm.decode(torch.zeros(16, dtype=torch.uint8), "fp32", 2**62 + 4)
    with pytest.raises(RuntimeError, match="numel"):
        flatcomm.decode_sum(torch.zeros(1, 16, dtype=torch.uint8), "int8", 2**61)


def test_meta_residual_with_cpu_input_is_rejected():
    x = torch.randn(100)
    # Before: dispatched to the fake kernel and returned an uninitialised payload.
    with pytest.raises(RuntimeError, match="residual is on meta but the input is on cpu"):
        flatcomm.encode(x, "int8", residual=torch.zeros(100, device="meta"))
    out = torch.empty(flatcomm.wire_bytes("int8", 100), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="residual is on meta"):
        flatcomm.encode(x, "int8", residual=torch.zeros(100, device="meta"), out=out)


def test_meta_payload_with_cpu_out_is_rejected():
    n = 100
    payload = torch.empty(flatcomm.wire_bytes("int8", n), dtype=torch.uint8, device="meta")
    out = torch.full((n,), 7.0)
    # Before: out was silently left untouched.
    with pytest.raises(RuntimeError, match="out is on cpu but the input is on meta"):
        flatcomm.decode(payload, "int8", n, out=out)
    with pytest.raises(RuntimeError, match="out is on cpu but the input is on meta"):
        flatcomm.decode_sum(payload.unsqueeze(0), "int8", n, out=out)
    dst = torch.empty(flatcomm.wire_bytes("fp32", n), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="payload is on cpu but the input is on meta"):
        flatcomm.decode_sum(payload.unsqueeze(0), "int8", n, reencode="fp32", out=dst)
    # All-meta calls still trace (torch.compile / opcheck).
    assert flatcomm.decode(payload, "int8", n).device.type == "meta"


def test_from_exact_rejects_corrupt_exponents():
    acc = torch.arange(64, dtype=torch.int64)
    for bad in (2**31 - 1, -(2**31), 129, -149, 5000):
        e = torch.tensor([0, bad], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=f"exponents\\[1\\] = {bad} is not a block exponent"):
            flatcomm.from_exact(acc, e, block_size=32)
    x = torch.randn(64)
    with pytest.raises(RuntimeError, match="is not a block exponent"):
        flatcomm.to_exact(x, torch.tensor([-(2**31), 3], dtype=torch.int32), block_size=32)
