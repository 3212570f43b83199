#!/usr/bin/env bash
# The whole GPU round, on a machine with a CUDA GPU and no network (the project's H200):
# build the package without build isolation, run the GPU test suite, run the benchmarks.
# Usage: [DEADLINE=SECONDS] scripts/gpu_round.sh [STAGE...]
#   stages: build tests suite fuzz sanitize demo bench forward autotune overhead multigpu wheel export probe
#           tune fp8table never_slower soak fp8 fp8profile peer gpt llama gptprofile serving
#           generate decodelayout decodeab blockfp8 blockstep swiglu pallastune rowfp8
#           fewrows servingtune decodematrix fusedpasses
#   (default: build tests fuzz demo bench)
#   `tests` is the GPU suite (the gpu-marked tests: about 190 s with PYTEST_WORKERS=6 on one
#   H200); `suite` runs every test with the GPU as the default device (past 500 s, and the
#   CPU-exact tests fail there: 49 of them on 2026-12-04), not the GPU suite.
# Results go to $OUT (default benchmarks/results/gpu_round); a summary is printed last, and
# everything is also packed into $OUT/gpu_round.tgz (the device tool returns at most 8 files;
# PACK_ONLY=1 then leaves only the tarball and summary.txt in $OUT, so neither is left out).
# DEADLINE: stop every stage that would run past this many seconds from the start (20 s are
# kept to pack the results), so a command with a time limit still returns its tarball.
# Carry .whl (nvmath-python and its needs) so the nvmath comparisons run too.
# Carry .wheelhouse (scripts/build_gpu_wheel.sh's wheel) for the wheel stage.
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
# `gpt_compare NAME CAP ARGS...`: examples/gpt/compare.py ARGS within CAP seconds, into
# $OUT/NAME; its targets and, per variant, the GEMMs on FP8 operands (what decides whether its
# FP8 targets apply) beside its cuBLASLt custom calls, into the summary.
gpt_compare() {
  local name="$1" cap="$2"; shift 2
  (cd "$ROOT" && runs --cap "$cap" "$PY" examples/gpt/compare.py "$@" --out "$OUT/$name" 2>&1) \
    > "$OUT/$name.log"
  note "$name compare: rc=$? ($((SECONDS - start)) s)"
  grep -A12 "^## Targets" "$OUT/$name/gpt_compare.md" 2>/dev/null | tee -a "$SUMMARY"
  "$PY" -c "import json, sys
for c, x in json.load(open(sys.argv[1]))['results'].items():
    for n, v in x['variants'].items():
        print(c, n, 'fp8_gemms', v.get('fp8_gemms'), 'custom calls', v['gemm_custom_calls'],
              'time to first step s', v.get('time_to_first_step_s'))
" "$OUT/$name/gpt_compare.json" 2>&1 | tee -a "$SUMMARY"
}
# `test_path FILE`: tests/**/FILE (a test file named by its basename; "." is tests/ itself).
test_path() {
  if [ "$1" = . ]; then echo "$ROOT/tests"; return; fi
  find "$ROOT/tests" -name "$1" -print -quit | grep . || echo "$ROOT/tests/$1"
}
# `gpu_tests NAME CAP FILE...`: the gpu-marked tests of tests/**/FILE... (from /tmp, so the
# installed package is imported) within CAP seconds, into $OUT/NAME_tests.log; the count into
# the summary, the failures printed.
gpu_tests() {
  local name="$1" cap="$2"; shift 2
  (cd /tmp && runs --cap "$cap" "$PY" -m pytest $(for f in "$@"; do test_path "$f"; done) \
    -q -ra -m gpu -p no:cacheprovider 2>&1) > "$OUT/${name}_tests.log"
  note "$name gpu tests: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/${name}_tests.log")"
  grep -E "FAILED|Error|has no kernel" "$OUT/${name}_tests.log" | head -20
}
DEADLINE="${DEADLINE:-0}"
# Where `tune` writes the decision table (outside $OUT, which the device tool empties between
# calls, so a later call on the same machine can use it).
TABLE_DIR="${TABLE_DIR:-/tmp/jax_epilog_tables}"
TABLE_NAME="${TABLE_NAME:-nvidia-h200.json}"
# Run a command within what is left of DEADLINE (SIGINT first, so pytest and
# compute-sanitizer still print their summaries).
# `runs --cap N cmd...` also stops it after N seconds.
runs() {
  local cap=0
  if [ "$1" = "--cap" ]; then cap="$2"; shift 2; fi
  local left=$((DEADLINE > 0 ? DEADLINE - SECONDS - 20 : 86400))
  if [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ]; then left="$cap"; fi
  if [ "$left" -lt 10 ]; then echo "not run: DEADLINE reached"; return 124; fi
  timeout -s INT -k 15 "$left" "$@"
}

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
      # The handler is the point of this round: build it whatever `auto` would decide.
      JAX_EPILOG_BUILD_CUDA="${JAX_EPILOG_BUILD_CUDA:-1}" \
        "$PY" -m pip install -v --no-build-isolation --no-deps "$ROOT" > "$OUT/build.log" 2>&1
      rc=$?
      (cd /tmp && "$PY" -c "import jax, jax_epilog.runtime.library as c; \
print('jax', jax.__version__, 'devices', jax.devices()); \
print('library available:', c.available(), c.unavailable_reason(), 'cuBLASLt', c.cublaslt_version()); \
print('fused kernels built:', c.fused_kernels_built()); \
c.available() or print('THE CUDA HANDLER WAS NOT BUILT:', c.unavailable_reason())") \
        2>&1 | tee -a "$OUT/build.log"
      note "build: rc=$rc ($((SECONDS - start)) s); $(grep -h 'jax-epilog: ' "$OUT/build.log" | tail -n 1)"
      note "build: $(tail -n 1 "$OUT/build.log")" ;;
    tests)
      # From /tmp so the installed package (with its library) is imported, not the sources.
      # PYTEST_WORKERS=N: N pytest-xdist processes share the GPU(s), each with a slice of memory.
      # TEST_FILES="test_a.py test_b.py": only those files of tests/ (by basename) (default: all of them).
      # Each worker's memory fraction defaults to 0.75 / workers: four workers at 0.75 each
      # ran out of memory in 1224 of 1252 tests.
      workers=(); fraction=0.75
      if [ "${PYTEST_WORKERS:-0}" -gt 0 ]; then
        workers=(-n "$PYTEST_WORKERS"); fraction=$(python3 -c "print(round(0.75 / $PYTEST_WORKERS, 3))")
      fi
      (cd /tmp && XLA_PYTHON_CLIENT_MEM_FRACTION="${PYTEST_MEM_FRACTION:-$fraction}" \
        runs "$PY" -m pytest $(for f in ${TEST_FILES:-.}; do test_path "$f"; done) \
        -q -ra -m gpu -p no:cacheprovider "${workers[@]}" \
        --junitxml="$OUT/gpu_tests.xml" 2>&1) > "$OUT/gpu_tests.log"
      note "gpu tests: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/gpu_tests.log")"
      grep -E "has no kernel|FAILED|Error" "$OUT/gpu_tests.log" | head -40 ;;
    suite)
      # The whole suite with the GPU as default device: the CPU tests then run the kernel too.
      (cd /tmp && runs "$PY" -m pytest "$ROOT/tests" -q -ra -p no:cacheprovider 2>&1) > "$OUT/suite.log"
      note "whole suite on GPU: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/suite.log")"
      grep -E "FAILED" "$OUT/suite.log" | head -40 ;;
    fuzz)
      if [ -f "$ROOT/tests/support/gpu_fuzz.py" ]; then
        (cd /tmp && runs "$PY" "$ROOT/tests/support/gpu_fuzz.py" 2>&1) > "$OUT/gpu_fuzz.log"
        note "gpu fuzz: rc=$? ($((SECONDS - start)) s): $(tail -n 3 "$OUT/gpu_fuzz.log" | tr '\n' ' ')"
      fi ;;
    demo)
      (cd /tmp && runs "$PY" -m jax_epilog 2>&1) > "$OUT/demo.log"
      note "demo: rc=$? ($((SECONDS - start)) s)"
      tail -n 12 "$OUT/demo.log" ;;
    bench)
      (cd "$ROOT" && PYTHON="$PY" runs bash benchmarks/run_all.sh "$OUT/bench" 2>&1) > "$OUT/bench.log"
      note "benchmarks: rc=$? ($((SECONDS - start)) s)"
      tail -n 40 "$OUT/bench.log" ;;
    autotune)
      (cd "$ROOT" && runs "$PY" benchmarks/autotune_bench.py --out "$OUT/bench" 2>&1) > "$OUT/autotune.log"
      note "autotune benchmark: rc=$? ($((SECONDS - start)) s)"
      tail -n 20 "$OUT/autotune.log" ;;
    sanitize)
      # compute-sanitizer over the kernel-vs-model tests: every epilog, bf16, odd shapes,
      # transposes and batches. The platform allocator gives each buffer its own cudaMalloc,
      # so an access past a buffer is seen (inside XLA's pooled arena it would not be).
      for spec in "memcheck:bfloat16" "racecheck:bfloat16 and False-False and 127" \
                  "synccheck:bfloat16 and False-False and 127" "initcheck:bfloat16 and False-False and 127"; do
        tool="${spec%%:*}"; select="${spec#*:}"; start=$SECONDS
        (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
          XLA_FLAGS="--xla_gpu_autotune_level=0" runs --cap "${SANITIZE_CAP:-240}" compute-sanitizer --tool "$tool" \
          --print-limit 30 "$PY" -m pytest "$ROOT/tests/op/test_matmul_gpu.py" -q -p no:cacheprovider \
          -k "test_kernel_matches_float64_model and $select" 2>&1) > "$OUT/sanitize_$tool.log"
        note "compute-sanitizer $tool [$select]: rc=$? ($((SECONDS - start)) s): $(grep -E "passed|failed" "$OUT/sanitize_$tool.log" | tail -n 1); $(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize_$tool.log" | tail -n 1)"
      done ;;
    forward)
      # From benchmarks/ (not the root) so the installed package, with its library, is imported.
      # The forward grid (FORWARD_ARGS, e.g. "--rows G1,G2,G3 --dtypes fp16,fp32"; default all);
      # JAX_EPILOG_AUTOTUNE comes from the caller's environment.
      (cd "$ROOT/benchmarks" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 \
        runs "$PY" forward_bench.py --budget "${FORWARD_BUDGET:-300}" ${FORWARD_ARGS:-} \
        --out "$OUT/forward" 2>&1) > "$OUT/forward.log"
      note "forward benchmark: rc=$? ($((SECONDS - start)) s), autotune=${JAX_EPILOG_AUTOTUNE:-default}"
      grep -A40 "^| row" "$OUT/forward/forward.md" | head -60 ;;
    overhead)
      # G6/G7 per-layer cost with XLA's defaults (optimized HLO kept) and with command buffers
      # off, for every variant alike (what CUDA graphs do for each loop).
      (cd "$ROOT/benchmarks" && runs "$PY" overhead_bench.py \
        --out "$OUT/bench" --dump-hlo "$OUT/overhead_hlo" 2>&1) > "$OUT/overhead.log"
      note "overhead (defaults): rc=$? ($((SECONDS - start)) s)"
      (cd "$ROOT/benchmarks" && \
        XLA_FLAGS="--xla_gpu_enable_command_buffer=" runs "$PY" overhead_bench.py \
        --out "$OUT/overhead_no_command_buffers" 2>&1) >> "$OUT/overhead.log"
      note "overhead (command buffers off): rc=$? ($((SECONDS - start)) s)"
      cat "$OUT/bench/overhead.md" "$OUT/overhead_no_command_buffers/overhead.md" 2>/dev/null ;;
    multigpu)
      # MULTIGPU_ARGS, e.g. "--profile $OUT/profile" (traces and schedules of the M1 step).
      (cd "$ROOT/benchmarks" && runs "$PY" multi_gpu_bench.py ${MULTIGPU_ARGS:-} \
        --out "$OUT/bench" 2>&1) > "$OUT/multigpu.log"
      note "multi-GPU benchmark: rc=$? ($((SECONDS - start)) s)"
      tail -n 45 "$OUT/multigpu.log" ;;
    tune)
      # The per-GPU decision table: every distinct GEMM of the benchmark grid, cuBLASLt against
      # XLA (python -m jax_epilog.tune); written to $TABLE_DIR and used by never_slower.
      mkdir -p "$TABLE_DIR"
      (cd /tmp && runs "$PY" -m jax_epilog.tune \
        --grid --no-progress --output "$TABLE_DIR/$TABLE_NAME" ${TUNE_ARGS:-} 2>&1) > "$OUT/tune.log"
      cp "$TABLE_DIR/$TABLE_NAME" "$OUT/" 2>/dev/null
      note "tune: rc=$? ($((SECONDS - start)) s): $(tail -n 2 "$OUT/tune.log" | tr '\n' ' ')"
      tail -n 30 "$OUT/tune.log" ;;
    fp8table)
      # FP8 times in the shipped table's training-step entries (tune --fp8, docs/performance.md):
      # FP8TABLE_FULL rows (default the transformer MLPs T1,T2, which have no entries yet) in
      # full (GEMMs, bf16 stacks and FP8), then only the FP8 step of FP8TABLE_ROWS, whose bf16
      # entries are shipped. Each stack is written as it is timed; no new one is started after
      # FP8TABLE_FULL_S / FP8TABLE_ROWS_S seconds. The table comes back as $OUT/$TABLE_NAME:
      # copy it to jax_epilog/tables/ (and there before a second call that adds more rows).
      cp "$ROOT/jax_epilog/tables/$TABLE_NAME" "$OUT/$TABLE_NAME"
      fp8tune() {  # budget, then tune's arguments
        local budget="$1"; shift
        (cd /tmp && runs --cap $((budget + 60)) "$PY" -m jax_epilog.tune --grid --no-progress \
          --max-seconds "$budget" --output "$OUT/$TABLE_NAME" "$@" 2>&1) >> "$OUT/fp8table.log"
      }
      : > "$OUT/fp8table.log"
      [ -n "${FP8TABLE_FULL-T1,T2}" ] && fp8tune "${FP8TABLE_FULL_S:-60}" --rows "${FP8TABLE_FULL-T1,T2}" --fp8
      [ -n "${FP8TABLE_ROWS-M1,G1,G4,G5,G2,M2,G3}" ] && fp8tune "${FP8TABLE_ROWS_S:-60}" \
        --rows "${FP8TABLE_ROWS-M1,G1,G4,G5,G2,M2,G3}" --fp8-only
      note "fp8table: ($((SECONDS - start)) s): $(grep -c '^\[.*stack step.*fp8 ' "$OUT/fp8table.log") FP8 steps timed"
      grep -E "fp8|tuned|stopped|failed" "$OUT/fp8table.log" | tail -n 30 ;;
    never_slower)
      # Every grid row and network against XLA, both harnesses, with the table just measured.
      (cd "$ROOT/benchmarks" && JAX_EPILOG_DECISIONS="$TABLE_DIR/$TABLE_NAME" \
        runs "$PY" never_slower.py --out "$OUT/never_slower" --budget-s "${NEVER_SLOWER_BUDGET:-400}" \
        ${NEVER_SLOWER_ARGS:-} 2>&1) > "$OUT/never_slower.log"
      note "never_slower: rc=$? ($((SECONDS - start)) s)"
      cat "$OUT/never_slower/never_slower.md" 2>/dev/null | head -60 ;;
    soak)
      # 20,000 distinct shapes through the plan cache in one process (issue 15 part 3): host
      # and device memory after warm-up, the cache at its capacity; then its GPU tests.
      (cd "$ROOT/benchmarks" && runs --cap "${SOAK_CAP:-110}" "$PY" soak.py --out "$OUT/soak" 2>&1) > "$OUT/soak.log"
      note "soak: rc=$? ($((SECONDS - start)) s): $(grep -i verdict "$OUT/soak.log" | tail -n 1)"
      (cd /tmp && runs --cap 60 "$PY" -m pytest "$ROOT/tests/tools/test_soak.py" -q -p no:cacheprovider -m gpu 2>&1) >> "$OUT/soak.log"
      note "soak GPU tests: $(tail -n 1 "$OUT/soak.log")"
      tail -n 50 "$OUT/soak.log" ;;
    fp8)
      # FP8 training steps (M1, G1, M2) against XLA bf16 and a user-written XLA FP8 step, and the
      # FP8 crossover sweep; results rewritten after every row, so a cut run keeps what it has.
      (cd "$ROOT/benchmarks" && runs --cap "${FP8_CAP:-300}" "$PY" fp8_bench.py ${FP8_ARGS:---sweep} \
        --out "$OUT/fp8" 2>&1) > "$OUT/fp8.log"
      note "fp8 benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -iE "met|missed|crossover" "$OUT/fp8.log" | tail -n 12 | tee -a "$SUMMARY"
      cat "$OUT/fp8/fp8.md" 2>/dev/null | head -50 ;;
    blockfp8)
      # Block-scaled FP8 (issue 39): its GPU tests (the cuBLASLt kernel against the float64
      # model), then the GEMM benchmark (block vs per-tensor FP8 vs bf16) and the outlier errors.
      gpu_tests blockfp8 "${BLOCKFP8_TEST_CAP:-300}" test_block_fp8.py
      (cd "$ROOT/benchmarks" && runs --cap "${BLOCKFP8_CAP:-300}" "$PY" block_fp8_bench.py \
        ${BLOCKFP8_ARGS:-} --out "$OUT/block_fp8" 2>&1) > "$OUT/block_fp8.log"
      note "blockfp8 benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -E "^target|FALLBACK" "$OUT/block_fp8.log" | tee -a "$SUMMARY"
      cat "$OUT/block_fp8/block_fp8.md" 2>/dev/null | head -40 ;;
    rowfp8)
      # Row scales (cuBLASLt's outer vector scaling) and the per-channel stored weights that
      # run them: their GPU tests (the kernel against the float64 model, no fallback to the
      # reference), then the serving benchmark, whose ours_fp8_channel* variants they are.
      gpu_tests rowfp8 "${ROWFP8_TEST_CAP:-300}" test_row_fp8.py test_serving.py \
        test_swiglu_serving.py
      (cd "$ROOT/benchmarks" && runs --cap "${SERVING_CAP:-400}" "$PY" serving_bench.py \
        ${SERVING_ARGS:-} --out "$OUT/serving" 2>&1) > "$OUT/serving.log"
      note "serving benchmark (per-channel variants): rc=$? ($((SECONDS - start)) s)"
      grep -E "^\| (K|D)" "$OUT/serving/serving.md" 2>/dev/null | tee -a "$SUMMARY" ;;
    blockstep)
      # The block-scaled FP8 recipe (issue 39, Fp8(scaling="block")): its GPU tests (every GEMM
      # of a layer's step on the block-scaled kernel, against the CPU), then M1's training step
      # (block vs per-tensor fp8=True vs XLA bf16, both harnesses, temporaries) and the
      # outlier errors with their factor swept (BLOCKSTEP_ARGS, e.g. "--parts step"; "--parts
      # quantize,step --step-variants xla_bf16,ours_fp8,ours_fp8_block,ours_fp8_block_separate,
      # ours_fp8_block_xla" times x's quantization into both copies per kernel of
      # blocks.BOTH_COPIES_CHOICES, then the step with each). BLOCKSTEP_TESTS=0 skips the tests,
      # which include the Pallas quantization kernel's bytes against XLA's (with and without an
      # activation or gelu' applied in it).
      [ "${BLOCKSTEP_TESTS:-1}" = 1 ] && gpu_tests blockstep "${BLOCKSTEP_TEST_CAP:-200}" \
        test_block_recipe.py test_block_fp8.py::test_gpu_pallas_both_copies_match_xla_bytes \
        test_block_fp8.py::test_gpu_pallas_prologue_matches_the_separate_passes
      (cd "$ROOT/benchmarks" && runs --cap "${BLOCKSTEP_CAP:-360}" "$PY" block_fp8_bench.py \
        --parts "step,errors" ${BLOCKSTEP_ARGS:-} --out "$OUT/block_step" 2>&1) \
        > "$OUT/block_step.log"
      note "blockstep benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -E "^target|FALLBACK" "$OUT/block_step.log" | tee -a "$SUMMARY"
      grep -E "^\| (xla_separate|xla|pallas|ours_fp8_block[a-z_]*) \|" \
        "$OUT/block_step/block_fp8.md" 2>/dev/null | tee -a "$SUMMARY"
      cat "$OUT/block_step/block_fp8.md" 2>/dev/null | head -60 ;;
    fewrows)
      # The served FP8 GEMM of few rows' Pallas kernel (issue 37's decode sizes): its GPU tests
      # and the served layers' (which run it up to 64 rows), then its tilings against XLA
      # (benchmarks/few_rows_tuning.py; FEW_ROWS_ARGS, e.g. "--shapes K4096xN14336").
      gpu_tests fewrows "${FEW_ROWS_TEST_CAP:-200}" test_few_rows_fp8_kernel.py \
        test_serving.py test_swiglu_serving.py
      (cd "$ROOT/benchmarks" && runs --cap "${FEW_ROWS_CAP:-300}" "$PY" \
        few_rows_tuning.py ${FEW_ROWS_ARGS:-} --out "$OUT/few_rows" 2>&1) \
        > "$OUT/few_rows.log"
      note "few-rows tuning: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(## |\| )" "$OUT/few_rows/few_rows_tuning.md" 2>/dev/null | \
        grep -v "^| variant\|^|---" | tee -a "$SUMMARY"
      grep -E "Error|error:" "$OUT/few_rows.log" | tail -5 ;;
    pallastune)
      # The Pallas quantization kernels (block recipe's both-copies pass, SwiGLU's gradient)
      # at each warp count and tile, against XLA (benchmarks/pallas_tuning.py).
      (cd "$ROOT/benchmarks" && runs --cap "${PALLAS_TUNE_CAP:-200}" "$PY" pallas_tuning.py \
        --max-s $(( ${PALLAS_TUNE_CAP:-200} - 40 )) --out "$OUT/pallas_tuning" 2>&1) \
        > "$OUT/pallas_tuning.log"
      note "pallas tuning: rc=$? ($((SECONDS - start)) s)"
      grep -E "^\| " "$OUT/pallas_tuning/pallas_tuning.md" 2>/dev/null | tee -a "$SUMMARY"
      grep -E "Error|error" "$OUT/pallas_tuning.log" | tail -5 ;;
    fp8profile)
      # Where the FP8 step's time goes: GPU kernels of traced M1 steps per variant
      # (FP8_PROFILE_ARGS, e.g. "--variants ours_fp8,xla_fp8", or "--peer --row W2,TMLP":
      # Flax's FP8 beside ours, each row in its own folder).
      (cd "$ROOT/benchmarks" && runs --cap "${FP8_PROFILE_CAP:-240}" "$PY" fp8_profile.py \
        ${FP8_PROFILE_ARGS:-} --out "$OUT/fp8_profile" 2>&1) > "$OUT/fp8_profile.log"
      note "fp8 profile: rc=$? ($((SECONDS - start)) s)"
      grep -E "^([A-Z0-9]+ )?[a-z0-9_]+: step" "$OUT/fp8_profile.log" | tee -a "$SUMMARY"
      find "$OUT/fp8_profile" -name traces -type d -prune -exec rm -rf {} +  # large; the summary has what they say
      find "$OUT/fp8_profile" -name fp8_profile.md -exec head -n 80 {} + 2>/dev/null ;;
    peer)
      # Flax's own FP8 ops beside our fp8= recipes from the same weights (issue 24 part 6);
      # results rewritten after every row, so a cut run keeps what it has.
      # --max-s leaves 30 s of PEER_CAP to write the report (PEER_ARGS may set its own).
      (cd "$ROOT/benchmarks" && runs --cap "${PEER_CAP:-300}" "$PY" fp8_peer.py \
        --max-s $(( ${PEER_CAP:-300} - 30 )) ${PEER_ARGS:---rows W2,TMLP,N8K,M1} \
        --out "$OUT/fp8_peer" 2>&1) > "$OUT/fp8_peer.log"
      note "fp8 peer benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(\||## |- )" "$OUT/fp8_peer/fp8_peer.md" 2>/dev/null | tee -a "$SUMMARY"
      grep -E "^skipped|^wrote .*errors\)$" "$OUT/fp8_peer.log" | tee -a "$SUMMARY" ;;
    gpt)
      # The GPT example's four variants side by side (GPT_ARGS, default both configs; `large`
      # alone needs most of a call: its FP8 step compiled in 132 s on the H200).
      gpt_compare gpt "${GPT_CAP:-480}" ${GPT_ARGS:---config small large --budget-s 400} ;;
    llama)
      # The same on the Llama arch (LLAMA_ARGS, default `llama_large`, 300 steps): the step
      # count shrinks, the same for every variant, where compiling leaves too little of the
      # budget (the issue measured Flax FP8's first step of one SwiGLU block at 200 s);
      # LLAMA_ARGS="... --layers 2" compiles a smaller step.
      gpt_compare llama "${LLAMA_CAP:-580}" \
        ${LLAMA_ARGS:---config llama_large --steps 300 --budget-s 540}
      # tokens/s, step ms, temporaries, compile and first-step seconds, validation loss
      grep -E "^(## llama|\| (stock|flax_fp8|epilog|epilog_fp8) \|)" \
        "$OUT/llama/gpt_compare.md" 2>/dev/null | tee -a "$SUMMARY" ;;
    swiglu)
      # The SwiGLU block (issue 38): its GPU tests, training and served from FP8 weights
      # (SWIGLU_TESTS=0 skips them), then
      # benchmarks/swiglu_bench.py (RMSNorm + SwiGLU + residual step against stock bf16, Flax's
      # FP8 and three FP8 Dense; SWIGLU_ARGS, e.g. "--rows S2": Flax's FP8 step alone took
      # 200 s to compile and tune there, so give S2 a call of its own). Results rewritten after
      # every row, so a cut run keeps what it has.
      [ "${SWIGLU_TESTS:-1}" = 1 ] && gpu_tests swiglu 240 test_swiglu_gpu.py test_swiglu_serving.py
      (cd "$ROOT/benchmarks" && runs --cap "${SWIGLU_CAP:-420}" "$PY" swiglu_bench.py \
        --max-s $(( ${SWIGLU_CAP:-420} - 30 )) ${SWIGLU_ARGS:-} --out "$OUT/swiglu" 2>&1) \
        > "$OUT/swiglu.log"
      note "swiglu benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(\||## |- )" "$OUT/swiglu/swiglu.md" 2>/dev/null | tee -a "$SUMMARY"
      grep -E "^skipped|^FALLBACK|failed" "$OUT/swiglu.log" | tee -a "$SUMMARY" ;;
    fusedpasses)
      # The fused FP8 passes (issue 63; docs/fp8.md, "Fused passes"): the library's CUDA
      # kernels against XLA's references (tests/float8/test_fused_passes_gpu.py), the SwiGLU
      # block's GPU tests with them (test_swiglu_gpu.py; FUSED_PASSES_TESTS=0 skips the
      # tests), then benchmarks/fused_passes.py (FUSED_PASSES_ARGS, e.g. "--rows S1").
      if [ "${FUSED_PASSES_TESTS:-1}" = 1 ]; then
        gpu_tests fused_passes 150 test_fused_passes_gpu.py
        JAX_EPILOG_FUSED_PASSES=cuda gpu_tests fused_swiglu 120 test_swiglu_gpu.py
      fi
      (cd "$ROOT/benchmarks" && runs --cap "${FUSED_PASSES_CAP:-150}" "$PY" fused_passes.py \
        ${FUSED_PASSES_ARGS:-} --out "$OUT/fused_passes" 2>&1) > "$OUT/fused_passes.log"
      note "fused passes benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(copy|quantize_transpose|swiglu_|ERROR)" "$OUT/fused_passes.log" | tee -a "$SUMMARY" ;;
    serving)
      # Stored FP8 weights against XLA's bf16 and Qwix's PTQ (benchmarks/serving_bench.py;
      # SERVING_ARGS, e.g. "--parts block", or "--parts swiglu" for the served SwiGLU block).
      # Qwix comes from the carried .whl.
      (cd "$ROOT/benchmarks" && runs --cap "${SERVING_CAP:-400}" "$PY" serving_bench.py \
        ${SERVING_ARGS:-} --out "$OUT/serving" 2>&1) > "$OUT/serving.log"
      note "serving benchmark: rc=$? ($((SECONDS - start)) s)"
      grep -A12 "^## Targets" "$OUT/serving/serving.md" 2>/dev/null | tee -a "$SUMMARY"
      tail -n 20 "$OUT/serving.log" ;;
    generate)
      # Serving the GPT (examples/gpt/generate.py): train GENERATE_CONFIG (`large`, or e.g.
      # `llama_large`) with GENERATE_TRAIN_ARGS (`--impl stock`; `--impl epilog --fp8` trains
      # jax-epilog's FP8 layers, the fused SwiGLU block on a Llama config) for
      # GENERATE_TRAIN_STEPS into a checkpoint (a temporary folder, or GENERATE_CHECKPOINT_DIR
      # to keep it for a later call: train.py then resumes there and trains no more), then
      # stock, epilog_fp8 and qwix_fp8 from its weights side by side (by generate_bench.py,
      # which takes generate.py's options and its experiment switches: GENERATE_ARGS, e.g.
      # "--kv-cache bf16" to give epilog_fp8 the 16-bit cache too). GENERATE_PROFILE=1 traces
      # a few decode steps of each (into /tmp/generate_profile) and adds where a step's GPU time
      # goes to the report. Qwix comes from the carried .whl/. First the decode step's GPU
      # test (the FP8 cache read as it is).
      gpu_tests generate "${GENERATE_TEST_CAP:-120}" test_gpt_generate.py
      profile_args=""
      # (the traces stay on the machine: the report has what they say)
      [ -n "${GENERATE_PROFILE:-}" ] && profile_args="--profile /tmp/generate_profile"
      ckpt="${GENERATE_CHECKPOINT_DIR:-$(mktemp -d)}"
      (cd "$ROOT" && runs --cap "${GENERATE_TRAIN_CAP:-240}" "$PY" examples/gpt/train.py \
        --config "${GENERATE_CONFIG:-large}" ${GENERATE_TRAIN_ARGS:---impl stock} \
        --steps "${GENERATE_TRAIN_STEPS:-300}" --no-progress \
        --checkpoint-dir "$ckpt" 2>&1) > "$OUT/generate_train.log"
      note "generate: trained ${GENERATE_CONFIG:-large} for ${GENERATE_TRAIN_STEPS:-300} steps: rc=$? ($((SECONDS - start)) s): $(tail -n 1 "$OUT/generate_train.log")"
      (cd "$ROOT" && runs --cap "${GENERATE_CAP:-420}" "$PY" examples/gpt/generate_bench.py \
        --checkpoint-dir "$ckpt" --compare \
        ${GENERATE_ARGS:---batch 1 16 64 --prompt-len 128 --new-tokens 256} $profile_args \
        --no-progress --out "$OUT/generate" 2>&1) > "$OUT/generate.log"
      note "generate: rc=$? ($((SECONDS - start)) s)"
      # The speed (with each KV cache), quality and profile tables' rows, then each variant's
      # sample text.
      grep -E "^(\| |- )(stock|epilog_fp8|qwix_fp8)( \||: )" "$OUT/generate/gpt_generate.md" 2>/dev/null | tee -a "$SUMMARY"
      grep -E "FAILED|Error" "$OUT/generate.log" | head -20 | tee -a "$SUMMARY"
      [ -z "${GENERATE_CHECKPOINT_DIR:-}" ] && rm -rf "$ckpt" ;;
    decodelayout)
      # The FP8 KV cache's layouts (jax_epilog.init_kv_cache's layout=, generate_bench.py
      # --fp8-cache-layout) on DECODE_LAYOUT_CONFIG (`large`), random weights, stock and
      # epilog_fp8 at batch 1 and 64, each decode call also traced (compiled without command
      # buffers): heads_major (the default) then heads_major_rows (its values a row a
      # position), into $OUT/decode_<layout>. First the GPU tests of the cache's layouts.
      # Compare the decode tokens/s of epilog_fp8 against stock between the reports, and their
      # traces' cache writes and attention.
      gpu_tests decodelayout "${DECODE_LAYOUT_TEST_CAP:-120}" test_gpt_generate.py
      # DECODE_LAYOUTS: the layouts to run (positions_major too, measured slower on
      # 2026-12-04); DECODE_LAYOUT_PROFILE=0: no traces; DECODE_LAYOUT_SERVING: the runs'
      # JAX_EPILOG_SERVING ways, one run each (e.g. "auto fp8_pallas": fp8_pallas decodes by
      # the few-row kernel, and prefills, past its 64 rows, by XLA's FP8 dot), a way's
      # report in $OUT/decode_<layout>_<way> (auto's in $OUT/decode_<layout>).
      for layout in ${DECODE_LAYOUTS:-heads_major heads_major_rows}; do
      for way in ${DECODE_LAYOUT_SERVING:-auto}; do
        profile_args=""
        [ "${DECODE_LAYOUT_PROFILE:-1}" = 1 ] && profile_args="--profile /tmp/decode_$layout"
        run="decode_$layout"
        [ "$way" = auto ] || run="${run}_$way"
        (cd "$ROOT" && JAX_EPILOG_SERVING="$way" \
          runs --cap "${DECODE_LAYOUT_CAP:-300}" "$PY" examples/gpt/generate_bench.py \
          --random-init --config "${DECODE_LAYOUT_CONFIG:-large}" --compare \
          --variants stock,epilog_fp8 --batch ${DECODE_LAYOUT_BATCHES:-1 64} --repeats 2 --eval-batches 1 \
          --fp8-cache-layout "$layout" ${DECODE_LAYOUT_ARGS:-} $profile_args \
          --no-progress --out "$OUT/$run" 2>&1) > "$OUT/$run.log"
        note "decodelayout $run: rc=$? ($((SECONDS - start)) s)"
        grep -E "^(\| |- )(stock|epilog_fp8)( \||: )" "$OUT/$run/gpt_generate.md" \
          2>/dev/null | tee -a "$SUMMARY"
        note "decodelayout $run: report lines naming a transpose: $(grep -ci transpose \
          "$OUT/$run/gpt_generate.md" 2>/dev/null)"
        grep -E "FAILED|Error" "$OUT/$run.log" | head -20 | tee -a "$SUMMARY"
      done
      done ;;
    decodematrix)
      # One layer's decode attention over the KV cache: MHA/GQA/MQA x batch x context, stock
      # bf16 against the library's bf16 and FP8 reads (benchmarks/decode_matrix.py;
      # DECODE_MATRIX_ARGS, e.g. "--contexts 8192"), then the rule's table written from it
      # into $OUT/decode_attention.json (copy it over jax_epilog/planning/tables/attention/
      # decode.json to ship it).
      (cd "$ROOT/benchmarks" && runs --cap "${DECODE_MATRIX_CAP:-420}" "$PY" decode_matrix.py \
        ${DECODE_MATRIX_ARGS:-} --out "$OUT/decode_matrix" 2>&1) > "$OUT/decode_matrix.log"
      note "decode matrix: rc=$? ($((SECONDS - start)) s)"
      cp "$ROOT/jax_epilog/planning/tables/attention/decode.json" "$OUT/decode_attention.json"
      (cd "$ROOT/benchmarks" && "$PY" decode_matrix.py --table-from \
        "$OUT/decode_matrix/decode_matrix.json" --table "$OUT/decode_attention.json" 2>&1) \
        | tee -a "$SUMMARY"
      grep -A2 "^Cells where" "$OUT/decode_matrix/decode_matrix.md" 2>/dev/null | tee -a "$SUMMARY"
      tail -n 5 "$OUT/decode_matrix.log" ;;
    servingtune)
      # `python -m jax_epilog.tune --serving` (SERVING_TUNE_ARGS, e.g. "--serving-rows 16,64"):
      # the served ways timed per row count on this GPU, into $OUT/serving_decisions.json.
      (cd /tmp && JAX_EPILOG_DECISIONS="$OUT/serving_decisions.json" \
        runs --cap "${SERVING_TUNE_CAP:-300}" "$PY" -m jax_epilog.tune --serving --no-progress \
        ${SERVING_TUNE_ARGS:-} 2>&1) > "$OUT/serving_tune.log"
      note "serving tune: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(serving|tuned|failed)" "$OUT/serving_tune.log" | tee -a "$SUMMARY" ;;
    decodeab)
      # Served ways compared in ONE process (generate.py's `epilog_fp8@WAY` variants), so the
      # ratios share stock's run: DECODE_AB_VARIANTS (default stock, the default ways, XLA's
      # FP8 dot forced), DECODE_AB_BATCHES (1 16 64), DECODE_AB_CONFIG (`large`), random
      # weights, into $OUT/decode_ab. A forced way runs the prefill that way too.
      (cd "$ROOT" && runs --cap "${DECODE_AB_CAP:-400}" "$PY" examples/gpt/generate_bench.py \
        --random-init --config "${DECODE_AB_CONFIG:-large}" --compare \
        --variants "${DECODE_AB_VARIANTS:-stock,epilog_fp8,epilog_fp8@xla_fp8}" \
        --batch ${DECODE_AB_BATCHES:-1 16 64} --repeats 2 --eval-batches 1 ${DECODE_AB_ARGS:-} \
        --no-progress --out "$OUT/decode_ab" 2>&1) > "$OUT/decode_ab.log"
      note "decodeab: rc=$? ($((SECONDS - start)) s)"
      grep -E "^(stock|epilog_fp8)[^ ]* batch" "$OUT/decode_ab.log" | tee -a "$SUMMARY"
      grep -E "^\| (stock|epilog_fp8)" "$OUT/decode_ab/gpt_generate.md" 2>/dev/null \
        | tee -a "$SUMMARY"
      grep -E "FAILED|Error" "$OUT/decode_ab.log" | head -20 | tee -a "$SUMMARY" ;;
    gptprofile)
      # Where the GPT step's time goes, per variant (GPT_PROFILE_ARGS, default large, Flax's
      # FP8 against ours): the kernels of a few traced steps, by kind and the longest ones.
      (cd "$ROOT" && runs --cap "${GPT_PROFILE_CAP:-240}" "$PY" examples/gpt/profile.py \
        ${GPT_PROFILE_ARGS:---config large --variants flax_fp8,epilog_fp8} \
        --out "$OUT/gpt_profile" 2>&1) > "$OUT/gpt_profile.log"
      note "gpt profile: rc=$? ($((SECONDS - start)) s)"
      head -n 12 "$OUT/gpt_profile/gpt_profile.md" 2>/dev/null | tee -a "$SUMMARY" ;;
    wheel)
      # The GPU wheel (scripts/build_gpu_wheel.sh), carried in .wheelhouse/ (the newest there),
      # installed as a GPU user without a compiler does: no index, no dependencies (JAX's CUDA
      # plugin and NVIDIA's cu13 wheels are already here), pip run by the interpreter's full
      # path with PATH an empty folder and CC/CXX pointing nowhere, so no compiler can be
      # reached (checked). The tests stage then runs against it (`build` would reinstall).
      whl=$(ls -t "$ROOT"/.wheelhouse/jax_epilog-*manylinux*.whl 2>/dev/null | head -n 1)
      py="$(command -v "$PY")"
      nocc="$(mktemp -d)"
      reachable=$(for cc in c++ g++ gcc cc clang clang++; do PATH="$nocc" command -v "$cc"; done)
      if [ -z "$whl" ]; then
        note "wheel: no .wheelhouse/jax_epilog-*manylinux*.whl (carry .wheelhouse)"; continue
      elif [ -n "$reachable" ]; then
        note "wheel: not run, a compiler is reachable: $reachable"; continue
      fi
      note "wheel: installing $(basename "$whl") (sha256 $(sha256sum "$whl" | cut -c1-16)) with PATH=$nocc: none of c++ g++ gcc cc clang clang++ found"
      (cd /tmp && PATH="$nocc" CC=/nonexistent CXX=/nonexistent "$py" -m pip install -v \
        --no-index --no-deps --force-reinstall --no-cache-dir "$whl") > "$OUT/wheel.log" 2>&1
      rc=$?
      note "wheel: pip rc=$rc: $(grep -m1 '^Successfully installed' "$OUT/wheel.log"); lines of the log naming a build or compiler: $(grep -ciE 'building wheel|setup\.py|cmake|c\+\+|g\+\+|gcc|compil' "$OUT/wheel.log")"
      # What was installed, whether it is this tree's Python (the tests stage tests this tree's
      # tests against it), the handler's state as the build stage prints it, and one call
      # that must run the custom call.
      (cd /tmp && "$py" - "$ROOT" <<'PYEOF' 2>&1 | tee -a "$OUT/wheel.log"
import filecmp, pathlib, sys
import jax, jax.numpy as jnp
import jax_epilog, jax_epilog.runtime.library as c
installed = pathlib.Path(jax_epilog.__file__).parent
source = pathlib.Path(sys.argv[1]) / "jax_epilog"
print("installed:", installed, "jax", jax.__version__, "devices", jax.devices())
files = sorted(str(p.relative_to(source)) for p in source.rglob("*")
               if p.suffix in (".py", ".json") and "__pycache__" not in p.parts)
_, differ, missing = filecmp.cmpfiles(source, installed, files, shallow=False)
print("sources:", "the same as this tree's" if not differ + missing else
      f"THE WHEEL IS NOT THIS TREE'S: differ {differ}, missing {missing}")
print("library available:", c.available(), c.unavailable_reason(), "cuBLASLt", c.cublaslt_version())
if c.available() and jax.default_backend() == "gpu":
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (256, 512), jnp.bfloat16)
    w = jax.random.normal(k[1], (512, 384), jnp.bfloat16) * 0.05
    b = jax.random.normal(k[2], (384,), jnp.bfloat16)
    f = jax.jit(lambda x, w, b: jax_epilog.matmul(
        x, w, epilog="relu_bias", epilog_inputs={"bias": b}, backend="cublaslt"))
    calls = f.lower(x, w, b).compile().as_text().count('custom_call_target="jax_epilog_matmul')
    out = f(x, w, b)
    out = out[0] if isinstance(out, tuple) else out
    want = jax.nn.relu(x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32))
    print("relu_bias with backend=cublaslt:", calls, "custom call(s), largest error",
          float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))), "of", float(jnp.max(want)))
PYEOF
      )
      note "wheel: $(grep -E '^(sources|library available|relu_bias)' "$OUT/wheel.log" | tr '\n' ' ')"
      rm -rf "$nocc" ;;
    export)
      # Exported modules in fresh processes (tests/op/test_exported.py): export the CUDA modules
      # of this tree (EXPORT_COMMIT names it) and of the 97e9b38 tree carried at .old/97e9b38
      # (its Python with this build's library: the C++ is the same), then run every module in a
      # process that only imports jax and jax_epilog. The modules come back in exported.tgz.
      # Then the import's cost: `import jax_epilog` of the installed package (which loads the
      # library here) against the e5238ee tree at .old/e5238ee (before the import loaded it),
      # each with this build's library, medians of fresh processes (scripts/import_time.py).
      site=$(cd /tmp && "$PY" -c "import jax_epilog, os; print(os.path.dirname(jax_epilog.__file__))")
      made="$OUT/exported"; : > "$OUT/export.log"
      (cd /tmp && runs "$PY" "$ROOT/tests/exported/make_modules.py" --platform cuda \
        --commit "${EXPORT_COMMIT:-current}" --out "$made/${EXPORT_COMMIT:-current}/cuda") >> "$OUT/export.log" 2>&1
      if [ -d "$ROOT/.old/97e9b38/jax_epilog" ]; then
        cp "$site/libjax_epilog_ffi.so" "$ROOT/.old/97e9b38/jax_epilog/"
        (cd /tmp && PYTHONPATH="$ROOT/.old/97e9b38" runs "$PY" "$ROOT/tests/exported/make_modules.py" \
          --platform cuda --commit 97e9b38 --out "$made/97e9b38/cuda") >> "$OUT/export.log" 2>&1
      fi
      for folder in "$made"/*/cuda "$ROOT"/tests/exported/*/cuda; do
        [ -f "$folder/manifest.json" ] || continue
        echo "== $folder" >> "$OUT/export.log"
        (cd / && runs "$PY" "$ROOT/tests/exported/run_modules.py" "$folder") >> "$OUT/export.log" 2>&1
      done
      note "export: $(grep -c '"errors"' "$OUT/export.log") module runs, $(grep -c '"exception"' "$OUT/export.log") raised"
      # The verdict: tests/op/test_exported.py on the committed folders and the ones just made
      # (attributes against this version's targets; each CUDA folder in a fresh process).
      (cd /tmp && JAX_EPILOG_EXPORTED="$made" runs "$PY" -m pytest "$ROOT/tests/op/test_exported.py" \
        -q -ra -p no:cacheprovider 2>&1) > "$OUT/export_test.log"
      note "export: test_exported.py: $(tail -n 1 "$OUT/export_test.log")"
      : > "$OUT/import_time.log"
      trees=()
      if [ -d "$ROOT/.old/e5238ee/jax_epilog" ]; then
        cp "$site/libjax_epilog_ffi.so" "$ROOT/.old/e5238ee/jax_epilog/"
        trees=(--tree "$ROOT/.old/e5238ee")
      fi
      "$PY" "$ROOT/scripts/import_time.py" --runs "${IMPORT_RUNS:-7}" >> "$OUT/import_time.log" 2>&1
      [ ${#trees[@]} -gt 0 ] && "$PY" "$ROOT/scripts/import_time.py" --runs "${IMPORT_RUNS:-7}" \
        "${trees[@]}" >> "$OUT/import_time.log" 2>&1
      while read -r line; do note "export: $line"; done < "$OUT/import_time.log"
      grep -E '^== |"exception"|Error' "$OUT/export.log" | head -30
      tar -C "$OUT" -czf "$OUT/exported.tgz" exported && rm -rf "$made" ;;
    probe)
      (cd /tmp && runs "$PY" "$ROOT/scripts/probe_special_values.py" 2>&1) | tee "$OUT/probe.log"
      note "special-value probe: see probe.log" ;;
    *) note "unknown stage $stage" ;;
  esac
done
if tar -C "$(dirname "$OUT")" -czf "/tmp/gpu_round.tgz" "$(basename "$OUT")"; then
  if [ "${PACK_ONLY:-0}" = 1 ]; then
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} +
  fi
  mv /tmp/gpu_round.tgz "$OUT/"
fi
echo "==== summary"; cat "$SUMMARY"
