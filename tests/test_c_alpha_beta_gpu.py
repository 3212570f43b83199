"""`matmul(a, b, c, alpha=, beta=)` (SPEC §6) on a CUDA device, against the float64 model.

Marked `gpu`: skipped where JAX sees no CUDA device. Run on the GPU machine with
    JAX_EPILOG_BACKEND=cublaslt pytest tests/test_c_alpha_beta_gpu.py -q -p no:cacheprovider

Today a call with `c` runs the exact reference on CUDA with a RuntimeWarning (the C++ handler
does not take c, alpha, beta yet; docs/c_alpha_beta.md), so the value tests pass on the
reference and `test_the_custom_call_runs_with_c` is a strict xfail: when the kernel path is
built it must pass, and the xfail marker must go.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from test_c_alpha_beta import _assert_matches, _problem

pytestmark = pytest.mark.gpu

DTYPES = {"float16": ("float16", None, 4e-3), "bfloat16": ("bfloat16", None, 2e-2),
          "float32": ("float32", "highest", 1e-4)}


def _gpu():
    return jax.devices("cuda")[0]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
@pytest.mark.parametrize("shape", [(127, 129, 300, ()), (1, 8, 16, ()), (33, 136, 64, (3,))])
def test_matches_the_model(epilog, dtype, shape):
    m, n, k, lead = shape
    name, precision, tol = DTYPES[dtype]
    rng = np.random.default_rng(int(epilog) + m + n)
    a, b, c, inputs = _problem(rng, epilog, m=m, n=n, k=k, lead=lead, dtype=name)
    args = jax.device_put((a, b, c, inputs, jnp.float32(0.75), jnp.float32(-1.5)), _gpu())
    f = jax.jit(lambda a, b, c, inputs, alpha, beta: jax_epilog.matmul(
        a, b, c, alpha=alpha, beta=beta, epilog=epilog, epilog_inputs=inputs,
        precision=precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = f(*args)
    _assert_matches(epilog, got, a, b, c, inputs, 0.75, -1.5, tol=tol)


def test_calls_without_c_still_run_the_kernel():
    rng = np.random.default_rng(1)
    a, b, _, inputs = _problem(rng, Epilog.RELU_BIAS, m=64, n=128, k=64, dtype="bfloat16")
    f = jax.jit(lambda a, b, bias: jax_epilog.matmul(a, b, epilog="relu_bias",
                                                     epilog_inputs={"bias": bias}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = f.lower(a, b, inputs["bias"]).compile().as_text()
    assert "jax_epilog_matmul" in text


@pytest.mark.xfail(strict=True, reason="the C++ kernel path for c, alpha, beta is not built "
                   "yet: calls with c run the exact reference (docs/c_alpha_beta.md)")
def test_the_custom_call_runs_with_c():
    rng = np.random.default_rng(2)
    a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=64, n=128, k=64, dtype="bfloat16")
    f = jax.jit(lambda a, b, c, bias, alpha, beta: jax_epilog.matmul(
        a, b, c, alpha=alpha, beta=beta, epilog="relu_bias", epilog_inputs={"bias": bias}))
    args = (a, b, c, inputs["bias"], jnp.float32(0.5), jnp.float32(2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = f.lower(*args).compile().as_text()
    assert "jax_epilog_matmul" in text
    _assert_matches(Epilog.RELU_BIAS, f(*args), a, b, c, inputs, 0.5, 2.0, tol=2e-2)
