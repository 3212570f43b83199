#!/usr/bin/env bash
# The whole GPU round, on a machine with a CUDA GPU and no network (the project's H200):
# build the package without build isolation, run the GPU test suite, run the benchmarks.
# Usage: scripts/gpu_round.sh [STAGE...]
#   stages: build tests suite fuzz demo bench autotune probe (default: build tests fuzz demo bench)
# Results go to $OUT (default benchmarks/results/gpu_round); a summary is printed last, and
# everything is also packed into $OUT/gpu_round.tgz (the device tool returns at most 8 files).
# Carry .whl (nvmath-python and its needs) so the nvmath comparisons run too.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/benchmarks/results/gpu_round}"
PY="${PYTHON:-python3}"
STAGES="${*:-build tests fuzz demo bench}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# Wheels carried to a machine without network (nvmath-python and what it needs), if any.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
note "date: $(date -u +%FT%TZ)  gpu: $(cat "$OUT/gpu.txt")"

for stage in $STAGES; do
  start=$SECONDS
  case "$stage" in
    build)
      "$PY" -m pip install -q --no-build-isolation --no-deps "$ROOT" > "$OUT/build.log" 2>&1
      rc=$?
      (cd /tmp && "$PY" -c "import jax, jax_epilog.cuda_library as c; \
print('jax', jax.__version__, 'devices', jax.devices()); \
print('library available:', c.available(), c.unavailable_reason(), 'cuBLASLt', c.cublaslt_version())") \
        2>&1 | tee -a "$OUT/build.log"
      note "build: rc=$rc ($((SECONDS - start)) s); $(tail -n 1 "$OUT/build.log")" ;;
    tests)
      # From /tmp so the installed package (with its library) is imported, not the sources.
      (cd /tmp && "$PY" -m pytest "$ROOT/tests" -q -ra -m gpu -p no:cacheprovider \
        --junitxml="$OUT/gpu_tests.xml" 2>&1) > "$OUT/gpu_tests.log"
      note "gpu tests: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/gpu_tests.log")"
      grep -E "has no kernel|FAILED|Error" "$OUT/gpu_tests.log" | head -40 ;;
    suite)
      # The whole suite with the GPU as default device: the CPU tests then run the kernel too.
      (cd /tmp && "$PY" -m pytest "$ROOT/tests" -q -ra -p no:cacheprovider 2>&1) > "$OUT/suite.log"
      note "whole suite on GPU: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/suite.log")"
      grep -E "FAILED" "$OUT/suite.log" | head -40 ;;
    fuzz)
      if [ -f "$ROOT/tests/gpu_fuzz.py" ]; then
        (cd /tmp && "$PY" "$ROOT/tests/gpu_fuzz.py" 2>&1) > "$OUT/gpu_fuzz.log"
        note "gpu fuzz: rc=$? ($((SECONDS - start)) s): $(tail -n 3 "$OUT/gpu_fuzz.log" | tr '\n' ' ')"
      fi ;;
    demo)
      (cd /tmp && "$PY" -m jax_epilog 2>&1) > "$OUT/demo.log"
      note "demo: rc=$? ($((SECONDS - start)) s)"
      tail -n 12 "$OUT/demo.log" ;;
    bench)
      (cd "$ROOT" && PYTHON="$PY" bash benchmarks/run_all.sh "$OUT/bench" 2>&1) > "$OUT/bench.log"
      note "benchmarks: rc=$? ($((SECONDS - start)) s)"
      tail -n 40 "$OUT/bench.log" ;;
    autotune)
      (cd "$ROOT" && "$PY" benchmarks/autotune_bench.py --out "$OUT/bench" 2>&1) > "$OUT/autotune.log"
      note "autotune benchmark: rc=$? ($((SECONDS - start)) s)"
      tail -n 20 "$OUT/autotune.log" ;;
    probe)
      (cd /tmp && "$PY" "$ROOT/scripts/probe_special_values.py" 2>&1) | tee "$OUT/probe.log"
      note "special-value probe: see probe.log" ;;
    *) note "unknown stage $stage" ;;
  esac
done
tar -C "$(dirname "$OUT")" -czf "/tmp/gpu_round.tgz" "$(basename "$OUT")" && mv /tmp/gpu_round.tgz "$OUT/"
echo "==== summary"; cat "$SUMMARY"
