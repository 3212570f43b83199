"""`matmul(..., fast_accumulation=True)`: cuBLASLt's FP8 fast accumulation
(CUBLASLT_MATMUL_DESC_FAST_ACCUM), FP8 operands only.

On the CPU: the argument checks, the reference's values (unchanged by the option), jit and
vmap, and the custom call lowered for CUDA from this host, which carries the attribute
`fast_accumulation` on both targets and on every way to the kernel (K-major, transposed,
padded, vmapped) and asks cuBLASLt's support query for the same problem. On a CUDA device
(marked `gpu`, skipped elsewhere): the kernel runs with it and stays within a (looser)
tolerance of the float64 model.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog.planning import context
from fp8_reference import PAIRS, make, mismatches
from jax_epilog import Epilog
from jax_epilog.op import lowering
from jax_epilog.op.call import epilog_matmul_p, kernel_p

E4M3 = jnp.float8_e4m3fn


def _fp8_call(epilog, a, b, inputs, qs, **kw):
    return jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=inputs or None,
                             quantization_scales=qs, **kw)


# --- argument checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_16_and_32_bit_operands_refuse_it(dtype):
    a, b = jnp.ones((4, 8), dtype), jnp.ones((8, 16), dtype)
    with pytest.raises(ValueError, match=r"fast_accumulation: applies to FP8 operands only") as e:
        jax_epilog.matmul(a, b, fast_accumulation=True)
    if dtype == jnp.float32:
        assert "precision=" in str(e.value) and "TF32" in str(e.value)
    with pytest.raises(ValueError, match="fast_accumulation"):
        jax_epilog.reference_matmul(a, b, fast_accumulation=True)
    # False is every call's default, whatever the operands
    np.testing.assert_array_equal(jax_epilog.matmul(a, b, fast_accumulation=False),
                                  jax_epilog.matmul(a, b))


@pytest.mark.parametrize("value", ["yes", 1, 0, None, 1.0, jnp.asarray(True)])
def test_not_a_bool_is_refused(value):
    rng = np.random.default_rng(0)
    a, b, inputs, qs = make(rng, Epilog.DEFAULT, m=4, n=16, k=16, integers=True)
    with pytest.raises((TypeError, ValueError), match="fast_accumulation"):
        _fp8_call(Epilog.DEFAULT, a, b, inputs, qs, fast_accumulation=value)


def test_numpy_bool_is_a_bool():
    rng = np.random.default_rng(0)
    a, b, inputs, qs = make(rng, Epilog.DEFAULT, m=4, n=16, k=16, integers=True)
    with jax.default_device(jax.devices("cpu")[0]):
        got = _fp8_call(Epilog.DEFAULT, a, b, inputs, qs, fast_accumulation=np.bool_(True))
        want = _fp8_call(Epilog.DEFAULT, a, b, inputs, qs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_direct_bind_with_16_bit_operands_is_refused():
    a, b = jnp.ones((1, 4, 8), jnp.bfloat16), jnp.ones((1, 8, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="fast_accumulation needs FP8 operands"):
        jax.eval_shape(lambda a, b: epilog_matmul_p.bind(
            a, b, epilog=int(Epilog.DEFAULT), transpose_a=False, transpose_b=False,
            allow_tf32=False, backend="auto", fast_accumulation=True), a, b)


# --- values on the CPU: the reference computes the exact float32 formula ----------------------

CPU_CASES = [(Epilog.DEFAULT, PAIRS[0], "bfloat16", False),
             (Epilog.RELU_BIAS, PAIRS[1], "float32", True),
             (Epilog.GELU_AUX_BIAS, PAIRS[2], "float8_e4m3fn", True),
             (Epilog.DRELU_BGRAD, PAIRS[1], "float8_e5m2", False),
             (Epilog.BGRADB, PAIRS[0], "float16", True)]


@pytest.mark.parametrize("epilog,pair,result_dtype,result_amax", CPU_CASES,
                         ids=lambda x: x.name if isinstance(x, Epilog) else None)
def test_the_reference_gives_the_same_values_with_and_without(epilog, pair, result_dtype,
                                                              result_amax):
    rng = np.random.default_rng(1)
    a, b, inputs, qs = make(rng, epilog, m=9, n=40, k=32, a_dtype=pair[0], b_dtype=pair[1],
                            result_dtype=result_dtype, transpose_b=True)
    kw = dict(preferred_element_type=result_dtype, result_amax=result_amax, transpose_b=True)
    with jax.default_device(jax.devices("cpu")[0]):
        fast = _fp8_call(epilog, a, b, inputs, qs, fast_accumulation=True, **kw)
        plain = _fp8_call(epilog, a, b, inputs, qs, **kw)
        reference = jax_epilog.reference_matmul(a, b, epilog=epilog, epilog_inputs=inputs or None,
                                                quantization_scales=qs, fast_accumulation=True,
                                                **kw)
    for got in (fast, reference):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    found = mismatches(epilog, fast, a, b, inputs, qs, result_dtype=result_dtype, n=40,
                       exact=False, rtol=1e-5, result_amax=result_amax, transpose_b=True)
    assert not found, found


def test_jit_keeps_it_static_and_vmap_keeps_it():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.integers(-4, 5, (3, 5, 32)), E4M3)
    b = jnp.asarray(rng.integers(-4, 5, (16, 32)), E4M3)
    bias = jnp.asarray(rng.integers(-4, 4, 16) / 2, jnp.bfloat16)

    def f(a, sa, fast=True):
        return jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs={"bias": bias},
                                 transpose_b=True, quantization_scales={"a": sa, "b": 2.0},
                                 fast_accumulation=fast)

    sa = jnp.float32(0.5)
    with jax.default_device(jax.devices("cpu")[0]):
        jaxpr = jax.make_jaxpr(f)(a, sa)
        eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive is epilog_matmul_p]
        assert len(eqns) == 1 and eqns[0].params["fast_accumulation"] is True
        assert "fast_accumulation=False" in str(jax.make_jaxpr(
            lambda a, sa: f(a, sa, fast=False))(a, sa))
        got = jax.jit(f)(a, sa)
        want = jax.jit(lambda a, sa: f(a, sa, fast=False))(a, sa)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        folded = jax.vmap(f, in_axes=(0, None))(a, sa)  # shared scales: one folded GEMM
        np.testing.assert_array_equal(np.asarray(folded, np.float32),
                                      np.asarray(want, np.float32))
        scales = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)  # per example: the plain product
        mapped = jax.vmap(f)(a, scales)
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(mapped[i], np.float32),
                                          np.asarray(f(a[i], scales[i], fast=False), np.float32))


# --- the custom call lowered for CUDA from this host -------------------------------------------

@pytest.fixture
def on_cuda(monkeypatch):
    """Lowering for CUDA as on a GPU machine whose cuBLASLt has every kernel; the support
    queries' keyword arguments are recorded."""
    queries = []

    def query(*args, **kw):
        queries.append(kw)
        return True, ""

    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: True)
    monkeypatch.setattr(lowering.cuda_library, "supports_fp8", lambda: True, raising=False)
    monkeypatch.setattr(lowering.cuda_library, "query_support", query)
    monkeypatch.setattr(context, "has_cuda_devices", lambda: False)
    return queries


def _custom_calls(f, *args) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernel is emitted
        text = jax.export.export(jax.jit(f), platforms=("cuda",),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
            *args).mlir_module()
    return [line for line in text.splitlines()
            if "stablehlo.custom_call @jax_epilog_matmul" in line]


def _attribute(call: str) -> str:
    found = re.findall(r"fast_accumulation = (\w+)", call)
    assert len(found) == 1, call
    return found[0]


# (m, n, k, transpose_a, transpose_b): K-major; a transposed (relaid out in XLA); N and K
# unaligned (padded); both.
LAYOUTS = [(16, 32, 32, False, True), (16, 32, 32, True, False), (5, 24, 40, False, True),
           (7, 20, 20, True, True)]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("m,n,k,transpose_a,transpose_b", LAYOUTS)
def test_the_fp8_custom_call_carries_it_on_every_way_to_the_kernel(on_cuda, fast, m, n, k,
                                                                  transpose_a, transpose_b):
    rng = np.random.default_rng(3)
    a, b, inputs, qs = make(rng, Epilog.RELU_AUX_BIAS, m=m, n=n, k=k, integers=True,
                            transpose_a=transpose_a, transpose_b=transpose_b)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales=qs, transpose_a=transpose_a,
                                 transpose_b=transpose_b, fast_accumulation=fast)

    calls = _custom_calls(f, a, b, inputs["bias"])
    assert len(calls) == 1
    assert _attribute(calls[0]) == str(fast).lower()
    # the support query was asked about the same problem
    assert on_cuda and all(q["fast_accumulation"] is fast for q in on_cuda), on_cuda


@pytest.mark.parametrize("fast", [True, False])
def test_the_target_with_c_carries_it(on_cuda, fast):
    rng = np.random.default_rng(4)
    a, b, inputs, qs = make(rng, Epilog.BIAS, m=16, n=32, k=32, integers=True,
                            transpose_b=True)
    c = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)

    def f(a, b, c, bias):
        return jax_epilog.matmul(a, b, c, beta=1.0, epilog="bias", epilog_inputs={"bias": bias},
                                 quantization_scales=qs, transpose_b=True,
                                 fast_accumulation=fast)

    calls = _custom_calls(f, a, b, c, inputs["bias"])
    assert len(calls) == 1 and "@jax_epilog_matmul_c(" in calls[0], calls
    assert _attribute(calls[0]) == str(fast).lower()
    assert all(q["fast_accumulation"] is fast and q["has_c"] for q in on_cuda), on_cuda


def test_16_bit_calls_carry_false(on_cuda):
    a = jnp.ones((16, 32), jnp.bfloat16)
    b = jnp.ones((32, 64), jnp.bfloat16)
    calls = _custom_calls(lambda a, b: jax_epilog.matmul(a, b, epilog="relu"), a, b)
    assert len(calls) == 1 and _attribute(calls[0]) == "false"


@pytest.mark.parametrize("scales_mapped", [False, True], ids=["folded", "plain_product"])
def test_vmap_keeps_it_in_the_custom_call(on_cuda, scales_mapped):
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.integers(-4, 5, (3, 16, 32)), E4M3)
    b = jnp.asarray(rng.integers(-4, 5, (32, 32)), E4M3)
    scales = jnp.asarray([0.5, 1.0, 2.0], jnp.float32) if scales_mapped else jnp.float32(1)

    def f(a, sa):
        return jax_epilog.matmul(a, b, epilog="relu", transpose_b=True,
                                 quantization_scales={"a": sa, "b": 1.0},
                                 fast_accumulation=True)

    calls = _custom_calls(jax.vmap(f, in_axes=(0, 0 if scales_mapped else None)), a, scales)
    assert len(calls) == 1 and _attribute(calls[0]) == "true", calls


def test_without_a_kernel_the_warning_names_it(monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: True)
    monkeypatch.setattr(lowering.cuda_library, "supports_fp8", lambda: True, raising=False)
    monkeypatch.setattr(lowering.cuda_library, "query_support",
                        lambda *args, **kw: (not kw.get("fast_accumulation"), "no (test)"))
    monkeypatch.setattr(context, "has_cuda_devices", lambda: False)
    rng = np.random.default_rng(6)
    a, b, inputs, qs = make(rng, Epilog.BIAS, m=16, n=32, k=32, transpose_b=True)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="bias", epilog_inputs={"bias": bias},
                                 quantization_scales=qs, transpose_b=True,
                                 fast_accumulation=True)

    with pytest.warns(RuntimeWarning, match="runs no FP8 kernel.*with fast_accumulation"):
        text = jax.export.export(jax.jit(f), platforms=("cuda",),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
            a, b, inputs["bias"]).mlir_module()
    assert "@jax_epilog_matmul" not in text


def test_the_inner_primitive_takes_it():
    """`kernel_p` (one device's call) has the outer primitive's parameters."""
    a = jnp.ones((1, 4, 16), E4M3)
    b = jnp.ones((1, 16, 16), E4M3)
    ones = [jnp.ones((), jnp.float32)] * 2
    out = jax.eval_shape(lambda a, b: kernel_p.bind(
        a, b, *ones, epilog=int(Epilog.DEFAULT), transpose_a=False, transpose_b=True,
        allow_tf32=False, backend="auto", result_dtype="bfloat16", fast_accumulation=True), a, b)
    assert out[0].shape == (1, 4, 16) and out[0].dtype == jnp.bfloat16


# --- on a CUDA device --------------------------------------------------------------------------

# (m, n, k): N unaligned (padded to 16 columns); M = 1; a larger one. K and N follow
# test_fp8_gpu: K-major operands, the lowering pads what is not a multiple of 16.
GPU_SHAPES = [(127, 129, 256), (1, 64, 32), (256, 384, 512)]
GPU_CASES = [(e, p) for e in (Epilog.DEFAULT, Epilog.RELU_BIAS, Epilog.BIAS)
             for p in PAIRS[:2]] + [(Epilog.DRELU_BGRAD, PAIRS[1])]
# Random normal operands (as test_fp8_gpu's test_random_operands_within_fp8_rounding, which
# allows 1e-3 of the largest value besides the bf16 rounding of y). Fast accumulation does
# not promote the tensor cores' partial sums to float32, so it differs from the model by the
# accumulation's rounding as well: ten times that (what test_fp8_gpu allows XLA's own FP8
# GEMM), and twice test_fp8_gpu's SUM_RTOL for the bias gradient (a sum over M of such y).
TIGHT_RTOL, FAST_RTOL = 1e-3, 1e-2
SUM_RTOL, FAST_SUM_RTOL = 2e-2, 4e-2


def _on_gpu(epilog, pair, shape, fast: bool):
    m, n, k = shape
    rng = np.random.default_rng(7)
    a, b, inputs, qs = make(rng, epilog, m=m, n=n, k=k, a_dtype=pair[0], b_dtype=pair[1],
                            transpose_b=True)
    f = jax.jit(lambda a, b, inputs, qs: _fp8_call(epilog, a, b, inputs, qs, transpose_b=True,
                                                   fast_accumulation=fast))
    args = jax.device_put((a, b, inputs, qs), jax.devices("cuda")[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = f.lower(*args).as_text()
    fell_back = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not any("runs no FP8 kernel" in text for text in fell_back), fell_back
    calls = [line for line in hlo.splitlines() if "jax_epilog_matmul" in line]
    assert len(calls) == 1 and f"fast_accumulation = {str(fast).lower()}" in calls[0], hlo
    got = jax.device_get(f(*args))
    return mismatches(epilog, got, a, b, inputs, qs, result_dtype="bfloat16", n=n, exact=False,
                      rtol=FAST_RTOL if fast else TIGHT_RTOL, transpose_b=True,
                      sum_rtol=FAST_SUM_RTOL if fast else SUM_RTOL)


def _ids(x):
    if isinstance(x, Epilog):
        return x.name
    if isinstance(x, tuple) and isinstance(x[0], str):
        return f"{x[0][7:]}x{x[1][7:]}"
    return "x".join(map(str, x))


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "float32_accumulation"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_ids)
@pytest.mark.parametrize("epilog,pair", GPU_CASES, ids=_ids)
def test_the_kernel_runs_and_matches_the_model(epilog, pair, shape, fast):
    """With fast accumulation the kernel runs (no fallback) within FAST_RTOL of the model;
    without it, the same problem still matches within TIGHT_RTOL."""
    found = _on_gpu(epilog, pair, shape, fast=fast)
    assert not found, (epilog.name, pair, shape, fast, found)


@pytest.mark.parametrize("fast", [False, True])
def test_xla_way_asks_xla_for_the_same_accumulation(fast):
    """backend="xla": XLA's own FP8 dot, at DEFAULT precision with fast_accumulation (XLA's
    fast accumulation) and HIGHEST without (float32 accumulation), as the kernel would run."""
    rng = np.random.default_rng(1)
    a, b, inputs, qs = make(rng, Epilog.BIAS, m=32, n=48, k=64, integers=False)
    text = jax.export.export(
        jax.jit(lambda a, b, bias: _fp8_call(Epilog.BIAS, a, b, {"bias": bias}, qs,
                                             backend="xla", fast_accumulation=fast)),
        platforms=("cuda",))(a, b, inputs["bias"]).mlir_module()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and "f8E4M3FN" in dots[0], dots
    # DEFAULT is StableHLO's default precision: no precision_config is printed for it
    assert all(("HIGHEST" in line) != fast for line in dots), dots
