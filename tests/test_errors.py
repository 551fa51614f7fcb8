"""Bad arguments give clear errors (never a crash or silently wrong bytes)."""
from __future__ import annotations

import pytest
import torch

import flatcomm

ops = torch.ops.flatcomm


@pytest.mark.parametrize("dtype,name", [(torch.int32, "Int"), (torch.float64, "Double"), (torch.int64, "Long"),
                                        (torch.uint8, "Byte")])
def test_encode_wrong_dtype(dtype, name):
    with pytest.raises(RuntimeError, match=f"x must be float32, bfloat16 or float16, got {name}"):
        flatcomm.encode(torch.zeros(64, dtype=dtype), "int8")


def test_encode_non_contiguous():
    x = torch.randn(64, 2)[:, 0]
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        flatcomm.encode(x, "int8")
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        flatcomm.encode(torch.randn(8, 8).t(), "fp32")


def test_residual_checks():
    x = torch.randn(64)
    with pytest.raises(RuntimeError, match="residual must be float32, got Double"):
        flatcomm.encode(x, "int8", residual=torch.zeros(64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="residual must be float32, got BFloat16"):
        flatcomm.encode(x, "int8", residual=torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="residual has 63 elements but the input has 64"):
        flatcomm.encode(x, "int8", residual=torch.zeros(63))
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        flatcomm.encode(x, "int8", residual=torch.zeros(64, 2)[:, 0])


def test_residual_untouched_on_error():
    r = torch.full((64,), 0.5)
    with pytest.raises(ValueError):
        flatcomm.encode(torch.randn(64), "int8", residual=r, block_size=48)
    with pytest.raises(RuntimeError):
        ops.encode(torch.randn(64), "int8", 48, 0, r, False, 0)
    with pytest.raises(RuntimeError):
        flatcomm.encode(torch.randn(64), "sign", residual=r, stochastic=True)
    assert (r == 0.5).all()


def test_payload_checks():
    p = flatcomm.encode(torch.randn(100), "int8", block_size=32)
    with pytest.raises(RuntimeError, match=r"payload has \d+ bytes per row but codec 'int8' with numel 100 needs \d+"):
        flatcomm.decode(p[:-16], "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match=r"payload has \d+ bytes per row but codec 'int8' with numel 401 needs"):
        flatcomm.decode(p, "int8", 101 + 300, block_size=32)
    with pytest.raises(RuntimeError, match="payload must be uint8, got Char"):
        flatcomm.decode(p.view(torch.int8), "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match="payload must be uint8, got Float"):
        flatcomm.decode(torch.zeros(p.numel() // 4), "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match="payload must be 1-D"):
        flatcomm.decode(p.reshape(1, -1), "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match="payload must be 2-D"):
        flatcomm.decode_sum(p, "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match=r"payload has \d+ bytes per row"):
        flatcomm.decode_sum(torch.stack([p, p])[:, :-16].contiguous(), "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match="payload must be contiguous"):
        flatcomm.decode_sum(torch.stack([p, p], 1).t(), "int8", 100, block_size=32)
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16, got Double"):
        flatcomm.decode(p, "int8", 100, block_size=32, dtype=torch.float64)


def test_bad_codec_name():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="unknown codec 'int2'"):
        flatcomm.encode(x, "int2")
    with pytest.raises(RuntimeError, match="unknown codec 'int2'; expected one of fp32, bf16, fp16, int8, int4, sign, topk"):
        ops.encode(x, "int2", 256, 0, None, False, 0)
    with pytest.raises(RuntimeError, match="unknown codec 'INT8'"):
        ops.decode(torch.zeros(16, dtype=torch.uint8), "INT8", 10, 256, 0, torch.float32)
    with pytest.raises(TypeError, match="codec must be a name or a Codec"):
        flatcomm.encode(x, 8)


@pytest.mark.parametrize("block", [48, 16, 8192, 0, -32, 4128])
@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
def test_bad_block_size(block, codec):
    x = torch.randn(100)
    with pytest.raises(ValueError, match=f"block_size must be a multiple of 32 in \\[32, 4096\\], got {block}"):
        flatcomm.encode(x, codec, block_size=block)
    with pytest.raises(RuntimeError, match=f"block_size must be a multiple of 32 in \\[32, 4096\\], got {block}"):
        ops.encode(x, codec, block, 0, None, False, 0)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 32"):
        ops.decode(torch.zeros(16, dtype=torch.uint8), codec, 100, block, 0, torch.float32)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 32"):
        flatcomm._C.wire_bytes(codec, 100, block, 0)


def test_block_size_ignored_by_non_blockwise():
    x = torch.randn(100)
    assert torch.equal(ops.encode(x, "bf16", 48, 0, None, False, 0), flatcomm.encode(x, "bf16"))


@pytest.mark.parametrize("codec", ["sign", "fp16", "fp32", "topk"])
def test_stochastic_unsupported(codec):
    with pytest.raises(RuntimeError, match="stochastic rounding is available for bf16, int8 and int4 only"):
        flatcomm.encode(torch.randn(100), codec, stochastic=True)
    P = torch.stack([flatcomm.encode(torch.randn(100), "int8")])
    if codec != "topk":
        with pytest.raises(RuntimeError, match="stochastic rounding is available for bf16, int8 and int4 only"):
            flatcomm.decode_sum(P, "int8", 100, reencode=codec, stochastic=True)


def test_topk_k_checks():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match=r"topk needs 1 <= k <= numel \(k = 0, numel = 100\)"):
        ops.encode(x, "topk", 256, 0, None, False, 0)
    with pytest.raises(RuntimeError, match=r"topk needs 1 <= k <= numel \(k = 101, numel = 100\)"):
        ops.encode(x, "topk", 256, 101, None, False, 0)
    with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
        flatcomm.encode(x, "topk", ratio=0.0)
    with pytest.raises(ValueError, match=r"topk ratio must be in \(0, 1\]"):
        flatcomm.encode(x, "topk", ratio=1.5)


def test_decode_sum_reencode_checks():
    P = torch.stack([flatcomm.encode(torch.randn(100), "int8")])
    with pytest.raises(RuntimeError, match="cannot re-encode as topk"):
        flatcomm.decode_sum(P, "int8", 100, reencode="topk")
    with pytest.raises(ValueError, match="got a residual but no reencode codec"):
        flatcomm.decode_sum(P, "int8", 100, residual=torch.zeros(100))
    with pytest.raises(RuntimeError, match="residual must be float32"):
        flatcomm.decode_sum(P, "int8", 100, reencode="int8", residual=torch.zeros(100, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="residual has 99 elements but 100"):
        flatcomm.decode_sum(P, "int8", 100, reencode="int8", residual=torch.zeros(99))
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        flatcomm.decode_sum(P, "int8", 100, reencode="int8", reencode_block_size=48)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 32 in \\[32, 4096\\], got 48"):
        ops.decode_sum_encode(P, "int8", 100, 256, 0, 1.0, "int8", 48, None, False, 0)


def test_ordered_sum_checks():
    with pytest.raises(RuntimeError, match="ordered_sum expects a 2-D"):
        flatcomm.ordered_sum(torch.randn(10))
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        flatcomm.ordered_sum(torch.randn(10, 3).t())
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, got Double"):
        flatcomm.ordered_sum(torch.randn(3, 10, dtype=torch.float64))


@pytest.mark.parametrize("headroom", [0, -1, 39, 64])
def test_exact_headroom_out_of_range(headroom):
    x = torch.randn(2, 64)
    E = flatcomm.exact_exponents(x, 32)
    msg = f"headroom must be in \\[1, 38\\], got {headroom}"
    with pytest.raises(RuntimeError, match=msg):
        flatcomm.exact_sum(x, 32, headroom)
    with pytest.raises(RuntimeError, match=msg):
        flatcomm.to_exact(x[0], E, 32, headroom)
    with pytest.raises(RuntimeError, match=msg):
        flatcomm.from_exact(torch.zeros(64, dtype=torch.int64), E, 32, headroom)


def test_exact_checks():
    x = torch.randn(3, 64)
    E = flatcomm.exact_exponents(x, 32)
    with pytest.raises(RuntimeError, match="exact_sum of 3 rows needs headroom >= log2\\(rows\\); got headroom 1"):
        flatcomm.exact_sum(x, 32, 1)
    with pytest.raises(RuntimeError, match=r"block_size must be in \[1, 4096\], got 0"):
        flatcomm.exact_sum(x, 0)
    with pytest.raises(RuntimeError, match=r"block_size must be in \[1, 4096\], got 4097"):
        flatcomm.exact_exponents(x, 4097)
    with pytest.raises(RuntimeError, match="exponents must be int32, got Long"):
        flatcomm.to_exact(x[0], E.long(), 32)
    with pytest.raises(RuntimeError, match="exponents has 2 entries but numel 64 with block_size 16 needs 4"):
        flatcomm.to_exact(x[0], E, 16)
    with pytest.raises(RuntimeError, match="to_exact expects a 1-D tensor"):
        flatcomm.to_exact(x, E, 32)
    with pytest.raises(RuntimeError, match="from_exact expects a 1-D int64 tensor, got Float"):
        flatcomm.from_exact(x[0], E, 32)
    with pytest.raises(RuntimeError, match="exact_sum expects a 2-D"):
        flatcomm.exact_sum(x[0], 32)
    with pytest.raises(RuntimeError, match="expected a 1-D or 2-D"):
        flatcomm.exact_exponents(torch.randn(2, 2, 2), 32)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, got Int"):
        flatcomm.exact_sum(torch.zeros(2, 4, dtype=torch.int32), 32)


def test_codec_dataclass_validation():
    with pytest.raises(ValueError, match="unknown codec"):
        flatcomm.Codec("nope")
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        flatcomm.Codec("int8", block_size=100)
    assert flatcomm.Codec("topk", ratio=0.1).k(95) == 10
    assert flatcomm.Codec("topk", ratio=0.001).k(5) == 1
    assert flatcomm.Codec("int8").k(100) == 0
