#!/usr/bin/env bash
# Set up and run the test suite. GPU tests skip themselves without a CUDA device.
source "$(dirname "$0")/env.sh"
install_project test
cd "$ROOT"
# The venv's pytest (not `python -m pytest`) so the installed package, with its compiled
# library, is imported rather than the source folder.
say "running the test suite with $VENV/bin/pytest (several minutes on a CPU)"
set +e
"$VENV/bin/pytest" tests -q -ra "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
