"""Runs `tests/support/sharding_checks.py`, `tests/support/swiglu_sharding_checks.py` and
`tests/support/explicit_sharding_checks.py` where they need several devices (see the first's
docstring).

The checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax is imported,
which this process has already done, so they run in a pytest process of their own. The run
must pass every collected check: none skipped, so it cannot pass vacuously.
"""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import jax_epilog

from conftest import cuda_devices

CHECKS = ("sharding_checks.py", "swiglu_sharding_checks.py", "explicit_sharding_checks.py")


def _run_checks(checks: str, env_updates: dict[str, str]) -> None:
    path = Path(__file__).resolve().parents[1] / "support" / checks
    # No preallocation in the child: the GPU suite's pytest workers already hold their memory
    # fractions of every GPU (a child taking its own fraction aborted, out of memory, on 2 H200s).
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env_updates}
    # The child imports the jax_epilog this process imported (an installed one carries the
    # CUDA library; the source tree does not).
    package_root = str(Path(jax_epilog.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-p",
                           "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                          env=env, cwd=path.parent, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.fullmatch(r"=* ?\d+ passed(, \d+ warnings?)? in [\d.]+s( \(.*\))? ?=*", summary), summary
    if "warning" in summary:  # passed, but say what the child warned about
        section = proc.stdout.split("warnings summary", 1)[-1]
        warnings.warn(f"sharding checks: {section[:3000]}", RuntimeWarning, stacklevel=2)


@pytest.mark.slow
@pytest.mark.parametrize("checks", CHECKS)
def test_sharded_on_8_host_cpu_devices(checks):
    _run_checks(checks, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                 "JAX_PLATFORMS": "cpu"})


@pytest.mark.gpu
@pytest.mark.skipif(len(cuda_devices()) < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("checks", CHECKS)
def test_sharded_on_gpus(checks):
    _run_checks(checks, {"JAX_PLATFORMS": "cuda", "JAX_EPILOG_EXPECT_KERNEL": "1"})
