#!/usr/bin/env bash
# FSDP2 quantized weight all-gathers (issue 21): the two runs of docs/bench/fsdp.md, 2 nodes x 1 and
# 2 nodes x 2 ranks on a 1 Gbit/s link, bf16 parameters, a 26M-parameter transformer; then the
# targets checked from the JSON. Needs root (network namespaces); run it on a quiet machine for times.
#
#   benchmarks/fsdp_weights.sh [PYTHON] [OUT_DIR]      (defaults: python, docs/bench)
set -euo pipefail
PY=${1:-python}
OUT=${2:-docs/bench}
for G in 1 2; do
  "$PY" -m flatcomm.bench fsdp --nodes 2 --ranks-per-node "$G" --link 1gbit --weights int8,int4 \
    --param-dtype bf16 --params 25e6 --steps 8 --timeout 2400 \
    --json "$OUT/fsdp_2x${G}_1gbit.json" --plot "$OUT/fsdp_2x${G}_1gbit.png"
done
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
def rows(g):
    return {r["variant"]: r for r in json.load(open(f"{out}/fsdp_2x{g}_1gbit.json"))["results"]}
a, b = rows(1), rows(2)
checks = [
    ("2x1 int8/int8 bytes/param/step <= 1.6", a["int8/int8"]["bytes_per_param"], 1.6),
    ("2x1 int8/int8 step / plain <= 0.5", a["int8/int8"]["step_ratio"], 0.5),
    ("2x2 int8/int8:hpz backward gather bytes/param ~ 0 (<= 0.01)",
     b["int8/int8:hpz"]["kind_bytes_per_param"]["weights_backward"], 0.01),
    ("2x2 int8/int8:hpz bytes/param/step <= 2.0", b["int8/int8:hpz"]["bytes_per_param"], 2.0),
]
for what, got, limit in checks:
    print(f"{what:62s} {got:8.3f}  {'ok' if got <= limit else 'MISS'}")
PYEOF
