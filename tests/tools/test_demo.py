"""The demonstration (`python -m jax_epilog`) runs and reports what it promises."""

import re
import subprocess
import sys

import pytest

from jax_epilog.tools import demo

SMALL = ["--epochs", "3", "--compare-batch", "96", "--compare-width", "33", "--steps", "2",
         "--rounds", "3"]


@pytest.mark.slow
def test_python_dash_m_trains_and_compares(tmp_path):
    # From an empty folder: the installed package is what `python -m` finds, not the sources.
    out = subprocess.run([sys.executable, "-m", "jax_epilog", *SMALL], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for text in ("device:", "backend:", "test accuracy", "step time", "temp memory",
                 "plain JAX (nnx.Linear + relu)", "jax-epilog (fused MLP)", "batch 96",
                 "64 -> 33 -> 33 -> 33 -> 10", "fused / plain step time"):
        assert text in out.stdout, text
    # The ratio comes with the spread of repeated rounds, and without cuBLASLt what it means.
    assert re.search(r"round by round \d+\.\d+-\d+\.\d+ over 3 alternating rounds", out.stdout)
    if "backend: plain-JAX reference lowering" in out.stdout:
        assert "No cuBLASLt here: both models ran plain JAX" in out.stdout
    assert "3/3" in out.stderr  # the tqdm progress bar over the epochs


@pytest.mark.gpu
def test_demo_on_gpu_uses_cublaslt(capsys):
    result = demo.main(["--epochs", "5", "--steps", "5"])
    assert "cuBLASLt custom call" in capsys.readouterr().out
    assert result["test_accuracy"] >= 0.9
    assert result["comparison"]["jax-epilog (fused MLP)"]["custom_call"]
    assert not result["comparison"]["plain JAX (nnx.Linear + relu)"]["custom_call"]


@pytest.mark.parametrize("ratios,says", [
    ([0.97, 1.02, 1.01], "within this machine's round-to-round spread (0.970-1.020 spans 1)"),
    ([1.10, 1.25], "slower than plain JAX in every round (1.100-1.250)"),
    ([0.80, 0.90], "faster than plain JAX in every round (0.800-0.900)"),
])
def test_the_cpu_verdict_follows_the_numbers(ratios, says):
    from jax_epilog.tools.demo import reference_verdict
    assert says in reference_verdict(ratios)
