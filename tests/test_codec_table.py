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
    assert [TABLE[c].bits for c in CODECS] == [32, 16, 16, 8, 4, 1, 64, 2, 4, 1]
    assert [TABLE[c].kind for c in CODECS] == ["cast"] * 3 + ["scaled_int"] * 2 + ["scaled_sign", "sparse"] + \
        ["chunk_sparse"] * 3
    assert [TABLE[c].dtype for c in CODECS] == [torch.float32, torch.bfloat16, torch.float16] + [None] * 7
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
    assert [c for c in CODECS if not Codec(c).reencodes_fused] == ["topk", "sparse", "sparse4", "sparse1"]
    assert [c for c in CODECS if Codec(c).chunked] == ["sparse", "sparse4", "sparse1"]
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


# ---- the core's limits: read from _C.constants(), never copied (issue 38, item 3) ---------------

# Names whose value is a core limit or a collective kind id: assigned from the core or KIND_IDS.
_LIMIT_NAMES = re.compile(r"^(_CAST_ALIGN|MIN_BLOCK|MAX_BLOCK|MAX_EXACT_BLOCK|_ALL_GATHER|_ALL_REDUCE|_REDUCE_SCATTER"
                          r"|\w*_KIND|\w*KIND_ID)$")


def _int_value(node) -> "int | None":
    """The int a literal (``4096``) or a constant shift / power (``1 << 56``) writes, else None."""
    import ast

    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Pow)):
        a, b = _int_value(node.left), _int_value(node.right)
        if a is not None and b is not None and b < 128:
            return a << b if isinstance(node.op, ast.LShift) else a ** b
    return None


def literal_copies(source: str, literals: Iterable[int], shifted: Iterable[int]) -> List[str]:
    """Where ``source`` writes a core limit as a number: an int literal of ``literals``, a literal
    or a constant ``1 << n`` / ``2 ** n`` of ``shifted``, or a limit-named constant (the names of
    the limits and kind ids) assigned a number."""
    import ast

    literals, shifted = set(literals), set(shifted)
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            numbers_only = not any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
                                   for n in ast.walk(node.value))
            if _LIMIT_NAMES.match(node.targets[0].id) and numbers_only:
                out.append(f"line {node.lineno}: {node.targets[0].id} = a number")
        v = _int_value(node)
        if v is not None and (v in shifted or (isinstance(node, ast.Constant) and v in literals)):
            out.append(f"line {node.lineno}: the literal {v}")
    return out


def _copies(source: str) -> List[str]:
    k = _C.constants()
    return literal_copies(source, [k["max_block"], k["max_numel"]], [k["max_numel"]])


def test_the_limits_are_the_cores() -> None:
    from flatcomm.comm import args
    from flatcomm.comm.header import KIND_IDS
    from flatcomm.diloco import replicas

    k = _C.constants()
    assert (codecs.MIN_BLOCK, codecs.MAX_BLOCK, codecs.MAX_NUMEL) == (k["min_block"], k["max_block"], k["max_numel"])
    assert args.MAX_EXACT_BLOCK == k["max_block"]
    assert replicas._ALL_GATHER == KIND_IDS["all_gather"]
    for name, f in TABLE.items():  # a cast codec's shard pieces are whole multiples of the alignment
        if f.kind == "cast":
            assert codecs._CAST_ALIGN * f.bits // 8 % k["align"] == 0, name


def test_no_library_source_copies_a_limit() -> None:
    found = []
    for path in sorted((ROOT / "flatcomm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        # tools/: benchmarks sweep block sizes on purpose; ops/reference/: the oracle restates the
        # format independently, by design (it is what the kernels are checked against).
        if rel.startswith(("flatcomm/tools/", "flatcomm/ops/reference/")):
            continue
        found += [f"{rel}: {w}" for w in _copies(path.read_text())]
    assert not found, "core limits written as numbers (read them from _C.constants() / KIND_IDS):\n" + "\n".join(found)


@pytest.mark.parametrize("copy", ["_CAST_ALIGN = 32", "MAX_NUMEL = 1 << 56", "MAX_EXACT_BLOCK = 4096",
                                  "_ALL_GATHER = 2  # header.KINDS", "ok = 32 <= b <= 4096",
                                  "limit = 2 ** 56", "MIN_BLOCK = 16 * 2"])
def test_the_scan_catches_a_literal_copy(copy: str) -> None:
    assert _copies(copy), copy


def test_the_scan_passes_names_read_from_the_core() -> None:
    ok = ('MAX_NUMEL = _LIMITS["max_numel"]\nMAX_EXACT_BLOCK = MAX_BLOCK\nDEFAULT_BLOCK_SIZE = 256\n'
          'small = 4 << 10\nBENCH_NUMEL = 1 << 23')
    assert _copies(ok) == []
