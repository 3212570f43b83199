"""Shared test setup: GPU detection, and the shared test modules on the path.

The tests mirror the package (tests/op, tests/planning, tests/float8, tests/layers,
tests/serving, tests/tools) beside tests/benchmarks and tests/examples; what several of them
import (the float64 references, problem generators, the multi-device checks) is in
tests/support, which this file puts on `sys.path`, with benchmarks/ (whose scripts the
benchmark tests import). GPU tests are marked `gpu` and skip
themselves cleanly where JAX sees no CUDA device (CI).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import jax
import pytest


def cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


HAS_CUDA = bool(cuda_devices())
if HAS_CUDA:
    # The GPU tests check the cuBLASLt kernel, so "auto" means the kernel here (and in the
    # processes the tests start); tests of the per-problem choice remove this themselves.
    os.environ.setdefault("JAX_EPILOG_BACKEND", "cublaslt")


def _slow_cases() -> frozenset[str]:
    """The cases scripts/tier_tests.py moved to the slow tier (node or function ids)."""
    lines = (Path(__file__).with_name("slow_cases.txt")).read_text().splitlines()
    return frozenset(line for line in lines if line and not line.startswith("#"))


# First, so that `-m "not slow"` (the mark plugin's own hook) sees the markers added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    slow_cases = _slow_cases()
    skip = None if HAS_CUDA else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.nodeid in slow_cases or item.nodeid.split("[", 1)[0] in slow_cases:
            item.add_marker(pytest.mark.slow)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_device():
    return jax.devices("cpu")[0]
