#!/usr/bin/env bash
# One-shot GPU check of flatcomm, for a machine with an NVIDIA GPU, torch with CUDA and nvcc, and no
# internet. Run from anywhere (it cds to the repo root):
#
#     bash benchmarks/gpu_check.sh            # results under $OUT if set, else out/gpu_check/
#
# Steps, each under its own timeout, all together within GPU_CHECK_BUDGET_S seconds (default 480):
#   1. environment: the machine's python3 (never .venv), torch + CUDA, nvidia-smi, nvcc, ninja
#   2. build the extension in place with CUDA (FLATCOMM_CUDA=1 python3 setup.py build_ext --inplace)
#   3. benchmarks/gpu_check.py: CUDA vs CPU bitwise on every op / codec / dtype, then timing at 64M
#      values (median and min-max of 20 repeats, x copy_) with the speed targets as TARGET lines
#      -> gpu_check.txt, gpu_check.json
#   4. cupy / NVRTC path, when cupy imports: gpu_check.py --cupy (NVRTC kernels vs CPU and vs the
#      compiled kernels, bitwise; int8 encode+EF time of both) -> cupy_check.txt, cupy_check.json
#   5. collectives over NCCL, world size 1 (<= 60 s): gpu_check.py --collectives (CUDA tensors vs CPU
#      over gloo, bitwise; streams, CUDA-aware futures, a DDP step, a DiLoCo run) -> collectives.txt, collectives.json
#   5b. flatcomm.elastic with CUDA parameters (<= 90 s, needs torchft): two islands of one rank on the
#      same GPU, master/momentum in pinned host memory and then on the device, the exchange on gloo
#      from host buffers (benchmarks/gpu_check_islands.py) -> islands.txt, islands.json
#   6. compute-sanitizer memcheck on gpu_check.py --sanitize (tiny sizes, every op); racecheck and
#      initcheck too when time is left -> sanitizer_<tool>.txt
#   7. summary (also in summary.txt): each step, then each fix of the first GPU run (docs/gpu.md)
#      with the step that checks it, the targets and the failures
# Exit status: 0 everything passed; 1 a step failed; 2 no usable CUDA (torch without CUDA / no GPU).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-480}
RESULTS=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check_sh.log") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null || true' EXIT  # let tee finish the log

section() { printf '\n==================== %s  [t=%ss]\n' "$*" "$((SECONDS - T0))"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
declare -A STATUS=()
ORDER=()
status() { STATUS[$1]=$2; ORDER+=("$1"); }

# ---- 1. environment ----------------------------------------------------------------------------
section "1. environment"
# The machine's python: drop a project .venv (a CPU-only torch) from PATH.
unset VIRTUAL_ENV PYTHONHOME || true
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | { grep -v -x -F -e "$ROOT/.venv/bin" -e "$ROOT/.venv/bin/" || true; } | paste -sd: -)
export PATH
PY=${PYTHON:-python3}
echo "python: $(command -v "$PY" || echo 'not found') ($("$PY" --version 2>&1 || true))"
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "ERROR: $PY has no torch with a usable CUDA device:"
    "$PY" -c 'import torch; print("  torch", torch.__version__, "cuda", torch.version.cuda,
        "is_available", torch.cuda.is_available())' 2>&1 | sed 's/^/  /' || true
    echo "This check needs an NVIDIA GPU and a CUDA build of torch (not the CPU-only .venv)."
    exit 2
fi
timeout 30 nvidia-smi -L || echo "(nvidia-smi -L failed)"
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory \
    --format=csv 2>/dev/null || true
if "$PY" - <<'EOF'
import platform, torch
from torch.utils import cpp_extension
p = torch.cuda.get_device_properties(0)
print(f"python {platform.python_version()}  torch {torch.__version__}  torch CUDA {torch.version.cuda}  "
      f"cuDNN {torch.backends.cudnn.version()}")
print(f"device 0: {p.name}  sm_{p.major}{p.minor}  {p.total_memory / 2**30:.0f} GiB  "
      f"{p.multi_processor_count} SMs   CUDA_HOME={cpp_extension.CUDA_HOME}")
EOF
then :; else echo "(environment query failed; continuing)"; fi
# nvcc: torch finds it through CUDA_HOME or PATH; add the usual toolkit location if PATH lacks it.
if ! command -v nvcc >/dev/null; then
    for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13.0; do
        if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
    done
fi
echo "nvcc: $(command -v nvcc || echo 'NOT FOUND') $(nvcc --version 2>/dev/null | tail -1 || true)"
echo "c++:  $(c++ --version 2>/dev/null | head -1 || echo 'NOT FOUND')"
echo "cpus: $(nproc)"
# ninja: setup.py asks for BuildExtension.with_options(use_ninja=True). torch checks
# is_ninja_available(), which runs `ninja --version` (the executable on PATH, not the Python module);
# without it BuildExtension.__init__ logs "Attempted to use ninja as the BuildExtension backend but we
# could not find ninja. Falling back to using the slow distutils backend." and sets use_ninja=False
# (torch/utils/cpp_extension.py, checked in torch 2.13). The build still works, but compiles the
# sources one after another (MAX_JOBS is then ignored): about 3-4 min instead of ~1.5 min.
# The pip `ninja` module ships the executable; put its directory on PATH when only the module exists.
if ! command -v ninja >/dev/null; then
    NINJA_DIR=$("$PY" -c 'import ninja, os; print(getattr(ninja, "BIN_DIR", ""))' 2>/dev/null || true)
    if [ -n "$NINJA_DIR" ] && [ -x "$NINJA_DIR/ninja" ]; then export PATH="$NINJA_DIR:$PATH"; fi
fi
if command -v ninja >/dev/null; then
    echo "ninja: $(command -v ninja) $(ninja --version)"
else
    echo "ninja: not found (no executable, no python module): torch falls back to the serial distutils build"
fi

# ---- 2. build ----------------------------------------------------------------------------------
section "2. build (FLATCOMM_CUDA=1, in place)"
T_BUILD=$(min 300 $(( $(left) - 120 )))
export FLATCOMM_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
# nvcc builds sm_80 and sm_90 (setup.py CUDA_ARCHS) of kernels.cu in parallel: setup.py passes
# --threads 0 (a second --threads here only made nvcc warn; 61 s in all on the H200's 16 cores).
set +e
timeout -k 10 "$T_BUILD" "$PY" setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1
rc=$?
set -e
grep -iE "warning|error" "$RESULTS/build.log" | head -25 || true
if [ $rc -ne 0 ]; then
    echo "BUILD FAILED (rc $rc$([ $rc -eq 124 ] && echo ", timed out after ${T_BUILD}s")); last lines of build.log:"
    tail -60 "$RESULTS/build.log"
    status build "FAILED rc=$rc"
else
    echo "built in $((SECONDS - T0))s total so far: $(ls flatcomm/_C*.so)"
    if "$PY" -c 'import flatcomm, sys; i = flatcomm.build_info(); print(i); sys.exit(0 if "cuda" in i["devices"] else 1)'; then
        status build ok
    else
        echo "the built flatcomm._C has no CUDA kernels"
        status build "FAILED (no cuda in build_info)"
    fi
fi

# ---- 3. correctness + timing -------------------------------------------------------------------
CHECK_RC=skipped
if [ "${STATUS[build]}" = ok ]; then
    section "3. gpu_check.py: CUDA vs CPU bitwise, then timing"
    T_CHECK=$(min 240 $(( $(left) - 190 )))  # leaves time for the cupy and collectives steps
    T_CHECK=$(( T_CHECK < 60 ? 60 : T_CHECK ))
    # the correctness sweep stops starting cases after --max-seconds, leaving ~60 s for CUDA
    # start-up and the timing table (typically: sweep ~1 min, timing ~20 s on an H200)
    set +e
    timeout -k 15 "$T_CHECK" "$PY" -u benchmarks/gpu_check.py --json "$RESULTS/gpu_check.json" \
        --max-seconds $(( T_CHECK - 60 )) 2>&1 | tee "$RESULTS/gpu_check.txt"
    CHECK_RC=${PIPESTATUS[0]}
    set -e
    case $CHECK_RC in
        0) status gpu_check ok ;;
        124|137) status gpu_check "TIMED OUT after ${T_CHECK}s (partial JSON if any)" ;;
        *) status gpu_check "FAILED rc=$CHECK_RC" ;;
    esac
    # the sanitizer runs reuse this seed (printed first as "..., seed N (rerun with --seed N)")
    SEED=$(grep -m1 -o 'seed [0-9]*' "$RESULTS/gpu_check.txt" | head -1 | awk '{print $2}' || true)
else
    status gpu_check "skipped (no build)"
fi

# ---- 4. cupy / NVRTC ---------------------------------------------------------------------------
# The optional runtime-compiled path (flatcomm/ops/cupy_backend.py): NVRTC compiles the same kernel
# sources (~108 kernels, first run ~1 min, then cupy's disk cache), a short sweep against the CPU
# with the NVRTC ops in place of the compiled ones, a direct bitwise comparison with the compiled
# kernels, and the int8 encode+EF time of both paths.
section "4. cupy / NVRTC path (gpu_check.py --cupy)"
if [ "${STATUS[build]}" != ok ]; then
    status cupy "skipped (no build)"
elif ! timeout 60 "$PY" -c 'import cupy' 2>/dev/null; then
    echo "cupy does not import: skipped"; status cupy "skipped (no cupy)"
elif [ "$(left)" -lt 90 ]; then
    status cupy "skipped (time budget)"
else
    T_CUPY=$(min 180 $(( $(left) - 120 )))  # leaves time for the collectives and the sanitizer
    T_CUPY=$(( T_CUPY < 30 ? 30 : T_CUPY ))
    "$PY" -c 'import cupy; print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())' || true
    set +e
    timeout -k 10 "$T_CUPY" "$PY" -u benchmarks/gpu_check.py --cupy ${SEED:+--seed $SEED} \
        --max-seconds $(( T_CUPY - 90 > 30 ? T_CUPY - 90 : 30 )) --json "$RESULTS/cupy_check.json" 2>&1 \
        | tee "$RESULTS/cupy_check.txt"
    rc=${PIPESTATUS[0]}
    set -e
    case $rc in
        0) status cupy ok ;;
        124|137) status cupy "partial: timed out after ${T_CUPY}s" ;;
        *) status cupy "FAILED rc=$rc" ;;
    esac
fi

# ---- 5. collectives over NCCL -------------------------------------------------------------------
# flatcomm.collectives on CUDA tensors through a world-size-1 NCCL group (file:// rendezvous in a temp
# dir, in one process) against the same calls on CPU tensors through gloo, bitwise, also with the
# exchange forced through NCCL at world size 1; inputs written behind a busy caller stream, async
# results consumed on another stream, three DDP steps with the int8 hook. Skipped (not failed) when
# torch.distributed or NCCL is missing.
section "5. collectives over NCCL (gpu_check.py --collectives, world size 1)"
if [ "${STATUS[build]}" != ok ]; then
    status collectives "skipped (no build)"
elif ! "$PY" -c 'import sys, torch.distributed as d; sys.exit(0 if d.is_available() and d.is_nccl_available() else 1)' 2>/dev/null; then
    echo "torch.distributed / NCCL not available: skipped"; status collectives "skipped (no NCCL)"
elif [ "$(left)" -lt 90 ]; then
    status collectives "skipped (time budget)"
else
    T_COLL=$(min 60 $(( $(left) - 60 )))  # leaves a minute for the sanitizer
    set +e
    timeout -k 10 "$T_COLL" "$PY" -u benchmarks/gpu_check.py --collectives ${SEED:+--seed $SEED} \
        --max-seconds $(( T_COLL - 25 > 15 ? T_COLL - 25 : 15 )) --json "$RESULTS/collectives.json" 2>&1 \
        | tee "$RESULTS/collectives.txt"
    rc=${PIPESTATUS[0]}
    set -e
    case $rc in
        0) if grep -q "^collectives: skipped\|  skipped: " "$RESULTS/collectives.txt"; then
               status collectives "skipped ($(grep -m1 -o 'skipped: .*' "$RESULTS/collectives.txt" | sed 's/^skipped: //'))"
           else status collectives ok; fi ;;
        124|137) status collectives "TIMED OUT after ${T_COLL}s" ;;
        *) status collectives "FAILED rc=$rc" ;;
    esac
fi

# ---- 5b. islands: flatcomm.elastic with CUDA parameters -------------------------------------------
# Two islands of one rank on device 0 under a torchft lighthouse in the script's process: masters
# equal across the islands after every sync, master/momentum pinned on the host (default) or on the
# device (state_device="device"), residuals pinned on the host, the parameters = the master after
# the last sync. Skipped (not failed) without torchft.
section "5b. islands on one GPU (gpu_check_islands.py: two islands of one rank)"
if [ "${STATUS[build]}" != ok ]; then
    status islands "skipped (no build)"
elif ! timeout 60 "$PY" -c 'import torchft' 2>/dev/null; then
    echo "torchft does not import: skipped"; status islands "skipped (no torchft)"
elif [ "$(left)" -lt 120 ]; then
    status islands "skipped (time budget)"
else
    T_ISL=$(min 90 $(( $(left) - 60 )))
    set +e
    timeout -k 10 "$T_ISL" "$PY" -u benchmarks/gpu_check_islands.py --device cuda:0 --json "$RESULTS/islands.json" 2>&1 \
        | grep -v "torchft::" | tee "$RESULTS/islands.txt"
    rc=${PIPESTATUS[0]}
    set -e
    case $rc in
        0) if grep -q "^islands: skipped" "$RESULTS/islands.txt"; then status islands "skipped (no CUDA)"
           else status islands ok; fi ;;
        124|137) status islands "TIMED OUT after ${T_ISL}s" ;;
        *) status islands "FAILED rc=$rc" ;;
    esac
fi

# ---- 6. compute-sanitizer ----------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || true)
for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin "${CUDA_HOME:-/nonexistent}/bin" "$(dirname "$(command -v nvcc || echo /x/x)")"; do
    if [ -z "$SAN" ] && [ -x "$d/compute-sanitizer" ]; then SAN=$d/compute-sanitizer; fi
done
run_sanitizer() {  # tool, max seconds
    local tool=$1 t=$2 log="$RESULTS/sanitizer_$1.txt" opts=() rc
    local help
    help=$("$SAN" --help 2>&1 || true)
    # torch's own API calls may return benign errors; report kernel errors only
    if grep -q -- "--report-api-errors" <<<"$help"; then opts+=(--report-api-errors no); fi
    if grep -q -- "--print-limit" <<<"$help"; then opts+=(--print-limit 30); fi
    section "6. compute-sanitizer --tool $tool (gpu_check.py --sanitize, ${t}s max)"
    # No caching allocator: every tensor is its own cudaMalloc, so out-of-bounds accesses are seen.
    set +e
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$t" "$SAN" --tool "$tool" --error-exitcode 99 \
        ${opts[@]+"${opts[@]}"} "$PY" -u benchmarks/gpu_check.py --sanitize ${SEED:+--seed $SEED} \
        --max-seconds $(( t - 60 > 20 ? t - 60 : 20 )) > "$log" 2>&1
    rc=$?
    set -e
    # kinds of reports, most frequent first
    grep -E "^=+ +(Invalid|Uninitialized|Misaligned|Out-of-range|Error|Race|Warning|Program hit)" "$log" \
        | sed -E 's/0x[0-9a-f]+/0x../g; s/[0-9]+ bytes/N bytes/' | sort | uniq -c | sort -rn | head -15 || true
    grep -E "passed, .* failed|cases skipped|ERROR SUMMARY|RACECHECK SUMMARY" "$log" || true
    local summary nerr
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 || true)
    nerr=$(grep -cE "^=+ +(Invalid|Uninitialized|Misaligned|Out-of-range|Error|Race|Warning: Race|Program hit)" "$log" || true)
    if [ "${nerr:-0}" -gt 0 ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 99 ]; then rc=99; fi
    case $rc in
        0) status "sanitizer $tool" "ok: ${summary:-no summary line}" ;;
        99) status "sanitizer $tool" "ERRORS: $summary (see sanitizer_$tool.txt)"; tail -40 "$log" ;;
        124|137) status "sanitizer $tool" "partial: timed out after ${t}s, no error reported before: ${summary:-no summary}" ;;
        *) status "sanitizer $tool" "rc=$rc: ${summary:-no summary}"; tail -30 "$log" ;;
    esac
}
if [ "${STATUS[build]}" != ok ]; then
    status sanitizer "skipped (no build)"
elif [ -z "$SAN" ]; then
    section "6. compute-sanitizer"
    echo "compute-sanitizer not found (PATH, /usr/local/cuda/bin, CUDA_HOME/bin, next to nvcc): skipped"
    status sanitizer "skipped (compute-sanitizer not found)"
else
    echo "compute-sanitizer: $SAN"
    if [ "$(left)" -ge 60 ]; then run_sanitizer memcheck "$(min 120 $(( $(left) - 25 )))"
    else status "sanitizer memcheck" "skipped (time budget)"; fi
    # racecheck checks the first run's topk decode race and the shared-memory kernels written
    # since (it took 44 s on the H200): it runs with a minute left; initcheck (8 s) after it.
    for tool in racecheck initcheck; do
        need=$([ "$tool" = racecheck ] && echo 75 || echo 50)
        if [ "$(left)" -ge "$need" ]; then run_sanitizer "$tool" "$(min 150 $(( $(left) - 15 )))"
        else status "sanitizer $tool" "skipped (time budget)"; fi
    done
fi

# ---- 7. summary --------------------------------------------------------------------------------
section "7. summary"
# The first GPU run (2026-12-04, docs/gpu.md) found five faults, fixed on CPU-only machines since;
# each line names the step of this run that checks its fix.
target_of() {  # "MET" / "MISSED" / "not timed" for one speed-target row of gpu_check.txt
    local line
    line=$(grep -E "TARGET (MET|MISSED) +$1 " "$RESULTS/gpu_check.txt" 2>/dev/null | head -1 || true)
    if [ -z "$line" ]; then echo "not timed"; else awk '{print $2}' <<<"$line"; fi
}
diloco_fix() {
    if [ -f "$RESULTS/collectives.txt" ] && grep -q "FAIL DiLoCo" "$RESULTS/collectives.txt"; then echo "FAILED (see collectives.txt)"
    elif [ "${STATUS[collectives]:-}" = ok ]; then echo ok
    else echo "not shown: collectives ${STATUS[collectives]:-not run}"; fi
}
FIXES=(
    "ninja arch-list quoting (9b1a8b0)|build: ${STATUS[build]:-not run}"
    "topk decode race (d0e87a7)|racecheck: ${STATUS[sanitizer racecheck]:-${STATUS[sanitizer]:-not run}}"
    "cupy -ftz=true (548066c)|cupy step: ${STATUS[cupy]:-not run}"
    "DiLoCo check at 1 ulp (94a4266)|collectives [diloco]: $(diloco_fix)"
    "slow encoders (19a35e5, 0d88d5e)|int8 $(target_of 'encode\+EF int8'), int4 $(target_of 'encode\+EF int4'), sign $(target_of 'encode\+EF sign')"
)
{
    for k in "${ORDER[@]}"; do printf '  %-22s %s\n' "$k" "${STATUS[$k]}"; done
    echo "  fixes of the first GPU run:"
    for f in "${FIXES[@]}"; do printf '    %-34s %s\n' "${f%%|*}" "${f#*|}"; done
    if [ -f "$RESULTS/gpu_check.txt" ]; then
        grep -E "passed, .* failed|TARGET|cases skipped|context is broken" "$RESULTS/gpu_check.txt" | sed 's/^ */  /' || true
    fi
    if [ -f "$RESULTS/collectives.txt" ]; then
        grep -E "collectives, .* passed|FAIL " "$RESULTS/collectives.txt" | head -12 | sed 's/^ */  /' || true
    fi
    if [ -f "$RESULTS/islands.txt" ]; then
        grep -E "^islands" "$RESULTS/islands.txt" | sed 's/^ */  /' || true
    fi
    echo "  total time: $((SECONDS - T0))s; results in $RESULTS"
} | tee "$RESULTS/summary.txt"
FAILED=0
for k in "${ORDER[@]}"; do
    case ${STATUS[$k]} in ok*|skipped*|partial*) ;; *) FAILED=1 ;; esac
done
exit $FAILED
