"""Build flatcomm._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc exists.

FLATCOMM_CUDA=0 forces a CPU-only build, FLATCOMM_CUDA=1 requires CUDA (and fails loudly without).
Compile flags that matter for correctness: -ffp-contract=off (host) and -fmad=false (nvcc) keep
float math unfused, so every CPU instruction set and the GPU give the same bits.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_ARCHS = ["80", "90"]


def want_cuda() -> bool:
    flag = os.environ.get("FLATCOMM_CUDA", "").strip()
    import torch

    available = torch.version.cuda is not None and (
        cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    )
    if flag == "0":
        return False
    if flag == "1":
        if not available:
            raise RuntimeError(
                "FLATCOMM_CUDA=1 but this torch has no CUDA (torch.version.cuda is None) "
                "or nvcc was not found"
            )
        return True
    return available


def extension():
    cxx = ["-O3", "-std=c++20", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-Wall"]
    sources = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/comm/*.cpp"))
    include = [os.path.join(HERE, "csrc")]
    if not want_cuda():
        return cpp_extension.CppExtension(
            "flatcomm._C",
            sources,
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
    gencode.append(f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}")
    # A bare token list, stringified in registration.cpp: a quoted string literal does not survive
    # both ninja's shell-quoted command lines and distutils' argument lists (nor nvcc's -D lists).
    archs = f"-DFLATCOMM_CUDA_ARCHS={';'.join(CUDA_ARCHS)}"
    return cpp_extension.CUDAExtension(
        "flatcomm._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp")),
        include_dirs=include,
        define_macros=[("FLATCOMM_WITH_CUDA", None)],
        extra_compile_args={
            "cxx": cxx + [archs],
            # --threads 0: one nvcc thread per target architecture (the build on a GPU machine is
            # part of benchmarks/gpu_check.sh's time budget; 37 s -> 24 s on 2 cores)
            "nvcc": ["-O3", "-std=c++17", "-fmad=false", "--expt-relaxed-constexpr", "--threads", "0"] + gencode,
        },
        extra_link_args=["-fopenmp"],
    )


class BuildPyWithKernelSources(build_py):
    """Ship the kernel headers as flatcomm/_csrc: the cupy path compiles them with NVRTC at run
    time (flatcomm/cupy_backend.py), also from an installed wheel that has no source checkout."""

    def run(self):
        super().run()
        for path in glob.glob(os.path.join(HERE, "csrc", "**", "*.h"), recursive=True) + glob.glob(
                os.path.join(HERE, "csrc", "**", "*.cuh"), recursive=True):
            rel = os.path.relpath(path, os.path.join(HERE, "csrc"))
            dst = os.path.join(self.build_lib, "flatcomm", "_csrc", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(path, dst)


setup(
    packages=find_packages(include=["flatcomm", "flatcomm.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True),
              "build_py": BuildPyWithKernelSources},
)
