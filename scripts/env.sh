# Sourced by the other scripts: make (once) and activate the project's virtual environment.
# Python 3.12 is preferred (jax 0.11+); 3.11 works with jax 0.10.2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAX_EPILOG_VENV:-$ROOT/.venv}"
pick_python() {
  for candidate in "${PYTHON:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3 python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  echo "no Python >= 3.11 found" >&2; exit 1
}
if [ ! -x "$VENV/bin/python" ]; then
  "$(pick_python)" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# $1: the extras to install, e.g. "demo" or "test". A normal (not editable) install builds
# the C++ handler exactly as a user's install does.
install_project() {
  "$VENV/bin/python" -m pip install -q "$ROOT[$1]"
}
