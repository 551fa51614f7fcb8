"""decode_rows: the decode of FSDP2's quantized weight all-gather (issue 21).

Every rank encodes its shard of a weight (no error feedback), the payloads are all-gathered into
[R, B], and each rank decodes all R rows straight into the unsharded parameter in the compute dtype,
the padding of the last shard cut off. Checked bit for bit against flatcomm.ops.reference, on every
instruction set and thread count, with untrusted payload bytes, and every argument error.
"""
from __future__ import annotations

import math

import pytest
import torch

import flatcomm
from flatcomm import _C
from flatcomm.ops import codecs
from flatcomm.ops import reference as R

from _support.kernels import DTYPES, assert_bits_equal, make_input

ops = torch.ops.flatcomm
ROW_CODECS = tuple(c for c in R.CODECS if c != "topk" and c not in R.CHUNKED)  # decode_rows refuses those
ISAS = ("baseline", "avx2", "avx512")


def shard_payloads(g, codec, rows, m, block, dtype=torch.float32):
    shards = [make_input(g, m, dtype) for _ in range(rows)]
    return torch.stack([flatcomm.encode(s, codec, block_size=block) for s in shards]), shards


def poisoned_out(n, dtype, extra=5):
    """out: the first n values of a NaN-filled buffer, so that a write past out's end shows."""
    buf = torch.full((n + extra,), math.nan, dtype=dtype)
    return buf, buf[:n]


# (rows, row_numel, block, cut): one row of one value, odd row sizes and blocks, rows that are not a
# multiple of 4 or of the block, aligned ones (the vector paths), the last row cut to one value
CASES = [(1, 1, 32, 0), (1, 97, 32, 50), (3, 33, 32, 0), (3, 1000, 96, 1), (5, 257, 64, 256),
         (2, 4099, 4096, 3), (7, 256, 256, 0), (4, 2048, 256, 2047)]


@pytest.mark.parametrize("codec", ROW_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,m,block,cut", CASES)
def test_matches_reference(gen, codec, dtype, rows, m, block, cut):
    P, _ = shard_payloads(gen, codec, rows, m, block)
    n = rows * m - cut
    buf, out = poisoned_out(n, dtype)
    assert codecs.decode_rows(P, codec, m, out, block_size=block) is out
    assert_bits_equal(out, R.decode_rows(P, codec, m, n, block_size=block, dtype=dtype), f"{codec} {dtype}")
    assert torch.isnan(buf[n:].float()).all(), "wrote past the end of out"
    # the same values as decode of each row cast to out's dtype
    for r in range(rows):
        row = flatcomm.decode(P[r], codec, m, block_size=block).to(dtype)
        assert_bits_equal(out[r * m:(r + 1) * m], row[:n - r * m], f"row {r}")


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_and_thread_count(gen, isa, restore_simd, restore_threads):
    if not _C.set_simd(isa):
        pytest.skip(f"{isa} not supported here")
    for codec in ROW_CODECS:
        P, _ = shard_payloads(gen, codec, 3, 70001, 256)
        n = 3 * 70001 - 12345
        for dtype in DTYPES:
            want = R.decode_rows(P, codec, 70001, n, block_size=256, dtype=dtype)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = torch.empty(n, dtype=dtype)
                codecs.decode_rows(P, codec, 70001, out, block_size=256)
                assert_bits_equal(out, want, f"{isa} {codec} {dtype} {threads} threads")


@pytest.mark.parametrize("codec", ("int8", "int4", "sign", "bf16", "fp16"))
def test_special_blocks(gen, codec):
    """A shard with a NaN, an inf, an all-zero and a huge block: NaN / inf blocks decode to NaN
    (int8 / int4 / sign: the whole block), the zero block to zeros, the huge one to finite fp32."""
    m, block = 4 * 64 + 17, 64
    x = make_input(gen, m)
    x[3] = math.nan
    x[64 + 5] = -math.inf
    x[128:192] = 0.0
    x[192:256] = x[192:256].sign() * 3.4e38 if codec != "fp16" else x[192:256]
    P = torch.stack([flatcomm.encode(x, codec, block_size=block), flatcomm.encode(-x, codec, block_size=block)])
    for dtype in DTYPES:
        out = torch.empty(2 * m - 9, dtype=dtype)
        codecs.decode_rows(P, codec, m, out, block_size=block)
        assert_bits_equal(out, R.decode_rows(P, codec, m, 2 * m - 9, block_size=block, dtype=dtype), str(dtype))
        if codec in R.BLOCKWISE:
            assert torch.isnan(out[:128].float()).all() and (out[128:192] == 0).all()
            assert torch.isfinite(out[192:256]).all() or dtype != torch.float32  # bf16 rounds 3.4e38 up to inf


@pytest.mark.parametrize("codec", ROW_CODECS)
def test_any_payload_bytes(gen, codec):
    """Rows from another rank are untrusted: random bytes decode to the reference's values
    (NaN scales, any codes), and nothing is written past out."""
    m, block, rows = 300, 32, 3
    nbytes = flatcomm.wire_bytes(codec, m, block_size=block)
    P = torch.randint(0, 256, (rows, nbytes), generator=gen, dtype=torch.uint8)
    for dtype in DTYPES:
        buf, out = poisoned_out(rows * m - 7, dtype)
        codecs.decode_rows(P, codec, m, out, block_size=block)
        want = R.decode_rows(P, codec, m, rows * m - 7, block_size=block, dtype=dtype)
        both_nan = torch.isnan(out.float()) & torch.isnan(want.float())
        assert torch.equal(torch.where(both_nan, 0, R.f32_bits(out.float())),
                           torch.where(both_nan, 0, R.f32_bits(want.float())))
        assert torch.isnan(buf[rows * m - 7:].float()).all()


def test_out_of_any_shape_and_codec_object(gen):
    """out is the unsharded parameter itself (any shape, contiguous); codec may be a Codec."""
    P, _ = shard_payloads(gen, "int8", 4, 24, 32)
    w = torch.empty(9, 10, dtype=torch.bfloat16)  # 90 values: the last shard holds 18 of its 24
    codecs.decode_rows(P, flatcomm.Codec("int8", block_size=32), 24, w)
    assert_bits_equal(w.reshape(-1), R.decode_rows(P, "int8", 24, 90, block_size=32, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("codec", ("int8", "int4"))
def test_fsdp_weight_all_gather_round_trip(gen, codec, dtype):
    """The FSDP2 flow: shard a weight (padded to R * m), encode each shard in its own dtype with no
    residual, gather, decode_rows into the full parameter. Each shard's payload is the reference's
    encode of that dtype (one pass over the bf16 values, no fp32 copy: the same bytes as encoding
    the upcast shard), and the weight comes back within the codec's error bound."""
    world, numel, block = 5, 3 * 1000 + 1, 128
    w = make_input(gen, numel, dtype, kind="normal")
    m = -(-numel // world)
    padded = torch.cat([w, w.new_zeros(world * m - numel)])
    shards = [padded[r * m:(r + 1) * m] for r in range(world)]
    P = torch.stack([flatcomm.encode(s, codec, block_size=block) for s in shards])
    for r, s in enumerate(shards):
        assert_bits_equal(P[r], R.encode(s, codec, block_size=block), f"shard {r}")
        assert_bits_equal(P[r], flatcomm.encode(s.float(), codec, block_size=block), f"shard {r} upcast")
    p_into = torch.empty_like(P[0])
    flatcomm.encode(shards[1], codec, block_size=block, out=p_into)
    assert_bits_equal(p_into, P[1], "encode into a payload slot")
    full = torch.empty(numel, dtype=dtype)
    codecs.decode_rows(P, codec, m, full, block_size=block)
    assert_bits_equal(full, R.decode_rows(P, codec, m, numel, block_size=block, dtype=dtype))
    # each shard has its own blocks; the bf16 store adds half an ulp of bf16
    bound = torch.cat([R.dequant_error_bound(s, codec, block) for s in shards])[:numel]
    bound = bound + w.double().abs() * (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    err = (full.double() - w.double()).abs()
    assert (err <= bound).all(), float((err - bound).max())


def _payloads(codec="int8", rows=2, m=100, block=32):
    return torch.zeros(rows, flatcomm.wire_bytes(codec, m, block_size=block), dtype=torch.uint8)


@pytest.mark.parametrize("args,match", [
    ((_payloads(), "topk", 100, 32, torch.zeros(200)), r"decode_rows does not take topk payloads"),
    ((_payloads(), "sparse", 100, 32, torch.zeros(200)), r"decode_rows does not take sparse payloads"),
    ((_payloads(), "int9", 100, 32, torch.zeros(200)), r"unknown codec 'int9'"),
    ((_payloads(), "int8", 0, 32, torch.zeros(200)), r"row_numel must be in \[1, 2\^56\], got 0"),
    ((_payloads(), "int8", -5, 32, torch.zeros(200)), r"row_numel must be in \[1, 2\^56\], got -5"),
    ((_payloads(), "int8", 100, 48, torch.zeros(200)), r"block_size must be a multiple of 32"),
    ((_payloads(), "int8", 120, 32, torch.zeros(240)), r"payload has 128 bytes per row but codec 'int8' "
                                                       r"with numel 120 needs 144"),
    ((_payloads("int4"), "int8", 100, 32, torch.zeros(200)), r"payload has 80 bytes per row"),
    ((_payloads()[0], "int8", 100, 32, torch.zeros(100)), r"payload must be 2-D, got shape \[128\]"),
    ((_payloads().float(), "int8", 100, 32, torch.zeros(200)), r"payload must be uint8, got Float"),
    ((_payloads(rows=4).t().contiguous().t(), "int8", 100, 32, torch.zeros(400)),
     r"payload must be contiguous"),
    ((_payloads(rows=0), "int8", 100, 32, torch.zeros(100)), r"decode_rows needs at least one row in payloads"),
    ((_payloads(), "int8", 100, 32, torch.zeros(100)),
     r"out has 100 elements, which is 1 rows of row_numel 100, but payloads has 2 rows"),
    ((_payloads(), "int8", 100, 32, torch.zeros(201)),
     r"out has 201 elements, which is 3 rows of row_numel 100, but payloads has 2 rows"),
    ((_payloads(), "int8", 100, 32, torch.zeros(0)), r"out has 0 elements"),
    ((_payloads(), "int8", 100, 32, torch.zeros(200, dtype=torch.float64)),
     r"out must be float32, bfloat16 or float16, got Double"),
    ((_payloads(), "int8", 100, 32, torch.zeros(200, dtype=torch.int32)), r"out must be float32"),
    ((_payloads(), "int8", 100, 32, torch.zeros(400)[::2]), r"out must be contiguous"),
    ((_payloads(), "int8", 100, 32, torch.zeros(20, 10).t()), r"out must be contiguous"),
])
def test_argument_errors(args, match):
    out = args[-1]
    before = out.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.decode_rows_into(*args)
    assert torch.equal(out, before)  # nothing written


def test_wrapper_errors_name_the_argument():
    with pytest.raises(RuntimeError, match="out has 250 elements"):
        codecs.decode_rows(_payloads(), "int8", 100, torch.empty(250), block_size=32)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        codecs.decode_rows(_payloads(), "int8", 100, torch.empty(200), block_size=40)


def test_out_on_another_device():
    with pytest.raises(RuntimeError, match="out is on meta but the input is on cpu"):
        ops.decode_rows_into(_payloads(), "int8", 100, 32, torch.empty(200, device="meta"))


def test_fake_kernel_checks_shapes():
    """The fake kernel (torch.compile, opcheck) rejects what the op rejects."""
    P = _payloads().to("meta")
    ops.decode_rows_into(P, "int8", 100, 32, torch.empty(150, device="meta"))
    for args, match in [(("int8", 100, 32, torch.empty(100, device="meta")), "out has 100 elements"),
                        (("int8", 120, 32, torch.empty(240, device="meta")), r"payloads must be \[rows, 144\]"),
                        (("topk", 100, 32, torch.empty(200, device="meta")), "does not take topk")]:
        with pytest.raises(RuntimeError, match=match):
            ops.decode_rows_into(P, *args)
    with pytest.raises(RuntimeError, match="at least one row"):
        ops.decode_rows_into(P[:0], "int8", 100, 32, torch.empty(100, device="meta"))


def test_under_torch_compile(gen):
    P, _ = shard_payloads(gen, "int4", 3, 64, 32)

    def gather_decode(p, out):
        codecs.decode_rows(p, "int4", 64, out, block_size=32)
        return out * 1

    out = torch.empty(190, dtype=torch.bfloat16)
    got = torch.compile(gather_decode, backend="eager", fullgraph=True)(P, out)
    assert_bits_equal(got, R.decode_rows(P, "int4", 64, 190, block_size=32, dtype=torch.bfloat16))
