#!/usr/bin/env bash
# The package as a user gets it: sdist -> wheel -> install into a fresh venv -> use it from a directory
# outside the checkout. `make dist-check` runs it (so does .ci/run).
#
#   .ci/dist_check.sh PYTHON BASE_PYTHON
#
# PYTHON (the project venv's) makes the sdist; BASE_PYTHON (a plain interpreter, no torch) makes the
# fresh venv, which gets torch from the package index and nothing from the checkout or its venv.
# The wheel is built in that venv without build isolation: an isolated build would install the same
# torch a second time (the extension must be compiled against the torch it runs with anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${1:-.venv/bin/python}
BASE=${2:-python3}
TORCH=${TORCH_SPEC:-torch==2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/flatcomm-dist.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS
step() { printf '[dist-check %3ss] %s\n' "$((SECONDS - T0))" "$*"; }

step "sdist"
"$PY" setup.py -q sdist -d "$WORK/dist" > "$WORK/sdist.log" 2>&1 \
    || { cat "$WORK/sdist.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/flatcomm-*.tar.gz)
"$PY" "$ROOT/.ci/dist_manifest.py" "$SDIST" "$ROOT"

step "fresh venv ($("$BASE" --version 2>&1)) + $TORCH + build tools"
"$BASE" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q "$TORCH" setuptools wheel ninja > "$WORK/venv.log" 2>&1 \
    || { tail -50 "$WORK/venv.log"; exit 1; }

step "wheel from the sdist"
FLATCOMM_CUDA=0 "$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/wheels" "$SDIST" \
    > "$WORK/wheel.log" 2>&1 || { tail -50 "$WORK/wheel.log"; exit 1; }
WHEEL=$(ls "$WORK"/wheels/flatcomm-*.whl)
step "install $(basename "$WHEEL")"
"$VPY" -m pip install -q "$WHEEL" > "$WORK/install.log" 2>&1 || { tail -50 "$WORK/install.log"; exit 1; }

# numpy is not a run-time dependency (torch does not need it either): the checks below run without it.
if "$VPY" -m pip list 2>/dev/null | grep -qi '^numpy '; then
    step "uninstall numpy (pulled in by $TORCH): flatcomm must run without it"
    "$VPY" -m pip uninstall -q -y numpy > "$WORK/uninstall.log" 2>&1 || { cat "$WORK/uninstall.log"; exit 1; }
fi
if "$VPY" -c "import numpy" 2> /dev/null; then echo "numpy is still importable in the fresh venv" >&2; exit 1; fi

mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"  # nothing of the checkout on sys.path
step "import + one op"
"$VPY" - "$ROOT" <<'EOF'
import sys
from pathlib import Path

import torch

import flatcomm

root = Path(sys.argv[1]).resolve()
where = Path(flatcomm.__file__).resolve()
assert root not in where.parents, f"flatcomm imported from the checkout: {where}"
x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
r = torch.zeros_like(x)
p = flatcomm.encode(x, "int8", residual=r)
y = flatcomm.decode(p, "int8", x.numel())
err = float((x.double() - (y.double() + r.double())).abs().max())  # error feedback: nothing is lost
assert err == 0.0, err
info = flatcomm.build_info()
assert (where.parent / "py.typed").exists(), "py.typed missing from the wheel"
assert (where.parent / "_csrc" / "cuda" / "device.cuh").exists(), "kernel sources missing from the wheel"
print(f"flatcomm {flatcomm.__version__} from {where.parent}; torch {torch.__version__}; "
      f"simd {info.get('simd')}; int8 round trip + residual exact")
EOF
# One small size, no pure-torch references: this checks that the installed CLI runs (the
# benchmark at 25M with references takes minutes; timings are not the point here).
step "python -m flatcomm.bench kernels --quick --no-ref --sizes 1M"
"$VPY" -m flatcomm.bench kernels --quick --no-ref --sizes 1M --json "$WORK/kernels.json" > "$WORK/bench.out" 2> "$WORK/bench.err" \
    || { cat "$WORK/bench.out" "$WORK/bench.err"; exit 1; }
cat "$WORK/bench.out"
"$VPY" -m flatcomm.bench --version
step "2 gloo ranks, no numpy: DiLoCo sync, flatcomm backend all_reduce, DDP step with the flatcomm hook"
cp "$ROOT/.ci/dist_smoke.py" "$WORK/elsewhere/"
"$VPY" "$WORK/elsewhere/dist_smoke.py"
step "ok"
