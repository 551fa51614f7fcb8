"""The cupy path compiles with exactly NVRTC_OPTIONS (no flush-to-zero) and caches the binaries.

No cupy or GPU needed: a fake cupy records what reaches NVRTC. cupy.RawModule appended -ftz=true
after our --ftz=false, and the first GPU run saw every subnormal flushed (nvrtc_cache.py).
"""
from __future__ import annotations

import types

import pytest

from flatcomm.ops.cupy_backend import NVRTC_OPTIONS, nvrtc_cache


class FakeCupy:
    def __init__(self, version="14.2.0"):
        self.calls = []
        self.__version__ = version
        compiler = types.SimpleNamespace(compile_using_nvrtc=self._compile)
        nvrtc = types.SimpleNamespace(getVersion=lambda: (13, 0))
        self.cuda = types.SimpleNamespace(compiler=compiler, nvrtc=nvrtc)

    def _compile(self, source, options, arch, name_expressions=None):
        self.calls.append((source, options, arch, tuple(name_expressions)))
        return f"binary of {source} for {arch}".encode(), {n: f"_Z{i}" for i, n in enumerate(name_expressions)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATCOMM_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def test_options_reach_nvrtc_as_given(cache):
    cp = FakeCupy()
    binary, lowered = nvrtc_cache.compile_group(cp, "src", NVRTC_OPTIONS, "90", ["k<0>", "k<1>"])
    (_, options, arch, names), = cp.calls
    assert options == tuple(NVRTC_OPTIONS) and arch == "90" and names == ("k<0>", "k<1>")
    assert "--ftz=false" in options and not any("ftz=true" in o for o in options)
    assert "--fmad=false" in options
    assert binary == b"binary of src for 90" and lowered == {"k<0>": "_Z0", "k<1>": "_Z1"}


def test_second_compile_comes_from_the_disk_cache(cache):
    first = nvrtc_cache.compile_group(FakeCupy(), "src", NVRTC_OPTIONS, "90", ["k<0>"])
    cp = FakeCupy()
    assert nvrtc_cache.compile_group(cp, "src", NVRTC_OPTIONS, "90", ["k<0>"]) == first
    assert cp.calls == []


@pytest.mark.parametrize("change", ["source", "options", "arch", "names", "cupy"])
def test_any_input_change_recompiles(cache, change):
    args = dict(source="src", options=NVRTC_OPTIONS, arch="90", names=["k<0>"])
    nvrtc_cache.compile_group(FakeCupy(), **args)
    new = {"source": "src2", "options": tuple(NVRTC_OPTIONS) + ("-G",), "arch": "80",
           "names": ["k<0>", "k<1>"], "cupy": None}[change]
    if change != "cupy":
        args[change] = new
    cp = FakeCupy(version="14.3.0" if change == "cupy" else "14.2.0")
    nvrtc_cache.compile_group(cp, **args)
    assert len(cp.calls) == 1


@pytest.mark.parametrize("damage", ["binary", "meta", "garbage_meta", "missing_meta"])
def test_a_damaged_cache_entry_is_compiled_again(cache, damage):
    nvrtc_cache.compile_group(FakeCupy(), "src", NVRTC_OPTIONS, "90", ["k<0>"])
    binary = next(cache.glob("*.bin"))
    meta = binary.with_suffix(".json")
    if damage == "binary":
        binary.write_bytes(b"torn")
    elif damage == "meta":
        meta.write_text('{"lowered": {"other": "_Z9"}, "sha256": "0"}')
    elif damage == "garbage_meta":
        meta.write_bytes(b"\xff\x00 not json")
    else:
        meta.unlink()
    cp = FakeCupy()
    binary_out, lowered = nvrtc_cache.compile_group(cp, "src", NVRTC_OPTIONS, "90", ["k<0>"])
    assert len(cp.calls) == 1 and binary_out == b"binary of src for 90" and lowered == {"k<0>": "_Z0"}
    # and the entry is whole again
    assert nvrtc_cache.compile_group(FakeCupy(), "src", NVRTC_OPTIONS, "90", ["k<0>"]) == (binary_out, lowered)


def test_an_unwritable_cache_only_costs_a_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLATCOMM_KERNEL_CACHE", str(blocker / "sub"))
    cp = FakeCupy()
    for _ in range(2):
        assert nvrtc_cache.compile_group(cp, "src", NVRTC_OPTIONS, "90", ["k<0>"])[0] == b"binary of src for 90"
    assert len(cp.calls) == 2
