"""Autotuning of FP8 plans (ffi/autotune.cc): the candidates (up to 32 of the heuristic's, or
enumerated algorithms where it offers fewer than 2) run on FP8 stand-ins, at least two pass the
check against the heuristic's choice and are timed, the tuned call is exact, and the algorithm
is stored under a key with b's and y's types and the amax, from which a new plan takes it.

Integer-valued FP8 operands and power-of-two scales (`fp8_reference.make(integers=True)`) make
every product and sum exact in float32, so y and the amax must equal the float64 model's bit
for bit whichever algorithm runs. GPU only.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from fp8_reference import make, mismatches
from jax_epilog import Epilog
from jax_epilog.runtime import targets
from jax_epilog.runtime import library as cuda_library
from test_autotune import restore_autotune, tuning_into  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu

# Large enough that cuBLASLt has several FP8 algorithms for it.
M, N, K = 2048, 2048, 2048
# support_query's dtype numbers, as the autotune file's keys spell them.
DTYPE_CODES = cuda_library._DTYPE_CODES
LOG = re.compile(r"jax_epilog autotune: (?P<problem>.*): ms per launch \[(?P<times>[^\]]*)\] "
                 r"-> candidate (?P<winner>-?\d+)")

# epilog, a's dtype, b's dtype, y's dtype, result_amax
CASES = [
    (Epilog.RELU_BIAS, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", False),
    (Epilog.DEFAULT, "float8_e5m2", "float8_e4m3fn", "bfloat16", False),
    (Epilog.DEFAULT, "float8_e4m3fn", "float8_e5m2", "bfloat16", False),
    (Epilog.RELU_BIAS, "float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn", True),
]


def _id(case):
    epilog, a_dtype, b_dtype, result_dtype, result_amax = case
    return (f"{epilog.name}-{a_dtype[8:]}x{b_dtype[8:]}->{result_dtype}"
            + ("+amax" if result_amax else ""))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp8_plan_is_tuned_exact_and_stored(case, tuning_into, capfd):
    epilog, a_dtype, b_dtype, result_dtype, result_amax = case
    a, b, inputs, qs = make(np.random.default_rng(0), epilog, m=M, n=N, k=K, a_dtype=a_dtype,
                            b_dtype=b_dtype, result_dtype=result_dtype, integers=True,
                            transpose_b=True)
    f = jax.jit(lambda a, b, inputs, qs: jax_epilog.matmul(
        a, b, epilog=epilog, epilog_inputs=inputs or None, quantization_scales=qs,
        preferred_element_type=result_dtype, result_amax=result_amax, transpose_b=True))
    args = jax.device_put((a, b, inputs, qs), jax.devices("cuda")[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = f.lower(*args).as_text()
    assert targets.MATMUL.name in hlo, [str(w.message) for w in caught]

    def check_exact():
        found = mismatches(epilog, jax.device_get(f(*args)), a, b, inputs, qs,
                           result_dtype=result_dtype, n=N, exact=True, result_amax=result_amax,
                           transpose_b=True)
        assert not found, found

    check_exact()
    logged = [m for m in map(LOG.search, capfd.readouterr().err.splitlines()) if m]
    print(*(m.group(0) for m in logged), sep="\n")
    assert len(logged) == 1, "one FP8 problem, tuned once"
    timed = [t for t in logged[0]["times"].split() if t != "-"]
    assert len(timed) >= 2, logged[0].group(0)  # others than the heuristic's passed the check
    assert int(logged[0]["winner"]) >= 0, logged[0].group(0)

    lines = tuning_into.read_text().splitlines()
    assert len(lines) == 1, lines
    key = lines[0].rsplit(" algo=", 1)[0]
    assert f" dtype={DTYPE_CODES[a_dtype]} " in key, key
    assert (f" dtype_b={DTYPE_CODES[b_dtype]} dtype_d={DTYPE_CODES[result_dtype]}"
            in key), key
    assert (" amax=1" in key) == result_amax, key

    # Every plan forgotten: the new plan takes the stored algorithm, tunes nothing, is exact.
    cuda_library.clear_plan_cache()
    check_exact()
    assert "jax_epilog autotune:" not in capfd.readouterr().err


def test_block_scaled_plan_is_tuned_close_and_stored(tuning_into, capfd):
    """A block-scaled plan (the tuning's scratch holds scale tensors in cuBLASLt's layout) is
    tuned like the others: several candidates pass the check, the tuned call agrees with the
    exact block model, the key names the tile rows, and a new plan takes the stored one.
    1x128 tiles on both operands (the weight gradient's pair): on the H200 (cuBLASLt 13.1)
    the heuristic offered 7 candidates for it, and a single one for 1x128 x 128x128."""
    import test_block_fp8 as blocks_test
    rng = np.random.default_rng(3)
    m, n, k = 2048, 1536, 2048
    a, b, sa, sb = blocks_test.make(rng, m, n, k, ("1x128", "1x128"), False, True)
    f = jax.jit(lambda a, b, sa, sb: blocks_test._call(a, b, sa, sb, False, True,
                                                       backend="cublaslt"))
    args = jax.device_put((a, b, sa, sb), jax.devices("cuda")[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the kernel, not the reference
        assert "jax_epilog_matmul_block" in f.lower(*args).as_text()
    p, size = blocks_test.model(a, b, sa, sb, False, True)

    def check_close():  # the slack test_block_fp8's GPU test allows (Hopper's FP8 sums)
        blocks_test.check(f(*args), p, size, jnp.bfloat16, slack=2.0**-11)

    check_close()
    logged = [m for m in map(LOG.search, capfd.readouterr().err.splitlines()) if m]
    print(*(m.group(0) for m in logged), sep="\n")
    assert len(logged) == 1, "one block-scaled problem, tuned once"
    timed = [t for t in logged[0]["times"].split() if t != "-"]
    assert len(timed) >= 2, logged[0].group(0)
    lines = tuning_into.read_text().splitlines()
    assert len(lines) == 1 and " block_rows=1,1" in lines[0], lines

    cuda_library.clear_plan_cache()
    check_close()
    assert "jax_epilog autotune:" not in capfd.readouterr().err
