"""A cuBLASLt failure inside the handler (forced with the test-only
`cuda_library.inject_failures`) is a Python exception naming the status, and the calls after it
compute the right result.
"""

import jax
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from jax_epilog.runtime import targets
from jax_epilog.runtime import library as cuda_library
from problems import TOLERANCE, assert_matches_model, make_problem

pytestmark = pytest.mark.gpu

STATUS = "CUBLAS_STATUS_EXECUTION_FAILED"


@pytest.fixture
def no_pending_failures():
    yield
    cuda_library.inject_failures(0)


@pytest.mark.parametrize("failures", [1, 3])
def test_injected_failures_raise_then_calls_recover(failures, no_pending_failures):
    epilog = Epilog.RELU_AUX_BIAS
    a, b, inputs = make_problem(np.random.default_rng(failures), epilog, m=129, n=200, k=72,
                                dtype="bfloat16")
    f = jax.jit(lambda a, b, inputs: jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=inputs))
    args = jax.device_put((a, b, inputs), jax.devices("cuda")[0])
    assert targets.MATMUL.name in f.lower(*args).as_text()
    jax.block_until_ready(f(*args))  # compiled and planned before any failure is pending

    cuda_library.inject_failures(failures)
    for _ in range(failures):
        with pytest.raises(Exception, match=STATUS) as raised:
            jax.block_until_ready(f(*args))
        assert type(raised.value).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
    for _ in range(2):
        assert_matches_model(epilog, jax.device_get(f(*args)), a, b, inputs,
                             tol=TOLERANCE["bfloat16"], n=200)


def test_cancelled_injection_fails_nothing(no_pending_failures):
    a, b, _ = make_problem(np.random.default_rng(7), Epilog.DEFAULT, m=7, n=129, k=127)
    f = jax.jit(lambda a, b: jax_epilog.matmul(a, b, precision="highest"))
    args = jax.device_put((a, b), jax.devices("cuda")[0])
    cuda_library.inject_failures(2)
    cuda_library.inject_failures(0)
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(a, np.float64) @ np.asarray(b),
                               rtol=1e-5, atol=1e-5)
