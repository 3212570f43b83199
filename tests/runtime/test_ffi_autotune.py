"""Autotuning in the C++ library (ffi/autotune.cc) times its candidates on scratch inputs it fills
itself, so what the call's buffers hold (here NaN) cannot make every candidate fail the check
against the heuristic's output. GPU only."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import config
from jax_epilog.runtime import targets
from jax_epilog.runtime import library as cuda_library

# "jax_epilog autotune: <problem>: ms per launch [0.0123 - 0.0119] -> candidate 2"
LOG = re.compile(r"jax_epilog autotune: .*: ms per launch \[(?P<times>[^\]]*)\] -> candidate")


@pytest.mark.gpu
def test_candidates_are_timed_on_defined_data_when_inputs_are_nan(tmp_path, monkeypatch, capfd):
    if not cuda_library.available():
        pytest.skip(f"the CUDA library is not loaded: {cuda_library.unavailable_reason()}")
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE_CACHE", str(tmp_path / "autotune.txt"))
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE_LOG", "1")
    before = config.autotune()
    config.set_autotune(True)
    cuda_library.clear_plan_cache()  # forgets every plan; file and log as set above
    try:
        a = jnp.full((1024, 1024), jnp.nan, jnp.float16)
        b = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024)), jnp.float16)
        bias = jnp.zeros((1024,), jnp.float16)
        f = jax.jit(lambda a, b, bias: jax_epilog.matmul(
            a, b, epilog="relu_bias", epilog_inputs={"bias": bias}, backend="cublaslt"))
        assert targets.MATMUL.name in f.lower(a, b, bias).as_text()
        jax.block_until_ready(f(a, b, bias))
        logged = [LOG.search(line) for line in capfd.readouterr().err.splitlines()]
        logged = [m for m in logged if m]
        print(*(m.group(0) for m in logged), sep="\n")
        assert len(logged) == 1, "one problem, tuned once"
        timed = [t for t in logged[0]["times"].split() if t != "-"]
        # On the call's NaN inputs only the heuristic's own choice passed the check.
        assert len(timed) >= 2, logged[0].group(0)
    finally:
        config.set_autotune(before)
        cuda_library.clear_plan_cache()
