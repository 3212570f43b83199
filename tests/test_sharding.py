"""Runs `tests/sharding_checks.py` where it needs several devices (see its docstring).

The checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax is imported,
which this process has already done, so they run in a pytest process of their own. The run
must pass every collected check: none skipped, so it cannot pass vacuously.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cuda_devices

CHECKS = Path(__file__).with_name("sharding_checks.py")


def _run_checks(env_updates: dict[str, str]) -> None:
    env = {**os.environ, **env_updates}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(CHECKS.parents[1]), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p",
                           "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                          env=env, cwd=CHECKS.parent, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.fullmatch(r"=* ?\d+ passed in [\d.]+s( \(.*\))? ?=*", summary), summary


def test_sharded_on_8_host_cpu_devices():
    _run_checks({"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                 "JAX_PLATFORMS": "cpu"})


@pytest.mark.gpu
@pytest.mark.skipif(len(cuda_devices()) < 2, reason="needs 2 CUDA devices")
def test_sharded_on_gpus():
    _run_checks({"JAX_PLATFORMS": "cuda"})
