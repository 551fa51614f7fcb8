# Quick start: `make demo` and `make test`. Both create .venv and build the extension first; the
# venv gets only what the target needs: `make demo` torch + the build tools + matplotlib (for its
# plot), `make test` also the test tools, mypy and the frameworks of flatcomm.integrations.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.base
DEMO_DEPS := $(VENV)/.demo
DEPS := $(VENV)/.deps
EXT := build/.ext-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py
NVCC ?= nvcc
NVCC_FLAGS := -std=c++17 -O3 -fmad=false -Icsrc --threads 0 \
	-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	-gencode arch=compute_90,code=compute_90
# The torch installed when .venv has none: the CPU build (the demo and the tests run on CPU), from
# pip's configured indexes. Where they lack `+cpu` wheels, add PyTorch's CPU index as TORCH_INDEX
# (docs/build.md); `make demo TORCH=torch==2.13.0` takes your index's default build instead.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=

.PHONY: all venv build demo test test-fast test-slow test-cpp test-py test-conformance typecheck bench microbench dist-check cuda-check clean

all: build

# torch and the build tools: what building flatcomm._C needs.
$(BASE):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || \
		$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q setuptools wheel ninja
	touch $@

# what python -m flatcomm.demo imports beyond torch: matplotlib (its plot)
$(DEMO_DEPS): $(BASE)
	$(PY) -m pip install -q matplotlib
	touch $@

# the tests, mypy, the frameworks of flatcomm.integrations and torchft for flatcomm.elastic (the
# `integrations` and `elastic` extras), keeping the installed torch
$(DEPS): $(DEMO_DEPS) pyproject.toml
	$(PY) -m pip install -q pytest pytest-benchmark pytest-timeout hypothesis numpy mypy expecttest
	$(PY) -m pip install -q $$($(PY) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(d['integrations'] + d['elastic']))") \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@

venv: $(DEPS)

$(EXT): $(BASE) $(SOURCES)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $@

build: $(EXT)

demo: build $(DEMO_DEPS)
	$(PY) -m flatcomm.demo

# pytest leaves a core idle much of the time (ranks waiting on each other, timeouts under test):
# the C++ tests and mypy run beside it at the lowest CPU priority, their output printed after it.
test: build $(DEPS)
	@nice -n 19 $(MAKE) --no-print-directory -j2 test-cpp typecheck > build/test-cpp.log 2>&1 & bg=$$!; \
	$(MAKE) --no-print-directory test-py; py=$$?; \
	wait $$bg; cpp=$$?; cat build/test-cpp.log; \
	echo "make test: pytest rc $$py, C++ tests + mypy rc $$cpp"; test $$py -eq 0 -a $$cpp -eq 0

test-cpp:
	cmake -S . -B build-cmake -DFLATCOMM_CUDA=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build build-cmake -j2
	ctest --test-dir build-cmake --output-on-failure -j2

# Everything but the tests marked `slow`, with the 20 slowest tests listed (where the time goes).
# tests/test_nvrtc.py (CUDA source compiled by NVRTC, ~35 s) runs in `make cuda-check`, with the
# CUDA compile checks.
test-py: build $(DEPS)
	$(PY) -m pytest tests -m "not slow" --durations=20 --ignore=tests/test_nvrtc.py

# The tests marked `slow` (each 10-30 s by itself: framework examples, torchrun kill-and-resume,
# torch's own suite on the backend, 4-rank and churn runs, about 4 minutes in all): CI runs them
# after `make test`, so that the quick start's `make test` stays within 15 minutes on 2 cores.
test-slow: build $(DEPS)
	$(PY) -m pytest tests -m slow --durations=10 --ignore=tests/test_nvrtc.py

# torch's own distributed suite (_DistTestBase) on the flatcomm backend, 2 and 3 ranks, ordered and
# exact (tests/test_backend_conformance.py). Not in `make test` nor .ci/run: every test starts its
# ranks: 285 tests, 13-20 min per configuration on 2 quiet cores, ~1 h for all four. CONFORMANCE_K narrows it
# (pytest -k), e.g. make test-conformance CONFORMANCE_K="all_reduce or reduce_scatter or ddp".
CONFORMANCE_K ?=
test-conformance: build
	@for n in 2 3; do for mode in ordered exact; do echo "== $$n ranks, $$mode"; \
	  FLATCOMM_CONFORMANCE=1 WORLD_SIZE=$$n FLATCOMM_BACKEND_MODE=$$mode $(PY) -m pytest \
	    tests/test_backend_conformance.py -q -rfEx -p no:cacheprovider $(if $(CONFORMANCE_K),-k "$(CONFORMANCE_K)") \
	    || exit 1; done; done

# The loop while editing (about 3 minutes on 2 cores): the single-process tests and a few multi-rank
# smoke tests (markers: pyproject.toml). `make test` runs all but the slow ones, `make test-slow` those.
test-fast: build $(DEPS)
	$(PY) -m pytest tests -m "not multiprocess and not slow or smoke" --durations=10 --ignore=tests/test_nvrtc.py

typecheck: $(DEPS)
	$(PY) -m mypy flatcomm

bench: build
	$(PY) -m flatcomm.bench kernels

# The kernels under pytest-benchmark (min/median/max, --benchmark-compare against a saved run).
microbench: build $(DEPS)
	$(PY) -m pytest benchmarks/test_microbench.py --benchmark-only --benchmark-sort=name

# The package as users get it: sdist -> wheel -> install into a fresh venv (torch from the package
# index, nothing from this checkout or .venv) -> import, one op and `python -m flatcomm.bench kernels
# --quick` from a directory outside the checkout (.ci/dist_check.sh).
dist-check: $(DEPS)
	bash .ci/dist_check.sh $(PY) $(PYTHON)

# Every CUDA source must compile with this machine's nvcc, GPU or not. The torch binding
# (ops_cuda.cpp) is syntax-checked against torch's headers and the CUDA toolkit; a CPU build of
# torch lacks one generated header, which an empty stand-in replaces for this check only.
TORCH_INC = $(shell $(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))" 2>/dev/null)
CUDA_INC := $(dir $(shell command -v $(NVCC) 2>/dev/null))../include
# The cupy path's NVRTC source is compiled too (tests/test_nvrtc.py, for compute_80 and compute_90),
# with libnvrtc from the nvidia-cuda-nvrtc wheel matching nvcc's version (~60 MB, installed once).
NVRTC_STAMP := $(VENV)/.nvrtc
$(NVRTC_STAMP): $(DEPS)
	@v=$$($(NVCC) --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p'); \
	case $$v in 12.*) pkg=nvidia-cuda-nvrtc-cu12 ;; *) pkg=nvidia-cuda-nvrtc ;; esac; \
	if $(PY) -m pip install -q "$$pkg==$$v.*"; then touch $@; \
	else echo "$$pkg==$$v.* not installable: tests/test_nvrtc.py will skip"; fi
# cupy itself (~70 MB) in a folder of its own, seen by tests/test_nvrtc.py alone: the cupy path's
# compile route (cupy's compile_using_nvrtc, which must not add -ftz=true as its RawModule does).
# Outside .venv: the rest of the tests run without cupy, as most users do.
CUPY_SITE := build/cupy-site
$(CUPY_SITE)/.stamp: $(DEPS)
	@major=$$($(NVCC) --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p'); \
	if $(PY) -m pip install -q --no-deps --target $(CUPY_SITE) "cupy-cuda$${major}x" fastrlock cuda-pathfinder; \
	then touch $@; else echo "cupy-cuda$${major}x not installable: its test in tests/test_nvrtc.py will skip"; fi
cuda-check: $(EXT) $(DEPS) $(NVRTC_STAMP) $(CUPY_SITE)/.stamp  # test_nvrtc imports flatcomm: the extension must exist
	@mkdir -p build/cuda-stubs/c10/cuda/impl && touch build/cuda-stubs/c10/cuda/impl/cuda_cmake_macros.h
	@for f in csrc/cuda/*.cu; do echo "nvcc $$f"; $(NVCC) $(NVCC_FLAGS) -c $$f -o build/$$(basename $$f).o || exit 1; done
	echo "#include \"cuda/kernels.cuh\"" | g++ -std=c++17 -Icsrc -fsyntax-only -x c++ -
	g++ -std=c++20 -fsyntax-only -Icsrc $(TORCH_INC) -I$(CUDA_INC) -I/usr/local/cuda/include \
		-Ibuild/cuda-stubs csrc/cuda/ops_cuda.cpp
	PYTHONPATH=$(CUPY_SITE) $(PY) -m pytest -q tests/test_nvrtc.py

clean:
	rm -rf build build-cmake flatcomm/_C*.so
