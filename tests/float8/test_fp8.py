"""`jax_epilog.matmul` with FP8 operands on the CPU (SPEC §5) against the float64 model
(`fp8_reference`): every epilog and format pair, every result type, saturation, NaN, traced
scales, the dtype rules of the aux arrays, bad inputs, vmap, jit, export (for CUDA from this
host, with the scale operands in the custom call), the automatic backend choice, the lowering's
fallback warning and the TypeError under `jax.grad`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pytest

import fp8_reference
import jax_epilog
from jaxprs import traced_equations
from fp8_reference import PAIRS, RESULTS, make, mismatches
from jax_epilog import Epilog
from jax_epilog.planning import context
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.op import lowering
from jax_epilog.op.call import epilog_matmul_p

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GELU_EPILOGS = {e for e in Epilog if "GELU" in e.name}
# float32 tanh (XLA's, cuBLASLt's) against float64: a few float32 ulps of the largest value.
GELU_RTOL = 1e-6


def run(epilog, a, b, inputs, qs, *, result_dtype, result_amax=False, fn=None, **kw):
    fn = fn or jax_epilog.matmul
    return fn(a, b, epilog=epilog, epilog_inputs=inputs or None, quantization_scales=qs,
              preferred_element_type=result_dtype, result_amax=result_amax, **kw)


def check(epilog, *, m=9, n=40, k=32, pair=PAIRS[0], result_dtype="bfloat16", integers=True,
          result_amax=True, seed=0, fn=None, **kw):
    rng = np.random.default_rng(seed)
    a, b, inputs, qs = make(rng, epilog, m=m, n=n, k=k, a_dtype=pair[0], b_dtype=pair[1],
                            result_dtype=result_dtype, integers=integers, **kw)
    layout = {key: kw[key] for key in ("transpose_a", "transpose_b") if key in kw}
    got = run(epilog, a, b, inputs, qs, result_dtype=result_dtype, result_amax=result_amax,
              fn=fn, **layout)
    exact = integers and epilog not in GELU_EPILOGS
    found = mismatches(epilog, got, a, b, inputs, qs, result_dtype=result_dtype, n=n,
                       exact=exact, rtol=0.0 if exact else (GELU_RTOL if integers else 2e-6),
                       result_amax=result_amax, **layout)
    assert not found, found
    return got


# --- values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0][8:]}x{p[1][8:]}")
@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
def test_every_epilog_and_format_pair_exactly(epilog, pair):
    """Integer-valued operands: everything but GELU's tanh is exact, so bit for bit."""
    check(epilog, pair=pair, result_dtype="bfloat16")
    check(epilog, pair=pair, result_dtype="float8_e4m3fn", m=5, n=33, k=16, seed=1)


@pytest.mark.parametrize("result_dtype", RESULTS)
@pytest.mark.parametrize("epilog", [Epilog.DEFAULT, Epilog.RELU_AUX_BIAS, Epilog.GELU_AUX_BIAS,
                                    Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD, Epilog.BGRADB],
                         ids=lambda e: e.name)
def test_every_result_type(epilog, result_dtype):
    check(epilog, result_dtype=result_dtype, seed=2)
    check(epilog, result_dtype=result_dtype, integers=False, m=17, n=24, k=48, seed=3)


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False),
                                                     (True, True)])
@pytest.mark.parametrize("layout", ["2d", "lead_shared_b", "batched_b", "batched_bias"])
def test_layouts_and_transposes(layout, transpose_a, transpose_b):
    lead, b_batched, bias_batched = {"2d": ((), False, False),
                                     "lead_shared_b": ((2, 3), False, False),
                                     "batched_b": ((3,), True, False),
                                     "batched_bias": ((2,), False, True)}[layout]
    for epilog in (Epilog.RELU_AUX_BIAS, Epilog.DRELU_BGRAD):
        if bias_batched and not epilog.has_bias:
            continue
        check(epilog, m=7, n=130, k=20, lead=lead, b_batched=b_batched, bias_batched=bias_batched,
              transpose_a=transpose_a, transpose_b=transpose_b, seed=4,
              result_dtype="float8_e4m3fn")


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (127, 129, 33), (3, 7, 300), (129, 16, 17)])
def test_odd_sizes(m, n, k):
    check(Epilog.RELU_AUX_BIAS, m=m, n=n, k=k, result_dtype="float8_e4m3fn", seed=5)
    check(Epilog.DGELU_BGRAD, m=m, n=n, k=k, result_dtype="bfloat16", seed=6)


def test_reference_matmul_and_jit_agree_with_matmul():
    rng = np.random.default_rng(7)
    a, b, inputs, qs = make(rng, Epilog.GELU_AUX_BIAS, m=12, n=48, k=32,
                            result_dtype="float8_e5m2")
    kw = dict(result_dtype="float8_e5m2", result_amax=True)
    eager = run(Epilog.GELU_AUX_BIAS, a, b, inputs, qs, **kw)
    reference = run(Epilog.GELU_AUX_BIAS, a, b, inputs, qs, fn=jax_epilog.reference_matmul, **kw)
    jitted = jax.jit(lambda a, b, inputs, qs: run(Epilog.GELU_AUX_BIAS, a, b, inputs, qs, **kw))(
        a, b, inputs, qs)
    for other in (reference, jitted):
        for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(other)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# --- saturation and special values ------------------------------------------------------------

@pytest.mark.parametrize("fmt,largest", [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
def test_fp8_results_saturate(fmt, largest):
    a = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]], E4M3)
    b = jnp.asarray(np.tile([[448.0], [448.0]], (1, 16)), E4M3)
    # R = 448 (896 on row 2); sd·R past the format's largest finite value.
    sd = 1000.0 if fmt == "float8_e5m2" else 10.0
    y, aux = jax_epilog.matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0, "d": sd},
                               preferred_element_type=fmt, result_amax=True)
    y = np.asarray(y).astype(np.float32)
    np.testing.assert_array_equal(y[:, 0], [largest, largest, largest, -largest])
    assert float(aux["result_amax"]) == 896.0  # before the d scale, not saturated
    # Within range: rounded to nearest, not saturated.
    y = jax_epilog.matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0, "d": 1 / 448},
                          preferred_element_type=fmt)
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32)[:, 0], [1.0, 1.0, 2.0, -1.0])


def test_infinite_product_saturates_and_nan_stays_nan():
    a = jnp.asarray([[448.0, 448.0], [float("nan"), 1.0], [-448.0, -448.0]], E4M3)
    b = jnp.asarray(np.full((2, 16), 448.0), E4M3)
    huge = {"a": 1e30, "b": 1e30}  # sa·sb·acc overflows float32 to ±Inf
    y = jax_epilog.matmul(a, b, quantization_scales={**huge, "d": 1.0},
                          preferred_element_type=E4M3)
    y = np.asarray(y).astype(np.float32)
    assert np.all(y[0] == 448.0) and np.all(y[2] == -448.0)
    assert np.all(np.isnan(y[1]))
    y16 = np.asarray(jax_epilog.matmul(a, b, quantization_scales=huge), np.float32)
    assert np.all(np.isinf(y16[0])) and np.all(np.isnan(y16[1]))  # a 16-bit result: Inf is Inf
    _, aux = jax_epilog.matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0},
                               result_amax=True)
    assert np.isnan(float(aux["result_amax"]))  # NaN in R: the amax says so
    # ReLU keeps NaN (as cuBLASLt's epilogs do, SPEC §1) and the FP8 store keeps it NaN.
    y = jax_epilog.matmul(a, b, epilog="relu", quantization_scales={"a": 1.0, "b": 1.0, "d": 1.0},
                          preferred_element_type=E5M2)
    assert np.all(np.isnan(np.asarray(y[1]).astype(np.float32)))


def test_amax_is_before_the_d_scale_and_over_the_epilogs_result():
    a = jnp.asarray([[1.0, -2.0], [3.0, 0.5]], E4M3)
    b = jnp.asarray(np.tile([[2.0], [4.0]], (1, 16)), E4M3)  # P rows: -6, 8 (times sa·sb)
    bias = jnp.full((16,), -1.0, jnp.bfloat16)
    y, aux = jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs={"bias": bias},
                               quantization_scales={"a": 0.5, "b": 1.0, "d": 4.0},
                               preferred_element_type=E4M3, result_amax=True)
    # R = relu(0.5·P - 1): row 0 relu(-4) = 0, row 1 relu(3) = 3; amax 3 (not |-4|, not 12).
    assert float(aux["result_amax"]) == 3.0
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32)[:, 0], [0.0, 12.0])


# --- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("result_dtype,aux", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                              ("float32", "float32"),
                                              ("float8_e4m3fn", "bfloat16"),
                                              ("float8_e5m2", "bfloat16")])
def test_aux_dtypes_follow_the_result(result_dtype, aux):
    rng = np.random.default_rng(8)
    for epilog in (Epilog.GELU_AUX_BIAS, Epilog.DGELU_BGRAD, Epilog.BGRADA, Epilog.RELU_AUX):
        a, b, inputs, qs = make(rng, epilog, m=4, n=16, k=16, result_dtype=result_dtype)
        y, out = run(epilog, a, b, inputs, qs, result_dtype=result_dtype, result_amax=True)
        assert y.dtype == jnp.dtype(result_dtype)
        for name, x in out.items():
            expected = {"relu_aux": "uint8", "result_amax": "float32"}.get(name, aux)
            assert x.dtype == jnp.dtype(expected), (epilog, name, x.dtype)
    assert jax_epilog.matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0}).dtype == jnp.bfloat16


# --- traced scales, jit, vmap, export ------------------------------------------------------------

def test_python_and_numpy_scalar_scales():
    """Python numbers and NumPy scalars (np.float64 is a Python float) are scales too."""
    rng = np.random.default_rng(18)
    a, b, _, _ = make(rng, Epilog.DEFAULT, m=4, n=16, k=16, integers=True)
    want = jax_epilog.matmul(a, b, quantization_scales={"a": jnp.float32(0.5), "b": jnp.float32(2)})
    for sa, sb in [(0.5, 2), (np.float64(0.5), np.float32(2.0)), (np.float32(0.5), 2.0)]:
        got = jax_epilog.matmul(a, b, quantization_scales={"a": sa, "b": sb})
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_traced_scales_do_not_retrace():
    rng = np.random.default_rng(9)
    a, b, inputs, _ = make(rng, Epilog.RELU_AUX_BIAS, m=8, n=32, k=16, result_dtype="float8_e4m3fn")
    traces = []

    @jax.jit
    def f(a, b, bias, sa, sb, sd):
        traces.append(1)
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales={"a": sa, "b": sb, "d": sd},
                                 preferred_element_type=E4M3, result_amax=True)

    for sa, sb, sd in [(0.5, 2.0, 0.25), (1.0, 0.125, 4.0), (3.0, 0.75, 0.1)]:
        qs = {"a": jnp.float32(sa), "b": jnp.float32(sb), "d": jnp.float32(sd)}
        got = f(a, b, inputs["bias"], qs["a"], qs["b"], qs["d"])
        found = mismatches(Epilog.RELU_AUX_BIAS, got, a, b, inputs, qs,
                           result_dtype="float8_e4m3fn", n=32, exact=False, rtol=1e-6,
                           result_amax=True)
        assert not found, found
    assert len(traces) == 1
    jaxpr = jax.make_jaxpr(f)(a, b, inputs["bias"], *[jnp.float32(1)] * 3)
    assert "epilog_matmul" in str(jaxpr)


def _count_binds(fn, *args) -> list:
    return [e for e in traced_equations(fn, *args) if e.primitive is epilog_matmul_p]


def _per_example(fn, *batched):
    return [fn(*(x[i] for x in batched)) for i in range(batched[0].shape[0])]


def test_vmap_with_shared_scales_folds_into_one_gemm():
    rng = np.random.default_rng(10)
    a = jnp.asarray(rng.integers(-4, 5, (3, 5, 32)), E4M3)
    b = jnp.asarray(rng.integers(-4, 5, (32, 16)), E5M2)
    bias = jnp.asarray(rng.integers(-4, 4, 16) / 2, jnp.bfloat16)

    def f(a):
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales={"a": 0.5, "b": 2.0, "d": 0.5},
                                 preferred_element_type=E4M3)

    got = jax.vmap(f)(a)
    binds = _count_binds(jax.vmap(f), a)
    assert len(binds) == 1 and binds[0].params["epilog"] == Epilog.RELU_AUX_BIAS
    for i, want in enumerate(_per_example(f, a)):
        np.testing.assert_array_equal(np.asarray(got[0][i], np.float32),
                                      np.asarray(want[0], np.float32))
        np.testing.assert_array_equal(got[1]["relu_aux"][i], want[1]["relu_aux"])


@pytest.mark.parametrize("mapped", ["a", "b", "d", "amax_only"])
def test_vmap_with_per_example_scales_or_amax(mapped):
    """One GEMM for all examples (the plain product), the scales and epilog per example."""
    rng = np.random.default_rng(11)
    v = 3
    a = jnp.asarray(rng.integers(-4, 5, (v, 2, 6, 32)), E4M3)
    b = jnp.asarray(rng.integers(-4, 5, (v, 2, 32, 16)), E4M3)
    bias = jnp.asarray(rng.integers(-4, 4, (v, 16)) / 2, jnp.bfloat16)
    scales = {key: jnp.asarray([0.5, 2.0, 0.25], jnp.float32) if key == mapped
              else jnp.float32(1.0) for key in "abd"}

    def f(a, b, bias, sa, sb, sd):
        return jax_epilog.matmul(a, b, epilog="gelu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales={"a": sa, "b": sb, "d": sd},
                                 preferred_element_type=E4M3, result_amax=True)

    in_axes = (0, 0, 0, *(0 if key == mapped else None for key in "abd"))
    got = jax.vmap(f, in_axes=in_axes)(a, b, bias, *scales.values())
    binds = _count_binds(jax.vmap(f, in_axes=in_axes), a, b, bias, *scales.values())
    assert len(binds) == 1, "one GEMM for every example, never a loop"
    assert got[1]["result_amax"].shape == (v,)
    for i in range(v):
        args = [x if axis is None else x[i]
                for x, axis in zip((a, b, bias, *scales.values()), in_axes)]
        want = f(*args)
        np.testing.assert_allclose(np.asarray(got[0][i], np.float32),
                                   np.asarray(want[0], np.float32), rtol=0.07, atol=1e-6)
        np.testing.assert_allclose(float(got[1]["result_amax"][i]),
                                   float(want[1]["result_amax"]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]["gelu_aux"][i], np.float32),
                                   np.asarray(want[1]["gelu_aux"], np.float32), rtol=1e-2)


def test_export_round_trip_on_cpu():
    rng = np.random.default_rng(12)
    a, b, inputs, qs = make(rng, Epilog.DRELU_BGRAD, m=12, n=130, k=20,
                            result_dtype="float8_e5m2")

    def f(a, b, mask, sa, sb, sd):
        return jax_epilog.matmul(a, b, epilog="drelu_bgrad", epilog_inputs={"relu_aux": mask},
                                 quantization_scales={"a": sa, "b": sb, "d": sd},
                                 preferred_element_type=E5M2, result_amax=True)

    args = (a, b, inputs["relu_aux"], qs["a"], qs["b"], qs["d"])
    exported = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(*args)
    restored = jax.export.deserialize(exported.serialize())
    for x, y in zip(jax.tree.leaves(restored.call(*args)), jax.tree.leaves(f(*args))):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, True), (False, False), (True, True),
                                                     (True, False)])
def test_export_for_cuda_has_the_custom_call_with_scales_on_k_major_operands(
        transpose_a, transpose_b, monkeypatch):
    """Lowered for CUDA from this host: the custom call, its scale operands (f32 scalars),
    a (M, K) and b (N, K) whatever the caller's transposes (a transpose where needed)."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    rng = np.random.default_rng(13)
    m, n, k = 64, 48, 32
    a, b, inputs, qs = make(rng, Epilog.RELU_AUX_BIAS, m=m, n=n, k=k,
                            result_dtype="float8_e4m3fn", transpose_a=transpose_a,
                            transpose_b=transpose_b)

    def f(a, b, bias, sa, sb, sd):
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales={"a": sa, "b": sb, "d": sd},
                                 preferred_element_type=E4M3, result_amax=True,
                                 transpose_a=transpose_a, transpose_b=transpose_b)

    monkeypatch.setattr(lowering.cuda_library, "available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernel is emitted
        exported = jax.export.export(jax.jit(f), platforms=("cuda",),
                                     disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
            a, b, inputs["bias"], qs["a"], qs["b"], qs["d"])
    text = exported.mlir_module()
    calls = [line for line in text.splitlines()
             if "stablehlo.custom_call @jax_epilog_matmul" in line]
    assert len(calls) == 1, text
    call = calls[0]
    signature = call.rsplit(" : ", 1)[1]
    assert (f"(tensor<1x{m}x{k}xf8E4M3FN>, tensor<1x{n}x{k}xf8E4M3FN>, tensor<1x{n}xbf16>, "
            "tensor<f32>, tensor<f32>, tensor<f32>)") in signature, signature
    assert f"-> (tensor<1x{m}x{n}xf8E4M3FN>, tensor<1x{m}x16xui8>, tensor<f32>, tensor<" \
        in signature, signature
    assert "transpose_a = false" in call and "transpose_b = true" in call
    transposes = text.count("stablehlo.transpose")
    assert transposes == int(transpose_a) + int(not transpose_b), text


def test_export_pads_fp8_to_16_columns(monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: False)
    rng = np.random.default_rng(14)
    a, b, inputs, qs = make(rng, Epilog.GELU_AUX_BIAS, m=5, n=24, k=40, transpose_b=True)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="gelu_aux_bias", epilog_inputs={"bias": bias},
                                 quantization_scales=qs, transpose_b=True)

    text = jax.export.export(jax.jit(f), platforms=("cuda",),
                             disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        a, b, inputs["bias"]).mlir_module()
    call = next(line for line in text.splitlines() if "@jax_epilog_matmul" in line)
    # N 24 -> 32 and K 40 -> 48 (16 FP8 elements); the GELU buffer follows the padded N.
    assert "tensor<1x5x48xf8E4M3FN>, tensor<1x32x48xf8E4M3FN>, tensor<1x32xbf16>" in call, call
    assert "-> (tensor<1x5x32xbf16>, tensor<1x5x32xbf16>" in call, call


# --- what the CUDA lowering does when cuBLASLt has no kernel -----------------------------------

def _lower_for_cuda(monkeypatch, *, fp8_library: bool, supported):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: True)
    monkeypatch.setattr(lowering.cuda_library, "supports_fp8", lambda: fp8_library, raising=False)
    monkeypatch.setattr(lowering.cuda_library, "query_support",
                        lambda *args, **kw: (supported, "CUBLAS_STATUS_NOT_SUPPORTED (test)"))
    monkeypatch.setattr(context, "has_cuda_devices", lambda: False)
    rng = np.random.default_rng(15)
    a, b, inputs, qs = make(rng, Epilog.BGRADB, m=16, n=32, k=16, transpose_b=True)

    def f(a, b):
        return jax_epilog.matmul(a, b, epilog="bgradb", quantization_scales=qs, transpose_b=True)

    return jax.export.export(jax.jit(f), platforms=("cuda",),
                             disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        a, b).mlir_module()


def test_no_fp8_kernel_takes_the_reference_with_a_warning(monkeypatch):
    with pytest.warns(RuntimeWarning, match="runs no FP8 kernel for epilog BGRADB.*reference"):
        text = _lower_for_cuda(monkeypatch, fp8_library=True, supported=False)
    assert "@jax_epilog_matmul" not in text
    # ... and its product is XLA's FP8 dot to float32 (which XLA runs as cuBLASLt's FP8 GEMM),
    # not a float32 GEMM on widened operands nor a bf16 dot.
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all(re.search(r"\(tensor<[^>]*f8E4M3FN>, tensor<[^>]*f8E\w+>\) -> "
                                  r"tensor<[^>]*xf32>", line) for line in dots), dots


def test_a_library_without_fp8_takes_the_reference_with_a_warning(monkeypatch):
    with pytest.warns(RuntimeWarning, match="no FP8 support"):
        text = _lower_for_cuda(monkeypatch, fp8_library=False, supported=True)
    assert "@jax_epilog_matmul" not in text


def test_a_supported_problem_emits_the_kernel(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = _lower_for_cuda(monkeypatch, fp8_library=True, supported=True)
    assert "@jax_epilog_matmul" in text


def test_backend_xla_is_the_direct_fp8_dot(monkeypatch):
    """XLA's way: a dot_general of the FP8 operands themselves (XLA's f8 GEMM rewrite), never
    a dequantize-then-bf16 dot."""
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: False)
    rng = np.random.default_rng(16)
    a, b, inputs, qs = make(rng, Epilog.RELU_BIAS, m=16, n=32, k=16)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs={"bias": bias},
                                 quantization_scales=qs, backend="xla")

    text = jax.export.export(jax.jit(f), platforms=("cuda",))(a, b, inputs["bias"]).mlir_module()
    assert "@jax_epilog_matmul" not in text
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    operand_types = [line.split(" : ", 1)[1].split("->")[0] for line in dots]
    assert dots and all("xf8E4M3FN>" in types for types in operand_types), dots


# --- the automatic backend choice ------------------------------------------------------------

def test_auto_means_cublaslt_for_fp8_without_a_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(decisions, "TABLES_DIR", tmp_path)
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(decisions, "device_identity", lambda: ("NVIDIA H200", 130100))
    decisions.clear_cache()
    try:
        # A bf16 table entry nearby does not decide an FP8 problem.
        decisions.merge_into(tmp_path / "nvidia-h200.json", "NVIDIA H200", 130100, [
            table_format.make_entry(Epilog.RELU_BIAS, "bfloat16", False, True, 4096, 4096, 4096,
                                {"cublaslt": 2.0, "xla": 1.0})])
        d = decisions.decision(Epilog.RELU_BIAS, "float8_e4m3fn", 1, 4096, 4096, 4096, False, True)
        assert d == table_format.Decision("cublaslt", "fp8")
        assert decisions.choose(Epilog.RELU_BIAS, "bfloat16", 1, 4096, 4096, 4096, False,
                               True) == "xla"
        # A measured FP8 problem where XLA won: XLA.
        decisions.merge_into(tmp_path / "nvidia-h200.json", "NVIDIA H200", 130100, [
            table_format.make_entry(Epilog.RELU_BIAS, "float8_e4m3fn", False, True, 4096, 4096, 4096,
                                {"cublaslt": 2.0, "xla": 1.0})])
        assert decisions.choose(Epilog.RELU_BIAS, "float8_e4m3fn", 1, 4096, 4096, 4096, False,
                               True) == "xla"
    finally:
        decisions.clear_cache()


# --- not differentiable ----------------------------------------------------------------------

def test_grad_raises_a_type_error_pointing_to_the_fp8_layers():
    rng = np.random.default_rng(17)
    a, b, inputs, qs = make(rng, Epilog.RELU_BIAS, m=4, n=16, k=16)

    def loss(bias, sa):
        y = jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs={"bias": bias},
                              quantization_scales={"a": sa, "b": qs["b"]})
        return y.astype(jnp.float32).sum()

    for argnums in (0, 1):
        with pytest.raises(TypeError, match="FP8 operands is not differentiable.*dense.*mlp.*fp8="):
            jax.grad(loss, argnums=argnums)(inputs["bias"], qs["a"])
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda a: jax_epilog.matmul(a, b, quantization_scales=qs)
                 .astype(jnp.float32).sum())(a)


# --- bad inputs --------------------------------------------------------------------------------

A8 = np.ones((4, 16), ml_dtypes.float8_e4m3fn)
B8 = np.ones((16, 16), ml_dtypes.float8_e4m3fn)
S = {"a": 1.0, "b": 1.0}
BAD = {  # name: (call arguments, error, message regex: it starts with the argument's name)
    "fp8_a_bf16_b": (dict(b=np.ones((16, 16), ml_dtypes.bfloat16)), TypeError,
                     r"^a: got float8_e4m3fn but b is bfloat16; FP8 operands must both"),
    "bf16_a_fp8_b": (dict(a=np.ones((4, 16), ml_dtypes.bfloat16), quantization_scales=None),
                     TypeError, r"^b: got float8_e4m3fn but a is bfloat16"),
    "e5m2_x_e5m2": (dict(a=A8.astype(ml_dtypes.float8_e5m2), b=B8.astype(ml_dtypes.float8_e5m2)),
                    TypeError, r"^b: a and b are both float8_e5m2"),
    "missing_scales": (dict(quantization_scales=None), TypeError,
                       r"^quantization_scales: FP8 operands need their scales"),
    "missing_scale_b": (dict(quantization_scales={"a": 1.0}), ValueError,
                        r"^quantization_scales: missing \['b'\]"),
    "scales_not_a_dict": (dict(quantization_scales=[1.0, 1.0]), TypeError,
                          r"^quantization_scales: expected a dict"),
    "scale_d_for_bf16": (dict(quantization_scales={**S, "d": 1.0}), ValueError,
                         r"^quantization_scales\['d'\]: only for an FP8 result"),
    "unknown_scale": (dict(quantization_scales={**S, "c": 1.0}), ValueError,
                      r"^quantization_scales: unexpected keys \['c'\]"),
    "scale_bf16": (dict(quantization_scales={"a": jnp.bfloat16(1.0), "b": 1.0}), TypeError,
                   r"^quantization_scales\['a'\]: expected dtype float32"),
    "scale_float64_array": (dict(quantization_scales={"a": 1.0, "b": np.ones((), np.float64)}),
                            TypeError, r"^quantization_scales\['b'\]: expected dtype float32"),
    "scale_shape_1": (dict(quantization_scales={"a": np.ones(1, np.float32), "b": 1.0}),
                      ValueError, r"^quantization_scales\['a'\]: expected a scalar"),
    "scale_vector": (dict(quantization_scales={"a": 1.0, "b": jnp.ones(16)}), ValueError,
                     r"^quantization_scales\['b'\]: expected a scalar"),
    "scale_string": (dict(quantization_scales={"a": "1", "b": 1.0}), TypeError,
                     r"^quantization_scales\['a'\]: expected a float32 scalar"),
    "scale_bool": (dict(quantization_scales={"a": True, "b": 1.0}), TypeError,
                   r"^quantization_scales\['a'\]: expected a float32 scalar"),
    "result_int8": (dict(preferred_element_type=np.int8), TypeError,
                    r"^preferred_element_type: with FP8 operands expected one of"),
    "result_float64": (dict(preferred_element_type=np.float64), TypeError,
                       r"^preferred_element_type: .*got float64"),
    "result_not_a_dtype": (dict(preferred_element_type="fast"), TypeError,
                           r"^preferred_element_type: expected a dtype"),
    "scales_without_fp8": (dict(a=np.ones((4, 16), np.float32), b=np.ones((16, 16), np.float32)),
                           TypeError, r"^quantization_scales: only for FP8 operands"),
    "amax_without_fp8": (dict(a=np.ones((4, 16), np.float32), b=np.ones((16, 16), np.float32),
                              quantization_scales=None, result_amax=True), TypeError,
                         r"^result_amax: only for FP8 operands"),
    "result_type_without_fp8": (dict(a=np.ones((4, 16), np.float32),
                                     b=np.ones((16, 16), np.float32), quantization_scales=None,
                                     preferred_element_type=jnp.bfloat16), TypeError,
                                r"^preferred_element_type: with float32 operands"),
    "amax_not_bool": (dict(result_amax="yes"), TypeError, r"^result_amax: expected a bool"),
    "bias_f32_for_fp8_result": (dict(epilog="bias", epilog_inputs={"bias": np.ones(16, np.float32)},
                                     quantization_scales={**S, "d": 1.0},
                                     preferred_element_type=E4M3), TypeError,
                                r"^epilog_inputs\['bias'\]: expected dtype bfloat16"),
    "bias_bf16_for_f32_result": (dict(epilog="bias",
                                      epilog_inputs={"bias": np.ones(16, ml_dtypes.bfloat16)},
                                      preferred_element_type=jnp.float32), TypeError,
                                 r"^epilog_inputs\['bias'\]: expected dtype float32"),
    "gelu_aux_fp8": (dict(epilog="dgelu",
                          epilog_inputs={"gelu_aux": np.ones((4, 16), ml_dtypes.float8_e4m3fn)},
                          quantization_scales={**S, "d": 1.0}, preferred_element_type=E4M3),
                     TypeError, r"^epilog_inputs\['gelu_aux'\]: expected dtype bfloat16"),
    "fp8_k_mismatch": (dict(b=np.ones((8, 16), ml_dtypes.float8_e4m3fn)), ValueError,
                       r"^b: contraction size K=8"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bad_inputs_name_the_argument(name, jit):
    changes, error, match = BAD[name]
    call = {"a": A8, "b": B8, "quantization_scales": S, **changes}
    a, b = call.pop("a"), call.pop("b")
    if jit:  # the checks run while tracing: nothing reaches a device
        fn = jax.jit(lambda a, b: jax_epilog.matmul(a, b, **call))
    else:
        fn = lambda a, b: jax_epilog.matmul(a, b, **call)  # noqa: E731
    with pytest.raises(error, match=match):
        fn(a, b)


# --- sharded ---------------------------------------------------------------------------------

_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_epilog
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-4, 5, (64, 64)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.integers(-4, 5, (256, 64)), jnp.float8_e4m3fn)  # (N, K): K-major
    bias = jnp.asarray(rng.integers(-4, 4, 256) / 2, jnp.bfloat16)
    def f(x, w, bias, s):
        return jax_epilog.matmul(x, w, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 transpose_b=True,
                                 quantization_scales={"a": s, "b": 0.5, "d": 0.25},
                                 preferred_element_type=jnp.float8_e4m3fn, result_amax=True)
    want = f(x, w, bias, jnp.float32(2.0))
    for xs, ws, bs in [(P("data", None), P(), P()), (P(), P("model", None), P("model")),
                       (P("data", "model"), P(None, "model"), P()),
                       (P("data", None), P("model", None), P("model"))]:
        shard = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        got = jax.jit(f)(shard(x, xs), shard(w, ws), shard(bias, bs), jnp.float32(2.0))
        np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                      np.asarray(want[0], np.float32))
        np.testing.assert_array_equal(got[1]["relu_aux"], want[1]["relu_aux"])
        assert float(got[1]["result_amax"]) == float(want[1]["result_amax"]), (xs, ws)
    print("ok")
""")


def test_sharded_on_4_host_cpu_devices():
    """Data, column (N) and row (K) parallel FP8 calls equal the unsharded one; the amax is
    the maximum over every shard."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (
               str(Path(jax_epilog.__file__).resolve().parents[1]),
               os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-3000:] + proc.stderr[-5000:]


def test_problem_helpers_cover_every_pair_and_result():
    assert {p for p in PAIRS} == {("float8_e4m3fn", "float8_e4m3fn"),
                                  ("float8_e5m2", "float8_e4m3fn"),
                                  ("float8_e4m3fn", "float8_e5m2")}
    assert fp8_reference.aux_dtype("float8_e5m2") == "bfloat16"


def test_the_library_takes_fp8_and_answers_without_a_gpu():
    """Where the CUDA library loads (an installed package), it says it takes FP8 operands and
    answers a support query for them: yes/no on a GPU, "cannot tell" (None) without one."""
    from jax_epilog.runtime import library as cuda_library
    if not cuda_library.available():
        pytest.skip(f"the CUDA library is not loaded: {cuda_library.unavailable_reason()}")
    assert cuda_library.supports_fp8()
    supported, message = cuda_library.query_support(
        int(Epilog.RELU_AUX_BIAS), "float8_e4m3fn", False, True, 1, 1, 1, 64, 64, 64, False,
        1 << 22, b_dtype="float8_e5m2", result_dtype="float8_e4m3fn", result_amax=True)
    assert supported in (None, True, False) and isinstance(message, str)
