#!/usr/bin/env bash
# Build the documentation site (Sphinx with MyST and myst-nb, the JAX/Flax/Optax convention)
# into build/docs/html, warnings as errors. Installs the `docs` extra into the venv first (the
# same venv and install stamp as ./scripts/test.sh; no rebuild when only an extra is added).
# The notebooks are rendered with their committed outputs, not executed.
source "$(dirname "$0")/env.sh"
install_project docs
cd "$ROOT"
rm -rf build/docs
start=$SECONDS
"$VENV/bin/python" -m sphinx -W --keep-going -q -c docs . build/docs/html "$@"
say "built the site in $((SECONDS - start)) s: open $ROOT/build/docs/html/index.html"
