# Sourced by the other scripts: make (once) and activate the project's virtual environment.
# Python 3.12 is preferred (jax 0.11+); 3.11 works with jax 0.10.2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAX_EPILOG_VENV:-$ROOT/.venv}"
say() { echo "jax-epilog: $*" >&2; }
# The venv's interpreter, as an absolute path: $PYTHON if set, else python3.12 (through pyenv's
# newest 3.12 where pyenv's shim has none chosen), else python3; at least 3.11.
python_path() {
  "$@" -c 'import sys; assert sys.version_info >= (3, 11); print(sys.executable)' 2>/dev/null
}
pick_python() {
  if [ -n "${PYTHON:-}" ]; then
    python_path "$PYTHON" || { echo "PYTHON=$PYTHON is not a Python >= 3.11" >&2; return 1; }
    return
  fi
  python_path python3.12 && return
  local version
  version="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1)"
  [ -n "$version" ] && PYENV_VERSION="$version" python_path python3.12 && return
  python_path python3 && return
  echo "no Python >= 3.11 found: set PYTHON=/path/to/python3.12" >&2
  return 1
}
if [ ! -x "$VENV/bin/python" ]; then
  python="$(pick_python)"
  say "creating the virtual environment $VENV ($("$python" --version))"
  "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# The stamp of an install: a hash of everything the build reads (the package, the C++ handler,
# pyproject.toml with its dependencies, the README that becomes the package's description,
# the compiler's version and the build settings in the environment) and of the venv's Python.
# Beside it the extras installed from that state and `pip freeze` of the venv after the
# install, so a changed or removed dependency also means a reinstall.
STAMP="$VENV/.jax-epilog-install"
source_hash() {
  (cd "$ROOT" && find pyproject.toml README.md ffi jax_epilog -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum
   env | grep -E '^(CC|CXX|CFLAGS|CXXFLAGS|LDFLAGS|CMAKE_[A-Z_]*|SKBUILD_[A-Z_]*|PIP_[A-Z_]*|JAX_EPILOG_BUILD_CUDA)=' \
     | LC_ALL=C sort || true
   "${CXX:-c++}" --version 2>/dev/null | head -n 1 || true
   "$VENV/bin/python" -c 'import sys; print(sys.version)') | sha256sum | cut -d' ' -f1
}
installed_freeze() { "$VENV/bin/python" -m pip freeze --all 2>/dev/null; }

# $1: the extra to install, e.g. "demo" or "test". A normal (not editable) install builds
# the C++ handler exactly as a user's install does; it is skipped when the stamp says this
# extra is installed from the current sources into an unchanged venv.
# JAX_EPILOG_REINSTALL=1 forces it.
install_project() {
  local hash extras=""
  hash="$(source_hash)"
  if [ -f "$STAMP.hash" ] && [ "$(cat "$STAMP.hash")" = "$hash" ]; then
    extras="$(cat "$STAMP.extras" 2>/dev/null || true)"
  fi
  if [ "${JAX_EPILOG_REINSTALL:-0}" != 1 ] && [ -n "$extras" ] \
      && [ "$(installed_freeze)" = "$(cat "$STAMP.freeze" 2>/dev/null)" ]; then
    if grep -qx "$1" <<<"$extras"; then
      say "$VENV is up to date with the sources ([$1] installed); skipping the reinstall" \
          "(JAX_EPILOG_REINSTALL=1 forces it)"
      return
    fi
    # The package is current: only the extra's dependencies are missing (no rebuild).
    say "adding the dependencies of the [$1] extra to $VENV..."
    "$VENV/bin/python" -m pip install -q "jax-epilog[$1]"
    printf '%s\n' "$extras" "$1" | sort -u > "$STAMP.extras"
    installed_freeze > "$STAMP.freeze"
    return
  fi
  say "installing jax-epilog[$1] into $VENV: fetching the dependencies and, where there is an" \
      "NVIDIA driver, building the C++ handler; about 1-2 minutes (more on a first run)..."
  rm -f "$STAMP.hash"  # an interrupted install leaves no stamp
  local start=$SECONDS
  "$VENV/bin/python" -m pip install -q "$ROOT[$1]"
  echo "$1" > "$STAMP.extras"
  installed_freeze > "$STAMP.freeze"
  echo "$hash" > "$STAMP.hash"
  say "installed in $((SECONDS - start)) s"
  say_without_handler
}

# pip shows the build's output only with -v: repeat the line a wheel built without the CUDA
# handler carries (build_backend/jax_epilog_build.py), if this one does.
say_without_handler() {
  local line
  line="$(cd / && "$VENV/bin/python" -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("jax_epilog")
note = pathlib.Path(spec.origin).with_name("_no_cuda_handler.txt") if spec else None
print(note.read_text().strip() if note and note.exists() else "")' 2>/dev/null || true)"
  if [ -n "$line" ]; then say "$line (JAX_EPILOG_BUILD_CUDA=1 builds it)"; fi
}
