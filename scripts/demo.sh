#!/usr/bin/env bash
# Set up and run the demonstration: a fused MLP trained on scikit-learn's digits, on the GPU
# when there is one (with speed and memory against plain JAX), on the CPU fallback otherwise.
source "$(dirname "$0")/env.sh"
install_project demo
cd "$VENV" && exec "$VENV/bin/python" -m jax_epilog "$@"
