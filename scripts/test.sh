#!/usr/bin/env bash
# Set up and run the test suite. GPU tests skip themselves without a CUDA device.
source "$(dirname "$0")/env.sh"
install_project test
cd "$ROOT"
# The venv's pytest (not `python -m pytest`) so the installed package, with its compiled
# library, is imported rather than the source folder.
# The tiers (README, "Testing"): by default everything but the `slow` tests (whole runs of the
# benchmarks, notebooks and the GPT example, the 8-device sharding checks), which
# JAX_EPILOG_TESTS=slow runs alone and JAX_EPILOG_TESTS=all with the rest; CI runs both tiers.
# The tests spread over the machine's cores (pytest-xdist); PYTEST_WORKERS=N picks N (0: one
# process).
case "${JAX_EPILOG_TESTS:-quick}" in
  quick) tier=(-m "not slow") ;;
  slow) tier=(-m slow) ;;
  all) tier=() ;;
  *) echo "JAX_EPILOG_TESTS: expected quick, slow or all, got ${JAX_EPILOG_TESTS}" >&2; exit 2 ;;
esac
# On a GPU machine each worker would take its own share of the GPU's memory: one process there.
default_workers=auto
[ -e /proc/driver/nvidia/version ] && default_workers=0
workers="${PYTEST_WORKERS:-$default_workers}"
parallel=(-n "$workers")
[ "$workers" = 0 ] && parallel=()
say "running the ${JAX_EPILOG_TESTS:-quick} tests with $VENV/bin/pytest ${parallel[*]}"
started=$SECONDS
set +e
"$VENV/bin/pytest" tests -q -ra "${parallel[@]}" "${tier[@]}" "$@"
status=$?
set -e
took=$((SECONDS - started))
say "the ${JAX_EPILOG_TESTS:-quick} tests took ${took} s"
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
# JAX_EPILOG_QUICK_BUDGET_S=N (CI sets it): the quick tier fails past N seconds, so that it
# cannot creep back; `scripts/tier_tests.py` on a timed run moves the slowest cases out.
budget="${JAX_EPILOG_QUICK_BUDGET_S:-}"
if [ "$status" -eq 0 ] && [ -n "$budget" ] && [ "${JAX_EPILOG_TESTS:-quick}" = quick ] \
    && [ "$took" -gt "$budget" ]; then
  echo "the quick tier took ${took} s, over its budget of ${budget} s: time it" \
       "(./scripts/test.sh --durations=0 > log) and run scripts/tier_tests.py log" >&2
  exit 1
fi
exit "$status"
