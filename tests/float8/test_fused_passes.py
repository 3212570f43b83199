"""The fused FP8 passes on the CPU (`float8.fused`, `layers.fused_swiglu`): their references are
the layers' own quantization, bit for bit; bad arguments name themselves; the engine setting;
and, with the CUDA engine forced, the custom calls a CUDA lowering emits and the layers' results
(on the CPU the calls lower to the references). The kernels themselves:
test_fused_passes_gpu.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import config
from jax_epilog.float8 import fused
from jax_epilog.float8.scaling import quantize_scaled, uncalibrated
from jax_epilog.layers import fused_swiglu, gating
from jax_epilog.runtime import targets

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _random(shape, dtype, seed=0, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


@pytest.fixture
def cuda_engine(monkeypatch):
    """The CUDA engine as if the kernels could run (on the CPU the calls lower to the
    references: `jax.lax.platform_dependent`)."""
    monkeypatch.setattr(fused, "uses_cuda", lambda: True)


@pytest.mark.parametrize("shape,dtype,fmt", [((1, 1), jnp.bfloat16, E4M3),
                                             ((127, 129), jnp.float16, E5M2),
                                             ((129, 40), jnp.bfloat16, E5M2)])
def test_quantize_transpose_is_the_layers_quantization_and_its_transpose(shape, dtype, fmt):
    x = _random(shape, dtype, scale=30.0)
    x8, x8t, scale, x_amax = jax.jit(lambda x: fused.quantize_transpose(x, fmt, 1))(x)
    want8, want_scale, want_amax = jax.jit(lambda x: quantize_scaled(x, fmt, 1))(x)
    assert x8.dtype == fmt and x8.shape == shape and x8t.shape == shape[::-1]
    np.testing.assert_array_equal(_bits(x8), _bits(want8))
    np.testing.assert_array_equal(_bits(x8t), _bits(want8).T)
    assert float(scale) == float(want_scale) and float(x_amax) == float(want_amax)


def test_quantize_transpose_on_delayed_scaling_records_its_own_amax():
    x = _random((33, 48), jnp.bfloat16, seed=1, scale=4.0)
    history = jnp.array([8.0, 2.0, 0.0], jnp.float32)
    for calibrating in (True, False):
        def both(x, history):
            return fused.quantize_transpose(x, E4M3, 0, history), \
                quantize_scaled(x, E4M3, 0, history)

        if calibrating:
            (x8, x8t, scale, x_amax), want = jax.jit(both)(x, history)
        else:
            with uncalibrated():
                (x8, x8t, scale, x_amax), want = jax.jit(both)(x, history)
        np.testing.assert_array_equal(_bits(x8), _bits(want[0]))
        np.testing.assert_array_equal(_bits(x8t), _bits(want[0]).T)
        assert float(scale) == float(want[1]) == float(1 / np.float32(448.0 / 8.0))  # history's
        assert float(x_amax) == float(want[2]) == float(jnp.max(jnp.abs(x)))


def test_cast_transpose_saturates_and_keeps_signs():
    x = jnp.array([[1.0, -1.0, 500.0], [-600.0, 0.25, -0.0]], jnp.bfloat16)
    y, yt, x_amax = fused.cast_transpose(x, jnp.float32(1.0), E4M3)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  [[1.0, -1.0, 448.0], [-448.0, 0.25, -0.0]])
    np.testing.assert_array_equal(_bits(yt), _bits(y).T)
    assert float(x_amax) == 600.0


def test_swiglu_forward_is_the_blocks_quantization():
    gu = _random((37, 2 * 24), jnp.bfloat16, seed=2, scale=3.0)
    hidden = 24

    def block(gu):  # what swiglu._fp8_forward computes with XLA's fusions
        h = gating.hidden(gu, hidden)
        g, u = gu[:, :hidden], gu[:, hidden:]
        return [quantize_scaled(a, E4M3, 0) for a in (h, g, u)]

    got = jax.jit(lambda gu: fused_swiglu.swiglu_forward(gu, E4M3))(gu)
    (h8, hs, ha), (g8, gs, _), (u8, us, _) = jax.jit(block)(gu)
    for a, b in ((got[0], h8), (got[3], g8), (got[5], u8)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert [float(v) for v in (got[1], got[2], got[4], got[6])] == \
        [float(v) for v in (hs, ha, gs, us)]
    h8_only = fused_swiglu.swiglu_forward(gu, E4M3, keep=False)
    np.testing.assert_array_equal(_bits(h8_only[0]), _bits(h8))
    assert h8_only[3] is None and h8_only[4] is None


def test_swiglu_gradient_is_the_quantized_gradient_and_its_transpose():
    dh = _random((45, 24), jnp.float16, seed=3)
    g8 = _random((45, 24), jnp.float32, seed=4, scale=50.0).astype(E4M3)
    u8 = _random((45, 24), jnp.float32, seed=5, scale=50.0).astype(E4M3)
    g_scale, u_scale = jnp.float32(0.05), jnp.float32(0.03)
    dgu8, dgu8t, scale, dgu_amax = fused_swiglu.swiglu_gradient(dh, g8, g_scale, u8, u_scale,
                                                                E5M2)
    dgu = gating.hidden_gradient(dh, g8.astype(jnp.float32) * g_scale,
                                 u8.astype(jnp.float32) * u_scale, jnp.float16)
    want8, want_scale, want_amax = quantize_scaled(dgu, E5M2, 0)
    assert dgu8.shape == (45, 48) and dgu8t.shape == (48, 45) and dgu8.dtype == E5M2
    np.testing.assert_array_equal(_bits(dgu8), _bits(want8))
    np.testing.assert_array_equal(_bits(dgu8t), _bits(want8).T)
    assert float(scale) == float(want_scale) and float(dgu_amax) == float(want_amax) > 0


def test_bad_arguments_name_themselves():
    x = jnp.ones((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="^x: expected a 2-D array"):
        fused.cast_transpose(jnp.ones((8,), jnp.bfloat16), 1.0)
    with pytest.raises(TypeError, match="^x: expected a floating-point dtype, got int32"):
        fused.cast_transpose(jnp.ones((4, 8), jnp.int32), 1.0)
    with pytest.raises(ValueError, match=r"^q: expected a float32 array of shape \(\)"):
        fused.cast_transpose(x, jnp.ones((2,)))
    with pytest.raises(ValueError, match="^dtype: expected an FP8 format"):
        fused.cast_transpose(x, 1.0, "int8")
    with pytest.raises(ValueError, match=r"^gu: expected \[g u\]"):
        fused_swiglu.swiglu_amaxes(jnp.ones((4, 7), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^q: expected a float32 array of shape \(3,\)"):
        fused_swiglu.swiglu_quantize(x, 1.0)
    g8 = jnp.ones((4, 4), E4M3)
    with pytest.raises(ValueError, match="^g8.dtype: expected an FP8 format"):
        fused_swiglu.swiglu_grad_amax(x[:, :4], jnp.ones((4, 4)), g8, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^u8: expected dh's shape \(4, 4\)"):
        fused_swiglu.swiglu_grad_amax(x[:, :4], g8, jnp.ones((4, 5), E4M3), 1.0, 1.0)


def test_the_engine_setting(monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_FUSED_PASSES", raising=False)
    assert config.fused_passes() == "xla" and not fused.uses_cuda()
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "AUTO")
    assert config.fused_passes() == "auto"
    assert fused.uses_cuda() == (fused.unavailable_reason() is None and
                                 jax.device_count() == 1)
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "triton")
    with pytest.raises(ValueError, match="^JAX_EPILOG_FUSED_PASSES='triton': expected one of"):
        fused.uses_cuda()
    config.set_fused_passes("xla")
    assert config.fused_passes() == "xla"
    with pytest.raises(ValueError, match="^engine: expected one of xla, cuda, auto, got 'XLA'"):
        config.set_fused_passes("XLA")
    if jax.default_backend() != "gpu":
        monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "cuda")
        with pytest.raises(RuntimeError, match="^JAX_EPILOG_FUSED_PASSES=cuda: the fused kernels "
                                               "cannot run: the default JAX backend is"):
            fused.uses_cuda()


def test_a_cuda_lowering_calls_each_kernel_with_its_operands_and_results(cuda_engine):
    """Exported for CUDA (no GPU needed): the five custom calls, typed as the handlers check
    them (ffi/fused_passes.cc)."""
    def passes(x, gu, dh):
        x8, x8t, _, _ = fused.quantize_transpose(x, E5M2)
        h8, _, _, g8, gs, u8, us = fused_swiglu.swiglu_forward(gu, E4M3)
        dgu8, dgu8t, _, _ = fused_swiglu.swiglu_gradient(dh, g8, gs, u8, us, E5M2)
        return x8, x8t, h8, dgu8, dgu8t

    args = (jnp.ones((24, 40), jnp.bfloat16), jnp.ones((24, 64), jnp.float16),
            jnp.ones((24, 32), jnp.float16))
    module = jax.export.export(jax.jit(passes), platforms=["cuda"],
                               disabled_checks=targets.EXPORT_SAFETY_CHECKS)(*args).mlir_module()
    calls = dict(re.findall(r"custom_call @(jax_epilog_\w+)\(.*?\} : \((.*?) loc\(", module))
    assert calls == {
        "jax_epilog_cast_transpose": "tensor<24x40xbf16>, tensor<f32>) -> (tensor<24x40xf8E5M2>, "
                                     "tensor<40x24xf8E5M2>, tensor<f32>)",
        "jax_epilog_swiglu_amaxes": "tensor<24x64xf16>) -> tensor<3xf32>",
        "jax_epilog_swiglu_quantize": "tensor<24x64xf16>, tensor<3xf32>) -> (tensor<24x32xf8E4M3FN>"
                                      ", tensor<24x32xf8E4M3FN>, tensor<24x32xf8E4M3FN>)",
        "jax_epilog_swiglu_grad_amax": "tensor<24x32xf16>, tensor<24x32xf8E4M3FN>, "
                                       "tensor<24x32xf8E4M3FN>, tensor<3xf32>) -> tensor<f32>",
        "jax_epilog_swiglu_grad_quantize": "tensor<24x32xf16>, tensor<24x32xf8E4M3FN>, "
                                           "tensor<24x32xf8E4M3FN>, tensor<3xf32>) -> "
                                           "(tensor<24x64xf8E5M2>, tensor<64x24xf8E5M2>)"}


def _step(fn):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))


@pytest.mark.slow  # two compiles of a training step
def test_the_fp8_swiglu_block_on_the_cuda_engine(monkeypatch):
    """Forward and d(down) as with XLA's fusions, bit for bit; dx and d(gate_up) differ only by
    the scale of [dg du] (its exact amax here, XLA's way a bound equal to it up to rounding)."""
    k = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(k[0], (48, 32), jnp.bfloat16)
    gate_up = jax.random.normal(k[1], (32, 80), jnp.bfloat16) * 0.2
    down = jax.random.normal(k[2], (40, 24), jnp.bfloat16) * 0.2
    fp8 = jax_epilog.Fp8(layers="all")

    def loss(x, gate_up, down):
        y = jax_epilog.swiglu(x, gate_up, down, fp8=fp8)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    # delayed scaling, h's history warm (its scale from the history) and x's cold
    delayed = jax_epilog.Fp8(layers="all", scaling="delayed")
    state = delayed.init_state(2)
    state = (state[0], state[1]._replace(input=state[1].input.at[0].set(3.0)))

    def delayed_loss(x, gate_up, down):
        y = jax_epilog.swiglu(x, gate_up, down, fp8=delayed, fp8_state=state)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    want = _step(loss)(x, gate_up, down), _step(delayed_loss)(x, gate_up, down)
    monkeypatch.setattr(fused, "uses_cuda", lambda: True)
    got = _step(loss)(x, gate_up, down), _step(delayed_loss)(x, gate_up, down)
    for got, want in zip(got, want):
        assert float(got[0]) == float(want[0])
        np.testing.assert_array_equal(np.asarray(got[1][2]), np.asarray(want[1][2]))
        for g, w in zip(got[1][:2], want[1][:2]):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            assert np.max(np.abs(g - w)) <= 0.05 * np.max(np.abs(w))


@pytest.mark.slow  # two compiles of a training step
def test_the_fp8_stack_on_the_cuda_engine_is_unchanged(monkeypatch):
    """The stack's gradients quantized with their transposed copy in one pass: the same
    numbers as XLA's way."""
    k = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k[0], (40, 32), jnp.bfloat16)
    layers = [(jax.random.normal(k[1], (32, 48), jnp.bfloat16) * 0.2, jnp.zeros((48,),
                                                                                 jnp.bfloat16)),
              (jax.random.normal(k[2], (48, 16), jnp.bfloat16) * 0.2, None)]
    fp8 = jax_epilog.Fp8(layers="all")

    def loss(x, w0, w1):
        y = jax_epilog.mlp(x, [(w0, layers[0][1]), (w1, None)], fp8=fp8)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = (x, layers[0][0], layers[1][0])
    want = _step(loss)(*args)
    monkeypatch.setattr(fused, "uses_cuda", lambda: True)
    got = _step(loss)(*args)
    assert float(got[0]) == float(want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
