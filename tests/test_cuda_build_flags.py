"""setup.py's CUDA extension flags survive both ways a build hands them to the compiler.

The first GPU build failed here: a quoted string macro survived distutils' argument lists (what a
CPU build of this checkout uses) but not ninja's shell-quoted command lines (what torch uses when
ninja is installed, as on the GPU machine). No GPU needed: setup.py runs with CUDA forced on and
`setup()` stubbed, and g++ compiles with the flags it produced, through a shell as ninja does and
as an argument list as distutils does.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]

_DRIVER = r"""
import json, os, runpy, sys, setuptools, torch
from torch.utils import cpp_extension
# A CPU torch here: setup.py would build without CUDA, and CUDAExtension finds no toolkit.
torch.version.cuda = "13.0"
cpp_extension.CUDA_HOME = sys.argv[1]
os.environ["FLATCOMM_CUDA"] = "1"
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
ns = runpy.run_path("setup.py")
ext = seen["ext_modules"][0]
print(json.dumps({"macros": ext.define_macros, "cxx": ext.extra_compile_args["cxx"], "archs": ns["CUDA_ARCHS"]}))
"""


@pytest.fixture(scope="module")
def flags():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc): setup.py's CUDAExtension needs one")
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    out = subprocess.run([sys.executable, "-c", _DRIVER, home], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout.strip().splitlines()[-1])
    macros = [f"-D{name}" if value is None else f"-D{name}={value}" for name, value in f["macros"]]
    return macros + f["cxx"], f["archs"]


def test_the_arch_list_reaches_cpp_whole_through_a_shell_and_an_argv(flags, tmp_path):
    args, archs = flags
    src = tmp_path / "archs.cpp"
    src.write_text('#include <cstdio>\n#define S_(x) #x\n#define S(x) S_(x)\nint main() { std::puts(S(FLATCOMM_CUDA_ARCHS)); }\n')
    for how in ("shell", "argv"):
        exe = tmp_path / f"archs_{how}"
        cmd = ["g++", *args, str(src), "-o", str(exe)]
        run = subprocess.run(" ".join(map(shlex.quote, cmd)), shell=True) if how == "shell" else subprocess.run(cmd)
        assert run.returncode == 0, how
        assert subprocess.run([str(exe)], capture_output=True, text=True).stdout.strip() == ";".join(archs)


def test_registration_compiles_with_the_cuda_flags_through_a_shell(flags):
    args, _ = flags
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}",
                                                               f"-I{ROOT / 'csrc'}"]
    cmd = ["g++", "-fsyntax-only", *inc, *args, str(ROOT / "csrc" / "registration.cpp")]
    run = subprocess.run(" ".join(map(shlex.quote, cmd)), shell=True, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
