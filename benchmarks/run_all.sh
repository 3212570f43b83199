#!/usr/bin/env bash
# The four benchmarks behind the README's bf16 tables (forward, overhead, layers,
# never_slower), one after the other, results under one folder. The others (autotune, fp8,
# fp8_profile, multi_gpu, soak) run alone: see benchmarks/README.md.
#
#   bash benchmarks/run_all.sh [OUT [NAME...]]   # OUT defaults to benchmarks/results
#   bash benchmarks/run_all.sh OUT forward overhead  # only these (forward, overhead, layers,
#                                                    # never_slower)
#   PYTHON=/path/to/python3 bash benchmarks/run_all.sh OUT
#   SMOKE=1 bash benchmarks/run_all.sh /tmp/smoke   # tiny shapes: checks the scripts on a CPU
#
# A benchmark that fails is reported and the others still run; the exit status is non-zero
# if any failed.
set -uo pipefail

PYTHON="${PYTHON:-python3}"
mkdir -p "${1:-benchmarks/results}"
OUT="$(cd "${1:-benchmarks/results}" && pwd)"
cd "$(dirname "$0")/.."

SMOKE_FLAG=()
if [[ "${SMOKE:-0}" != "0" ]]; then SMOKE_FLAG=(--smoke); fi

# nvmath-python runs on torch tensors in the same process as JAX: leave torch some memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"

"$PYTHON" -c 'import jax; print("devices:", jax.devices())' | tee "$OUT/devices.txt"

failed=()
run() {
    local name="$1"; shift
    echo "=== $name: $*"
    local start=$SECONDS
    if "$PYTHON" "$@" "${SMOKE_FLAG[@]}" --out "$OUT"; then
        echo "=== $name: done in $((SECONDS - start)) s"
    else
        echo "=== $name: FAILED (exit $?) after $((SECONDS - start)) s"
        failed+=("$name")
    fi
}

# Every benchmark takes about 5 minutes on an H200 (layers ~6): name some of them to split
# the run across commands with a time limit.
selected=("${@:2}")
if (( ${#selected[@]} == 0 )); then selected=(forward overhead layers never_slower); fi
for name in "${selected[@]}"; do
    case "$name" in
        forward|overhead|layers) run "$name" "benchmarks/${name}_bench.py" ;;
        never_slower) run "$name" "benchmarks/never_slower.py" ;;
        *) echo "unknown benchmark '$name': expected forward, overhead, layers or never_slower"
           failed+=("$name") ;;
    esac
done

echo "results in $OUT:"; ls -l "$OUT"
if (( ${#failed[@]} )); then
    echo "failed: ${failed[*]}"
    exit 1
fi
