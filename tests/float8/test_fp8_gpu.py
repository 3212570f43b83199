"""`jax_epilog.matmul` with FP8 operands on a CUDA device (Hopper or newer): the cuBLASLt custom
call against the float64 model (`fp8_reference`), SPEC §5.

Every test here is marked `gpu` and skipped where JAX sees no CUDA device. What must run the
kernel is what was measured to (benchmarks/README.md, cuBLASLt 13.1 on the H200, through nvmath):
BIAS, RELU_BIAS, RELU_AUX_BIAS, GELU_BIAS, GELU_AUX_BIAS, DRELU, DRELU_BGRAD and DGELU_BGRAD
with e4m3 x e4m3, e5m2 x e4m3 and e4m3 x e5m2 operands and a bfloat16 result. Other results
(float16, float32, FP8) and `result_amax` are checked for their values whichever way they run;
where cuBLASLt refuses them the lowering warns and runs the reference, and the tests list those
cases in a warning (and `test_fp8_result_with_amax_runs_the_kernel` is an xfail that XPASSes
where cuBLASLt accepts an FP8 result with its amax).
"""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from fp8_reference import PAIRS, make, mismatches
from jax_epilog import Epilog
from jax_epilog.runtime import library as cuda_library

pytestmark = pytest.mark.gpu

H200_EPILOGS = [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS,
                Epilog.GELU_AUX_BIAS, Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD]
# (m, n, k): TN-aligned; N unaligned (padded to 16 columns); K unaligned; odd M.
SHAPES = [(128, 256, 64), (127, 129, 48), (33, 144, 40)]
# cuBLASLt's tanh (GELU epilogs) against float64: ~1e-4 of the largest value (H200, float32);
# everything else is exact on these integer operands.
GELU_RTOL = 1e-3
# The bias gradients (DRELU_BGRAD, DGELU_BGRAD) are sums over M computed by the kernel in its
# own order, possibly of the stored (rounded) y: as test_matmul_gpu allows bf16 sums.
SUM_RTOL = 2e-2


def _gpu():
    return jax.devices("cuda")[0]


def _run(epilog, a, b, inputs, qs, *, result_dtype, result_amax=False, transpose_a=False,
         transpose_b=True):
    def f(a, b, inputs, qs):
        return jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=inputs or None,
                                 quantization_scales=qs, preferred_element_type=result_dtype,
                                 result_amax=result_amax, transpose_a=transpose_a,
                                 transpose_b=transpose_b)

    f = jax.jit(f)
    args = jax.device_put((a, b, inputs, qs), _gpu())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = f.lower(*args).as_text()
    fell_back = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    used_kernel = "jax_epilog_matmul" in hlo
    if not used_kernel:
        assert fell_back, "the reference ran without the RuntimeWarning SPEC §5 asks for"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = jax.device_get(f(*args))
    return out, used_kernel, fell_back


def _check(epilog, pair, result_dtype, shape, *, result_amax=False, transpose_a=False,
           transpose_b=True, integers=True, seed=0):
    m, n, k = shape
    rng = np.random.default_rng(seed)
    a, b, inputs, qs = make(rng, epilog, m=m, n=n, k=k, a_dtype=pair[0], b_dtype=pair[1],
                            result_dtype=result_dtype, integers=integers,
                            transpose_a=transpose_a, transpose_b=transpose_b)
    got, used_kernel, fell_back = _run(epilog, a, b, inputs, qs, result_dtype=result_dtype,
                                       result_amax=result_amax, transpose_a=transpose_a,
                                       transpose_b=transpose_b)
    gelu = "GELU" in epilog.name
    rtol = GELU_RTOL if gelu else (1e-6 if integers else 1e-3)
    found = mismatches(epilog, got, a, b, inputs, qs, result_dtype=result_dtype, n=n,
                       exact=False, rtol=rtol, result_amax=result_amax,
                       transpose_a=transpose_a, transpose_b=transpose_b, sum_rtol=SUM_RTOL)
    assert not found, (epilog.name, pair, result_dtype, shape, used_kernel, found)
    return used_kernel, fell_back


def _ids(x):
    if isinstance(x, Epilog):
        return x.name
    if isinstance(x, tuple) and len(x) == 2:
        return f"{x[0][8:]}x{x[1][8:]}"
    if isinstance(x, tuple):
        return "x".join(map(str, x))
    return str(x)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("epilog", H200_EPILOGS, ids=_ids)
def test_kernel_runs_and_matches_the_model_bf16_result(epilog, pair, shape):
    """What the H200 was measured to accept: the kernel must run (and be right)."""
    used_kernel, fell_back = _check(epilog, pair, "bfloat16", shape)
    assert used_kernel, f"{epilog.name} {pair} -> bfloat16 fell back to the reference: {fell_back}"
    assert cuda_library.available(), cuda_library.unavailable_reason()


CASES = [(e, p, r, amax) for e in H200_EPILOGS for p in PAIRS
         for r in ("float16", "float32", "float8_e4m3fn", "float8_e5m2")
         for amax in (False, True)] + [
    (e, p, "bfloat16", True) for e in H200_EPILOGS for p in PAIRS]


@pytest.mark.parametrize("epilog,pair,result_dtype,result_amax", CASES, ids=_ids)
def test_other_results_and_amax_match_the_model(epilog, pair, result_dtype, result_amax):
    """16/32-bit and FP8 results, with and without the amax: right whichever way they run
    (the kernel where cuBLASLt takes them, else the reference with a RuntimeWarning)."""
    used_kernel, fell_back = _check(epilog, pair, result_dtype, SHAPES[1],
                                    result_amax=result_amax, seed=1)
    if not used_kernel:  # listed in pytest's warnings summary, for the record
        warnings.warn(f"no cuBLASLt FP8 kernel for {epilog.name} {pair} -> {result_dtype}"
                      f"{' + amax' if result_amax else ''}: {fell_back}", UserWarning)


# Measured on the H200 (XPASS in every run of 2026-12-01 while this was an xfail): cuBLASLt
# accepts an e4m3 result with its amax when C has a bfloat16 layout (nvmath's C type = D type
# is refused).
@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS],
                         ids=_ids)
def test_fp8_result_with_amax_runs_the_kernel(epilog):
    used_kernel, fell_back = _check(epilog, PAIRS[0], "float8_e4m3fn", SHAPES[0],
                                    result_amax=True, seed=2)
    assert used_kernel, fell_back


@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True],
                                                                          repeat=2)))
def test_every_layout_runs_the_k_major_kernel(transpose_a, transpose_b):
    used_kernel, fell_back = _check(Epilog.RELU_AUX_BIAS, PAIRS[0], "bfloat16", SHAPES[1],
                                    transpose_a=transpose_a, transpose_b=transpose_b, seed=3)
    assert used_kernel, fell_back


@pytest.mark.parametrize("layout", ["lead_shared_b", "batched_b", "batched_bias"])
@pytest.mark.parametrize("epilog", [Epilog.RELU_AUX_BIAS, Epilog.DRELU_BGRAD], ids=_ids)
def test_leading_dims_match_the_model(epilog, layout):
    """Leading dims: folded into M (shared b) or a strided batch (batched b or bias), right
    whichever way they run (the kernel where cuBLASLt takes the batch, listed otherwise)."""
    lead, b_batched, bias_batched = {"lead_shared_b": ((2, 3), False, False),
                                     "batched_b": ((3,), True, False),
                                     "batched_bias": ((2,), False, True)}[layout]
    if bias_batched and not epilog.has_bias:
        pytest.skip("no bias")
    rng = np.random.default_rng(8)
    a, b, inputs, qs = make(rng, epilog, m=33, n=144, k=64, lead=lead, b_batched=b_batched,
                            bias_batched=bias_batched, transpose_b=True, integers=True,
                            result_dtype="float8_e4m3fn")
    got, used_kernel, fell_back = _run(epilog, a, b, inputs, qs, result_dtype="float8_e4m3fn")
    found = mismatches(epilog, got, a, b, inputs, qs, result_dtype="float8_e4m3fn", n=144,
                       exact=False, rtol=1e-6, transpose_b=True, sum_rtol=SUM_RTOL)
    assert not found, (layout, used_kernel, found)
    if not used_kernel:
        warnings.warn(f"no cuBLASLt FP8 kernel for {epilog.name} {layout}: {fell_back}",
                      UserWarning)


@pytest.mark.parametrize("epilog", [Epilog.RELU_AUX_BIAS, Epilog.DRELU_BGRAD, Epilog.BIAS],
                         ids=_ids)
def test_random_operands_within_fp8_rounding(epilog):
    """Normal operands: the float32 accumulation (cuBLASLt's split accumulation) against
    float64."""
    used_kernel, fell_back = _check(epilog, PAIRS[1], "bfloat16", (256, 512, 1024),
                                    integers=False, seed=4)
    assert used_kernel, fell_back


def test_traced_scales_reach_the_kernel():
    """The scales are device buffers: new values, no recompilation, right results.

    Integer operands make every product, sum and scaling exact in float32, so a scale that did
    not reach the kernel shows as a wrong value, not as a rounding. (Random normal operands
    are judged in `test_random_operands_within_fp8_rounding` and
    `test_scales_multiply_the_accumulator_exactly`: Hopper's FP8 accumulation is not exact.)"""
    rng = np.random.default_rng(5)
    a, b, inputs, _ = make(rng, Epilog.RELU_BIAS, m=64, n=128, k=64, transpose_b=True,
                           integers=True)
    f = jax.jit(lambda a, b, bias, sa, sb: jax_epilog.matmul(
        a, b, epilog="relu_bias", epilog_inputs={"bias": bias}, transpose_b=True,
        quantization_scales={"a": sa, "b": sb}))
    args = jax.device_put((a, b, inputs["bias"]), _gpu())
    assert "jax_epilog_matmul" in f.lower(*args, jnp.float32(1), jnp.float32(1)).as_text()
    for sa, sb in [(0.5, 2.0), (0.125, 3.0), (4.0, 0.25)]:
        qs = {"a": jnp.float32(sa), "b": jnp.float32(sb)}
        got = jax.device_get(f(*args, qs["a"], qs["b"]))
        found = mismatches(Epilog.RELU_BIAS, got, a, b, inputs, qs, result_dtype="bfloat16",
                           n=128, exact=False, rtol=1e-6, transpose_b=True)
        assert not found, (sa, sb, found)
    assert f._cache_size() == 1


def test_scales_multiply_the_accumulator_exactly():
    """Random normal operands, a float32 result: scales whose product is 1 give the unscaled
    result bit for bit, and a power-of-two product scales it exactly. So the scales reach the
    kernel as one exact factor on the accumulator, and what differs from the float64 model is
    the accumulation itself, which is bounded here by 2^-10 of sum |a||b| (Hopper's FP8 tensor
    cores accumulate in fewer bits than float32 within a block of K; the bound is loose)."""
    rng = np.random.default_rng(5)
    a, b, _, _ = make(rng, Epilog.DEFAULT, m=64, n=128, k=64, transpose_b=True)
    f = jax.jit(lambda a, b, sa, sb: jax_epilog.matmul(
        a, b, transpose_b=True, quantization_scales={"a": sa, "b": sb},
        preferred_element_type=jnp.float32))
    args = jax.device_put((a, b), _gpu())
    assert "jax_epilog_matmul" in f.lower(*args, jnp.float32(1), jnp.float32(1)).as_text()
    unscaled = np.asarray(f(*args, jnp.float32(1), jnp.float32(1)))
    for sa, sb in [(0.5, 2.0), (4.0, 0.25)]:
        np.testing.assert_array_equal(np.asarray(f(*args, jnp.float32(sa), jnp.float32(sb))),
                                      unscaled)
    np.testing.assert_array_equal(np.asarray(f(*args, jnp.float32(0.5), jnp.float32(0.25))),
                                  unscaled * np.float32(0.125))
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    exact = a64 @ b64.T
    magnitude = np.abs(a64) @ np.abs(b64).T
    error = np.abs(unscaled - exact) / magnitude
    print(f"FP8 accumulation: max |y - exact| / sum|a||b| = {error.max():.3g} "
          f"(2^{np.log2(error.max()):.1f}); values off by more than 2^-20: "
          f"{np.count_nonzero(error > 2.0**-20)} of {error.size}")
    assert error.max() <= 2.0**-10


def test_vmap_with_per_example_scales_runs_one_kernel():
    rng = np.random.default_rng(6)
    a = jnp.asarray(rng.integers(-4, 5, (3, 64, 32)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.integers(-4, 5, (128, 32)), jnp.float8_e4m3fn)
    bias = jnp.asarray(rng.integers(-4, 4, 128) / 2, jnp.bfloat16)
    sa = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)

    def f(a, s):
        return jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs={"bias": bias},
                                 transpose_b=True, quantization_scales={"a": s, "b": 1.0},
                                 result_amax=True)

    g = jax.jit(jax.vmap(f))
    args = jax.device_put((a, sa), _gpu())
    assert jax.jit(jax.vmap(f)).lower(*args).as_text().count("jax_epilog_matmul") >= 1
    y, aux = jax.device_get(g(*args))
    for i in range(3):
        want = jax.device_get(jax.jit(f)(*jax.device_put((a[i], sa[i]), _gpu())))
        np.testing.assert_array_equal(np.asarray(y[i], np.float32),
                                      np.asarray(want[0], np.float32))
        assert float(aux["result_amax"][i]) == float(want[1]["result_amax"])


def test_backend_xla_runs_xlas_fp8_gemm():
    rng = np.random.default_rng(7)
    a, b, inputs, qs = make(rng, Epilog.RELU_BIAS, m=256, n=256, k=256, transpose_b=True)
    f = jax.jit(lambda a, b, bias: jax_epilog.matmul(
        a, b, epilog="relu_bias", epilog_inputs={"bias": bias}, transpose_b=True,
        quantization_scales=qs, backend="xla"))
    args = jax.device_put((a, b, inputs["bias"]), _gpu())
    compiled = f.lower(*args).compile().as_text()
    assert "jax_epilog_matmul" not in compiled
    got = jax.device_get(f(*args))
    found = mismatches(Epilog.RELU_BIAS, got, a, b, inputs, qs, result_dtype="bfloat16", n=256,
                       exact=False, rtol=1e-2, transpose_b=True)
    assert not found, found


def test_query_says_no_to_e5m2_x_e5m2_and_yes_to_the_measured_pairs():
    common = (False, True, 1, 1, 1, 256, 256, 256, False, 1 << 25)
    supported, message = cuda_library.query_support(
        int(Epilog.RELU_BIAS), "float8_e5m2", *common, b_dtype="float8_e5m2",
        result_dtype="bfloat16")
    assert supported is False, message
    for a_dtype, b_dtype in PAIRS:
        supported, message = cuda_library.query_support(
            int(Epilog.RELU_AUX_BIAS), a_dtype, *common, b_dtype=b_dtype,
            result_dtype="bfloat16")
        assert supported is True, (a_dtype, b_dtype, message)

