"""The codec table: flatcomm.ops.codecs.TABLE is built from the C++ list (csrc/core/dispatch.h
FLATCOMM_CODECS, through _C.constants()); every codec list of the package derives from it; and every
codec of the table has each of the places that csrc/README.md's "Adding a codec" names. The last
check is shown to fail, naming the missing places, for a codec added to the table alone."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterable, List

import pytest
import torch

import flatcomm
from flatcomm import _C
from flatcomm.fsdp import weights
from flatcomm.ops import codecs, cupy_backend, reference
from flatcomm.ops.codecs import BLOCKWISE, CODECS, PRECISION, TABLE, WEIGHT_CODECS, Codec
from flatcomm.tools import hardening

ROOT = Path(__file__).resolve().parents[1]


def _read(rel: str) -> str:
    return (ROOT / rel).read_text()


def _cpp_ids() -> dict:
    """Codec name -> its C++ enum id (kCodecInt8, ...), from the rows of FLATCOMM_CODECS."""
    return {name: cid for cid, name in re.findall(r'X\((kCodec\w+),\s*"(\w+)"', _read("csrc/core/dispatch.h"))}


def _between(text: str, start: str, end: str) -> str:
    a = text.index(start)
    return text[a:text.index(end, a + len(start))]


def _reference_round_trips(name: str) -> bool:
    """The oracle (flatcomm/ops/reference/codecs.py) encodes and decodes the codec."""
    try:
        x = torch.linspace(-1.0, 1.0, 64)
        p = reference.encode(x, name, block_size=32)
        return reference.decode_f32(p, name, 64, block_size=32).shape == (64,)
    except Exception:
        return False


def missing_places(names: Iterable[str]) -> List[str]:
    """The places of csrc/README.md's "Adding a codec" that a codec of ``names`` lacks, one line each."""
    ids = _cpp_ids()
    impl, cuh = _read("csrc/cpu/kernels_impl.h"), _read("csrc/cuda/device.cuh")
    harness = _between(_read("tests/fuzz/fuzz_harness.h"), "inline void ref_decode", "\n}\n")
    payload_doc = _between(_read("docs/semantics.md"), "## Payload format", "\n## ")
    bounds = _read("tests/test_encode_decode.py")
    out = []
    for name in names:
        cid, cast = ids.get(name), TABLE[name].kind == "cast"
        # The chunked sparse codecs share one branch per place, keyed by their kind (core/sparse.h).
        chunked = cid is not None and TABLE[name].kind == "chunk_sparse"
        places = {
            "csrc/core/dispatch.h: its FLATCOMM_CODECS row": cid is not None,
            # Cast codecs run through Elem<dtype> in both kernels; every other kind has its branches.
            "csrc/cpu/kernels_impl.h: its decode_range / encode_block branch":
                cast or (cid is not None and cid in impl) or (chunked and "is_chunk_sparse(C)" in impl),
            "csrc/cuda/device.cuh: its decode1 / decode4 / encode_kernel branch":
                cast or (cid is not None and cid in cuh) or (chunked and "sparse_encode_chunk" in cuh),
            "tests/fuzz/fuzz_harness.h: its ref_decode branch":
                cid is not None and (cid in harness or (chunked and "is_chunk_sparse(codec)" in harness)),
            "flatcomm/ops/codecs.py: its _POLICY row": name in codecs._POLICY,
            "flatcomm/ops/reference/bits.py: CODECS and its tables": name in reference.CODECS
            and (name in reference.bits.CAST or name in reference.bits.BLOCKWISE or TABLE[name].kind == "sparse"
                 or name in reference.bits.CHUNKED),
            "flatcomm/ops/reference/codecs.py: its encode / decode_f32 branch": _reference_round_trips(name),
            "tests/test_encode_decode.py: its error bound or direct check": f'"{name}"' in bounds,
            "docs/semantics.md: the payload-format section": name in payload_doc,
        }
        out += [f"{name}: {place}" for place, present in places.items() if not present]
    return out


def test_the_table_is_the_cpp_list():
    """Rows, ids and properties as the C++ list reports them, and the cupy path reads the same."""
    rows = _C.constants()["codecs"]
    assert [r["name"] for r in rows] == list(CODECS) == list(TABLE) == list(_C.constants()["codec_names"])
    assert [TABLE[r["name"]].id for r in rows] == list(range(len(rows)))
    assert [TABLE[c].bits for c in CODECS] == [32, 16, 16, 8, 4, 1, 64, 2, 4]
    assert [TABLE[c].kind for c in CODECS] == ["cast"] * 3 + ["scaled_int"] * 2 + ["scaled_sign", "sparse"] + \
        ["chunk_sparse"] * 2
    assert [TABLE[c].dtype for c in CODECS] == [torch.float32, torch.bfloat16, torch.float16] + [None] * 6
    assert tuple(CODECS[i] for i in _C.constants()["blockwise_codecs"]) == BLOCKWISE
    assert tuple(CODECS[i] for i in _C.constants()["stochastic_codecs"]) == codecs.STOCHASTIC
    assert cupy_backend.CODEC_IDS == {c: TABLE[c].id for c in CODECS}
    # The C++ parser accepts exactly these names (its error lists them: checked as a set of names).
    for c in CODECS:
        assert flatcomm.encode(torch.ones(64), c).dtype == torch.uint8
    with pytest.raises(RuntimeError, match="unknown codec"):
        torch.ops.flatcomm.encode(torch.zeros(4), "nope", 256, 0, None, False, 0)


def test_the_independent_reference_agrees():
    """The oracle keeps its own lists on purpose (written from the format, not from the kernels)."""
    assert reference.CODECS == CODECS
    assert reference.BLOCKWISE == BLOCKWISE
    assert sorted(reference.STOCHASTIC) == sorted(codecs.STOCHASTIC)
    assert reference.bits.CAST == tuple(c for c in CODECS if Codec(c).cast)


def test_properties_follow_the_table():
    assert [c for c in CODECS if Codec(c).lossless] == ["fp32"]
    assert [c for c in CODECS if Codec(c).sparse] == ["topk"]
    assert [c for c in CODECS if not Codec(c).reencodes_fused] == ["topk", "sparse", "sparse4"]
    assert [c for c in CODECS if Codec(c).chunked] == ["sparse", "sparse4"]
    assert [c for c in CODECS if Codec(c).stochastic] == ["bf16", "int8", "int4"]
    assert PRECISION == ("fp32", "bf16", "int8", "int4", "sign")  # most precise first
    assert [Codec(c).precision for c in PRECISION] == list(range(len(PRECISION)))
    assert Codec("fp16").precision is None and Codec("topk").precision is None
    assert [Codec(c).dtype for c in ("fp32", "int8")] == [torch.float32, None]
    assert Codec("topk").k(1000) == 10 and Codec("int8").k(1000) == 0


def test_the_other_lists_derive_from_the_table():
    assert weights.WEIGHT_CODECS is WEIGHT_CODECS == ("fp32", "bf16", "fp16", "int8", "int4")
    assert hardening.CODECS is CODECS and hardening.BLOCKWISE is BLOCKWISE
    assert set(hardening.INTRA_CODECS) <= set(PRECISION) and not any(Codec(c).lossless for c in hardening.INTRA_CODECS)
    for c in CODECS:
        if Codec(c).for_weights:
            assert weights.weight_codec(c).name == c
        else:
            with pytest.raises(ValueError, match=f"{c!r} cannot gather weights.*use one of fp32, bf16"):
                weights.weight_codec(c)


def test_every_codec_has_all_its_places():
    assert missing_places(CODECS) == []


def test_a_codec_added_to_the_table_alone_is_reported(monkeypatch):
    """A new name in the one table (here a blockwise "int2") without its other places fails, and
    the message names each missing place."""
    fake = dataclasses.replace(TABLE["int4"], name="int2", id=len(TABLE), bits=2)
    monkeypatch.setitem(codecs.TABLE, "int2", fake)
    monkeypatch.setattr(codecs, "CODECS", CODECS + ("int2",))
    missing = missing_places(codecs.CODECS)
    assert missing == [
        "int2: csrc/core/dispatch.h: its FLATCOMM_CODECS row",
        "int2: csrc/cpu/kernels_impl.h: its decode_range / encode_block branch",
        "int2: csrc/cuda/device.cuh: its decode1 / decode4 / encode_kernel branch",
        "int2: tests/fuzz/fuzz_harness.h: its ref_decode branch",
        "int2: flatcomm/ops/codecs.py: its _POLICY row",
        "int2: flatcomm/ops/reference/bits.py: CODECS and its tables",
        "int2: flatcomm/ops/reference/codecs.py: its encode / decode_f32 branch",
        "int2: tests/test_encode_decode.py: its error bound or direct check",
        "int2: docs/semantics.md: the payload-format section",
    ]
    # A cast codec needs no kernel branch of its own (Elem<dtype> covers it), the rest still apply.
    monkeypatch.setitem(codecs.TABLE, "int2", dataclasses.replace(fake, kind="cast"))
    assert len(missing_places(["int2"])) == len(missing) - 2


def test_a_cpp_codec_without_its_python_row_fails_on_import(monkeypatch):
    """The C++ list growing alone stops `import flatcomm` with the place to add (not a silent gap)."""
    k = dict(_C.constants())
    k["codecs"] = k["codecs"] + [dict(k["codecs"][4], id=7, name="int2")]
    monkeypatch.setattr(codecs.extension, "constants", lambda: k)
    with pytest.raises(ImportError, match=r"int2 of the C\+\+ list have no row in flatcomm/ops/codecs.py _POLICY"):
        codecs._table()
