"""Weights stored in FP8 for serving: `quantize_params`, `Fp8Weight` in `dense`/`mlp` and the
Flax modules, `calibrate`, orbax checkpoints, and the errors.

The model every served output is checked against is `served_model`: float64 NumPy that
quantizes the input the same way (its amax, e4m3, round to nearest), multiplies the
dequantized values exactly and applies bias and activation. On a CPU the layers' reference
lowering computes that formula in float32; on a CUDA GPU the FP8 GEMM (fast accumulation)
must agree within its accumulation's rounding (`test_served_gemm_runs_the_kernel_on_a_gpu`).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from conftest import HAS_CUDA
from jaxprs import traced_equations
from jax_epilog.float8 import weights
from jax_epilog.float8.weights import Fp8Weight, quantize_weight
from jax_epilog.layers import serving

E4M3 = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def random(key, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def to_e4m3(x):
    """-> e4m3 -> float64, saturating (cuBLASLt's and the reference's cast)."""
    return np.clip(x, -E4M3, E4M3).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def served_model(x, kernel: Fp8Weight, bias, activation, input_scale=None):
    """One stored-FP8 layer in float64: x quantized (current scaling from its amax, per token
    before a per-channel weight, or the static `input_scale`), times the stored weight, bias,
    activation."""
    # The quantization in float32, as the layers (and TransformerEngine) compute it: x times
    # q = 448 / amax, so that each value rounds to the same FP8 neighbour.
    x = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    if input_scale is None:
        per_token = np.ndim(kernel.scale) == 1
        amax = np.max(np.abs(x), axis=1, keepdims=True) if per_token else np.max(np.abs(x))
        q = np.where(amax > 0, np.float32(E4M3) / np.where(amax > 0, amax, 1), 1)
        q = q.astype(np.float32)
        x8, input_scale = to_e4m3(x * q), np.float32(1) / q
    else:
        x8 = to_e4m3(x / np.float32(input_scale))
    w = np.asarray(kernel.data.astype(jnp.float32), np.float64).T
    z = (x8 @ w) * np.float64(np.float32(input_scale)) * np.float64(kernel.scale)
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    return _activation(z, activation)


def weight_only_model(x, kernel: Fp8Weight, bias, activation):
    """A weight-only layer in float64: x as it is, times the dequantized stored weight."""
    x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    w = np.asarray(kernel.data.astype(jnp.float32), np.float64).T * np.float64(kernel.scale)
    return _activation(x @ w + (0 if bias is None else np.asarray(bias, np.float64)),
                       activation)


def _activation(z, activation):
    if activation == "relu":
        return np.maximum(z, 0)
    if activation == "gelu":
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    return z


@pytest.fixture(autouse=True)
def fp8_gemms(monkeypatch):
    """The layers' FP8-GEMM way unless a test asks for another (`serving_plan`)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")


def assert_served(y, want, dtype):
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64).reshape(want.shape)
    # bf16 output rounding, plus the GPU's fast accumulation (a few ulps of float32 sums).
    tolerance = (2 ** -7 if dtype == jnp.bfloat16 else 2 ** -20) * np.max(np.abs(want)) + 1e-6
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance * (8 if HAS_CUDA else 1))


# --- quantize_weight and quantize_params ----------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (520, 33)])
def test_quantize_weight_per_channel_scales_each_output_channel(shape):
    kernel = random(0, shape, scale=3.0) * random(1, shape[1:], scale=10.0)
    kernel = kernel.at[:, shape[1] // 2].set(0)  # an all-zero channel gets scale 1
    stored = quantize_weight(kernel, granularity="channel")
    k = np.asarray(kernel, np.float64)
    amax = np.max(np.abs(k), axis=0)
    scale = np.where(amax > 0, amax / E4M3, 1.0)
    assert stored.data.shape == shape[::-1] and stored.scale.shape == shape[1:]
    assert stored.data.dtype == jnp.float8_e4m3fn and stored.scale.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(stored.scale), scale, rtol=1e-6)
    # each column times its 1 / scale in float32, then e4m3: the exact FP8 rounding
    q = (np.float32(1) / np.asarray(stored.scale)).astype(np.float32)
    want = to_e4m3((k.astype(np.float32) * q).T)
    np.testing.assert_array_equal(np.asarray(stored.data.astype(jnp.float32)), want)


def test_quantize_params_per_channel_and_its_errors():
    quantized = jax_epilog.quantize_params(_linen_params(), granularity="channel")["params"]
    assert quantized["block"]["up"]["kernel"].scale.shape == (2048,)
    assert quantized["block"]["down"]["kernel"].scale.shape == (512,)
    with pytest.raises(ValueError, match=r"granularity: expected one of \('tensor', 'channel'\), "
                                         r"got 'row'"):
        jax_epilog.quantize_params(_linen_params(), granularity="row")


@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (520, 33)])
def test_quantize_weight_stores_the_transposed_kernel_with_its_per_tensor_scale(shape):
    kernel = random(0, shape, scale=3.0)
    stored = quantize_weight(kernel)
    k = np.asarray(kernel, np.float64)
    scale = np.max(np.abs(k)) / E4M3
    assert stored.shape == shape and stored.data.shape == shape[::-1]
    assert stored.data.dtype == jnp.float8_e4m3fn and stored.scale.dtype == jnp.float32
    np.testing.assert_allclose(float(stored.scale), scale, rtol=1e-6)
    # x / scale in float32, then e4m3: the data is the kernel's exact FP8 rounding.
    want = to_e4m3((k.astype(np.float32) * np.float32(1 / np.float32(scale))).T)
    np.testing.assert_array_equal(np.asarray(stored.data.astype(jnp.float32)), want)
    assert stored.input_scale is None


def _linen_params():
    return {"params": {
        "embed": {"embedding": random(1, (1024, 512))},
        "block": {"up": {"kernel": random(2, (512, 2048)), "bias": random(3, (2048,))},
                  "down": {"kernel": random(4, (2048, 512)), "bias": random(5, (512,))},
                  "norm": {"scale": random(6, (512,))}},
        "head": {"kernel": random(7, (512, 256))}}}


def test_quantize_params_stores_only_large_kernels_by_default():
    quantized = jax_epilog.quantize_params(_linen_params())["params"]
    assert isinstance(quantized["block"]["up"]["kernel"], Fp8Weight)
    assert isinstance(quantized["block"]["down"]["kernel"], Fp8Weight)
    for kept in (quantized["embed"]["embedding"], quantized["block"]["up"]["bias"],
                 quantized["block"]["norm"]["scale"], quantized["head"]["kernel"]):
        assert isinstance(kept, jax.Array) and kept.dtype == jnp.float32


def test_quantize_params_include_overrides_the_rule_and_sees_the_names():
    seen = []

    def only_down(path, leaf):
        seen.append(weights.key_names(path))
        return weights.key_names(path)[-2:] == ("down", "kernel")

    quantized = jax_epilog.quantize_params(_linen_params(), include=only_down)["params"]
    assert isinstance(quantized["block"]["down"]["kernel"], Fp8Weight)
    assert not isinstance(quantized["block"]["up"]["kernel"], Fp8Weight)
    assert ("params", "block", "down", "kernel") in seen
    with pytest.raises(TypeError, match="include"):
        jax_epilog.quantize_params(_linen_params(), include="kernel")


def test_quantize_params_names_a_non_finite_kernel():
    params = _linen_params()
    params["params"]["block"]["up"]["kernel"] = params["params"]["block"]["up"]["kernel"].at[
        3, 7].set(jnp.nan)
    with pytest.raises(ValueError, match="params/block/up/kernel: has non-finite"):
        jax_epilog.quantize_params(params)


def test_quantize_params_is_idempotent_and_refuses_fp8_kernels():
    once = jax_epilog.quantize_params(_linen_params())
    twice = jax_epilog.quantize_params(once)
    assert twice["params"]["block"]["up"]["kernel"] is once["params"]["block"]["up"]["kernel"]
    with pytest.raises(ValueError, match="kernel: expected a 16/32-bit float kernel"):
        quantize_weight(random(0, (16, 16)).astype(jnp.float8_e4m3fn))


# --- the served layers ------------------------------------------------------------------

@pytest.mark.parametrize("rows,way", [(1, "weight_only"), (17, "weight_only"),
                                      (64, "weight_only"), (65, "fp8")])
def test_served_layers_choose_their_way_by_the_rows(rows, way, monkeypatch):
    """Up to 64 rows weight-only, then our FP8 GEMM (the Pallas kernel and XLA's FP8 dot only
    where asked for, `serving_plan`): each way's values, and the call holding that way's
    GEMM."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")
    kernel = quantize_weight(random(1, (136, 72), scale=0.2))
    bias = random(2, (72,), jnp.float32)
    x = random(3, (rows, 136), jnp.float32)
    f = lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu")
    y = jax.jit(f)(x, kernel, bias)
    model = weight_only_model if way == "weight_only" else served_model
    assert_served(y, model(np.asarray(x), kernel, np.asarray(bias), "gelu"), jnp.float32)
    dots = [e for e in traced_equations(f, x, kernel, bias) if e.primitive.name == "dot_general"]
    fp8_dots = [e for e in dots if all(v.aval.dtype == jnp.float8_e4m3fn for v in e.invars)]
    assert (len(dots), len(fp8_dots)) == {"weight_only": (1, 0), "xla_fp8": (1, 1),
                                          "fp8": (0, 0)}[way]


@pytest.mark.parametrize("rows", [1, 127, 129, 300])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("way", ["fp8", "fp8_pallas", "xla_fp8", "weight_only"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_dense_with_a_stored_weight_is_its_way_s_formula(granularity, way, rows, activation,
                                                          dtype, monkeypatch):
    """`fp8` and `xla_fp8`: the FP8 GEMM of the quantized input; `weight_only`: x times the
    dequantized weight; per-tensor or per-channel weight scales (the columns' sizes spread
    over 2**8)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    columns = 2.0 ** jax.random.uniform(jax.random.key(5), (72,), minval=-8, maxval=0)
    kernel = quantize_weight(random(1, (136, 72), scale=0.2) * columns,
                             granularity=granularity)
    bias = random(2, (72,), dtype)
    x = random(3, (rows, 136), dtype)
    y = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation=activation))(
        x, kernel, bias)
    assert y.shape == (rows, 72) and y.dtype == dtype
    model = weight_only_model if way == "weight_only" else served_model
    assert_served(y, model(np.asarray(x.astype(jnp.float32)), kernel,
                           np.asarray(bias.astype(jnp.float32)), activation), dtype)


@pytest.mark.parametrize("way", ["xla_fp8", "fp8_pallas"])
@pytest.mark.parametrize("rows", [5, 64])
def test_float16_xla_fp8_products_do_not_overflow(rows, way, monkeypatch):
    """The XLA FP8 dot's unscaled product (448² per term) overflows float16: it is taken in
    float32 before the scales (it was rounded to float16 first, and came out inf)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    kernel = quantize_weight(random(1, (256, 96), scale=0.05))
    bias = random(2, (96,), jnp.float16)
    x = random(3, (rows, 256), jnp.float16, scale=10.0)
    y = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu"))(x, kernel, bias)
    assert y.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(y)))
    want = served_model(np.asarray(x.astype(jnp.float32)), kernel,
                        np.asarray(bias.astype(jnp.float32)), "gelu")
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0,
                               atol=2 ** -9 * np.max(np.abs(want)))


@pytest.mark.parametrize("way", ["fp8", "xla_fp8"])
def test_per_token_input_scales_keep_ordinary_tokens_beside_an_outlier(way, monkeypatch):
    """Before a per-channel weight the input is quantized per token: a token 10⁵ times the
    others leaves their precision alone, where one scale for the input flushes them toward
    e4m3's subnormals."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    x = random(3, (96, 128)).at[5].multiply(1e5)
    kernel = random(1, (128, 64), scale=0.1)
    exact = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    errors = {}
    for granularity in ("tensor", "channel"):
        y = jax_epilog.dense(x, quantize_weight(kernel, granularity=granularity))
        ordinary = np.delete(np.asarray(y, np.float64) - exact, 5, axis=0)
        errors[granularity] = np.linalg.norm(ordinary) / np.linalg.norm(np.delete(exact, 5, 0))
    assert errors["channel"] < 0.05 and errors["tensor"] > 4 * errors["channel"], errors


def test_serving_setting_is_checked(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", "int4")
    with pytest.raises(ValueError, match="JAX_EPILOG_SERVING='int4': expected one of auto"):
        jax_epilog.dense(random(0, (4, 32)), quantize_weight(random(1, (32, 16))))


def test_mlp_mixes_stored_and_16_bit_layers_and_keeps_leading_dims():
    x = random(0, (2, 3, 64), jnp.bfloat16)
    k1, b1 = random(1, (64, 96), scale=0.1), random(2, (96,))
    k2, b2 = random(3, (96, 40), scale=0.1), random(4, (40,))
    stored = quantize_weight(k1)
    y = jax_epilog.mlp(x, [(stored, b1), (k2, b2)], activation="relu")
    assert y.shape == (2, 3, 40) and y.dtype == jnp.float32  # the float32 parameters promote
    h = served_model(np.asarray(x.astype(jnp.float32)), stored, np.asarray(b1), "relu")
    want = h.astype(np.float32) @ np.asarray(k2) + np.asarray(b2)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 40), want, rtol=2e-5, atol=2e-5)


def test_served_layers_refuse_gradients_with_a_clear_error():
    stored = quantize_weight(random(1, (32, 16)))
    x = random(0, (4, 32))
    with pytest.raises(TypeError, match="run inference only: differentiate the 16-bit"):
        jax.grad(lambda x: jax_epilog.dense(x, stored).sum())(x)


def test_bad_stored_weights_are_named():
    stored = quantize_weight(random(1, (32, 16)))
    x = random(0, (4, 32))
    with pytest.raises(ValueError, match=r"layers\[0\] kernel: expected shape \(24, N\)"):
        jax_epilog.dense(random(0, (4, 24)), stored)
    with pytest.raises(ValueError, match=r"layers\[0\] kernel.scale: expected a finite positive"):
        jax_epilog.dense(x, Fp8Weight(stored.data, jnp.float32(jnp.inf)))
    with pytest.raises(ValueError, match=r"layers\[0\] kernel.input_scale: expected a float32"):
        jax_epilog.dense(x, Fp8Weight(stored.data, stored.scale, jnp.ones((2,), jnp.float32)))
    with pytest.raises(ValueError, match=r"layers\[0\] kernel: an Fp8Weight holds FP8 data"):
        jax_epilog.dense(x, Fp8Weight(stored.data.astype(jnp.bfloat16), stored.scale))
    # per-channel scales: one per output channel, each finite and positive
    with pytest.raises(ValueError, match=r"layers\[0\] kernel.scale: expected a float32 "
                                         r"scalar or float32 of shape \(16,\)"):
        jax_epilog.dense(x, Fp8Weight(stored.data, jnp.ones((15,), jnp.float32)))
    with pytest.raises(ValueError, match=r"layers\[0\] kernel.scale: expected a finite "
                                         r"positive scale, got -1.0"):
        jax_epilog.dense(x, Fp8Weight(stored.data, jnp.ones((16,), jnp.float32).at[3].set(-1)))


# --- Flax modules -----------------------------------------------------------------------

def test_nnx_mlp_serves_its_quantized_state_under_nnx_jit():
    nnx = pytest.importorskip("flax.nnx")
    import jax_epilog.nnx
    model = jax_epilog.nnx.MLP(512, [1024, 512], activation="gelu", dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(0))
    x = random(0, (3, 5, 512), jnp.bfloat16)
    unquantized = model(x)
    nnx.update(model, jax_epilog.quantize_params(nnx.state(model, nnx.Param)))
    kernels = [layer.kernel.get_value() for layer in model.layers]
    assert all(isinstance(k, Fp8Weight) for k in kernels)
    y = nnx.jit(lambda m, x: m(x))(model, x)
    h = served_model(np.asarray(x.astype(jnp.float32)), kernels[0],
                     np.asarray(model.layers[0].bias[...]), "gelu")
    h = np.asarray(jnp.asarray(h, jnp.bfloat16).astype(jnp.float32), np.float64)
    want = served_model(h, kernels[1], np.asarray(model.layers[1].bias[...]), None)
    assert_served(y, want, jnp.bfloat16)
    # FP8 rounding only, against the 16-bit model.
    error = float(jnp.max(jnp.abs(y.astype(jnp.float32) - unquantized.astype(jnp.float32))))
    assert error < 0.1 * float(jnp.max(jnp.abs(unquantized.astype(jnp.float32))))


def test_linen_dense_serves_quantized_variables_and_names_bad_input():
    pytest.importorskip("flax.linen")
    import jax_epilog.linen
    layer = jax_epilog.linen.Dense(768, activation="relu", dtype=jnp.bfloat16)
    x = random(0, (7, 640), jnp.bfloat16)
    variables = layer.init(jax.random.key(1), x)
    quantized = jax_epilog.quantize_params(variables)
    stored = quantized["params"]["kernel"]
    y = jax.jit(layer.apply)(quantized, x)
    want = served_model(np.asarray(x.astype(jnp.float32)), stored,
                        np.asarray(variables["params"]["bias"]), "relu")
    assert_served(y, want, jnp.bfloat16)
    with pytest.raises(ValueError, match="x has 512 features; this Dense was initialised "
                                         "with in_features=640"):
        layer.apply(quantized, random(0, (7, 512), jnp.bfloat16))


# --- calibrate ---------------------------------------------------------------------------

def test_calibrate_sets_static_scales_that_reproduce_the_calibration_batch():
    params = [(quantize_weight(random(1, (64, 48), scale=0.1)), random(2, (48,))),
              (quantize_weight(random(3, (48, 32), scale=0.1)), None)]
    apply = lambda p, x: jax_epilog.mlp(x, p, activation="relu")
    batch = random(4, (16, 64), scale=5.0)
    calibrated = jax_epilog.calibrate(apply, params, [batch])
    first = calibrated[0][0].input_scale
    np.testing.assert_allclose(float(first), float(jnp.max(jnp.abs(batch))) / E4M3, rtol=1e-6)
    assert calibrated[1][0].input_scale is not None
    # The largest input seen sets the scale, so the same batch gives current scaling's result.
    np.testing.assert_array_equal(np.asarray(jax.jit(apply)(calibrated, batch)),
                                  np.asarray(jax.jit(apply)(params, batch)))
    smaller = batch * 0.5
    want = served_model(np.asarray(smaller), calibrated[0][0], np.asarray(params[0][1]), "relu",
                        input_scale=float(first))
    y = jax_epilog.dense(smaller, calibrated[0][0], params[0][1], activation="relu")
    assert_served(y, want, jnp.float32)


@pytest.mark.parametrize("rows", [1, 129])
def test_a_gemm_writes_the_next_layers_fp8_input_with_its_static_scale(rows, monkeypatch):
    """bf16 layers: the first FP8 GEMM's result is the second's e4m3 input, multiplied by
    1 / its static scale and saturated, with no 16-bit copy in between."""
    check_fp8_chain(rows, (64, 48, 32), monkeypatch)


@pytest.mark.parametrize("rows", [1, 129])
def test_a_per_channel_gemm_writes_a_16_bit_result_for_the_next_layer(rows, monkeypatch):
    """GEMMs with row scales give 16/32-bit results only: after a per-channel layer the
    next layer quantizes a bf16 input with its static scale."""
    check_fp8_chain(rows, (64, 48, 32), monkeypatch, granularity="channel")


def check_fp8_chain(rows, widths, monkeypatch, granularity="tensor"):
    """Two calibrated bf16 layers of `widths` (K, hidden, N) against the float64 model of
    the chain (the first's weight per-tensor: its GEMM writes the second's e4m3 input; per
    channel: a bf16 result); returns the jitted stack and its arguments."""
    k, hidden, n = widths
    params = [(quantize_weight(random(1, (k, hidden), scale=0.1), granularity=granularity),
               random(2, (hidden,), jnp.bfloat16)),
              (quantize_weight(random(3, (hidden, n), scale=0.1)), None)]
    apply = lambda p, x: jax_epilog.mlp(x, p, activation="gelu")
    batch = random(4, (rows, k), jnp.bfloat16, scale=5.0)
    calibrated = jax_epilog.calibrate(apply, params, [batch * 0.5])  # the first saturates
    first, second = calibrated[0][0], calibrated[1][0]
    h = served_model(batch.astype(jnp.float32), first, np.asarray(params[0][1], np.float32),
                     "gelu", input_scale=first.input_scale).astype(np.float32)
    written = "float8_e4m3fn" if granularity == "tensor" else "bfloat16"
    if written == "bfloat16":  # the second layer quantizes the first's rounded result
        h = np.asarray(jnp.asarray(h).astype(jnp.bfloat16).astype(jnp.float32))
        h8 = to_e4m3(h / np.float32(second.input_scale))
    else:
        h8 = to_e4m3(h * (np.float32(1) / np.float32(second.input_scale)))
    want = (h8 @ np.asarray(second.data.astype(jnp.float32), np.float64).T) * \
        np.float64(np.float32(second.input_scale)) * np.float64(second.scale)
    results = []
    original = serving.matmul
    monkeypatch.setattr(serving, "matmul", lambda *args, **kwargs: results.append(
        jnp.dtype(kwargs["preferred_element_type"]).name) or original(*args, **kwargs))
    y = jax.jit(apply)(calibrated, batch)
    assert results == [written, "bfloat16"]
    assert y.dtype == jnp.bfloat16
    assert_served(y, want, jnp.bfloat16)
    return jax.jit(apply), (calibrated, batch)


def test_calibrate_refuses_jit_no_batches_and_unquantized_params():
    params = [(quantize_weight(random(1, (64, 48))), None)]
    apply = lambda p, x: jax_epilog.mlp(x, p)
    batch = random(4, (16, 64))
    with pytest.raises(TypeError, match="calibrate: apply_fn ran under a JAX transform"):
        jax_epilog.calibrate(jax.jit(apply), params, [batch])
    with pytest.raises(ValueError, match="batches: expected at least one batch"):
        jax_epilog.calibrate(apply, params, [])
    with pytest.raises(ValueError, match="params: no layer with a stored FP8 weight ran"):
        jax_epilog.calibrate(apply, [(random(1, (64, 48)), None)], [batch])


# --- checkpoints --------------------------------------------------------------------------

@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_orbax_saves_half_the_bytes_and_restores_exactly(tmp_path, granularity):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"up": {"kernel": random(1, (1024, 1024), jnp.bfloat16)},
              "norm": {"scale": random(2, (1024,), jnp.bfloat16)}}
    quantized = jax_epilog.calibrate(
        lambda p, x: jax_epilog.dense(x, p["up"]["kernel"]),
        jax_epilog.quantize_params(params, granularity=granularity), [random(3, (4, 1024))])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "fp8", quantized)
    checkpointer.save(tmp_path / "bf16", params)
    checkpointer.wait_until_finished()
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    assert size(tmp_path / "fp8") < 0.55 * size(tmp_path / "bf16")
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, quantized)
    restored = checkpointer.restore(tmp_path / "fp8", target)
    for got, want in zip(jax.tree_util.tree_leaves(restored),
                         jax.tree_util.tree_leaves(quantized)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))
    # A quantized checkpoint restored into the 16-bit model's tree is refused, not cast.
    with pytest.raises(ValueError, match="tree structures do not match"):
        checkpointer.restore(tmp_path / "fp8",
                             jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, params))


# --- the GPU kernel -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 127, 256, 2048])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
def test_served_gemm_runs_the_kernel_on_a_gpu(dtype, granularity, rows, monkeypatch):
    """bfloat16: the GELU_BIAS kernel; float32 (no FP8 kernel with a bias epilog): the plain
    FP8 GEMM, then bias and GELU in XLA; never the reference."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)  # the FP8 call's own choice
    kernel = quantize_weight(random(1, (1024, 1536), scale=0.05), granularity=granularity)
    bias = random(2, (1536,), dtype)
    x = random(3, (rows, 1024), dtype)
    fn = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu"))
    hlo = fn.lower(x, kernel, bias).compile().as_text()
    assert hlo.count('custom_call_target="jax_epilog_matmul') == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        y = fn(x, kernel, bias)
    want = served_model(np.asarray(x.astype(jnp.float32)), kernel,
                        np.asarray(bias.astype(jnp.float32)), "gelu")
    # bfloat16's tolerance for both: fast accumulation's sums (docs/fp8.md) err far above
    # float32's rounding (2.4e-3 of the largest value here on the H200)
    assert_served(y, want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [127, 2048])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_chain_runs_the_kernel_on_a_gpu(granularity, rows, monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        fn, args = check_fp8_chain(rows, (1024, 1536, 512), monkeypatch, granularity)
    assert fn.lower(*args).compile().as_text().count(
        'custom_call_target="jax_epilog_matmul') == 2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_weight_only_runs_xla_on_a_gpu(rows, monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")
    kernel = quantize_weight(random(1, (1024, 1536), scale=0.05))
    bias = random(2, (1536,), jnp.bfloat16)
    x = random(3, (rows, 1024), jnp.bfloat16)
    fn = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu"))
    assert 'custom_call_target="jax_epilog_matmul' not in fn.lower(x, kernel, bias).compile(
        ).as_text()
    assert_served(fn(x, kernel, bias), weight_only_model(
        np.asarray(x.astype(jnp.float32)), kernel, np.asarray(bias.astype(jnp.float32)),
        "gelu"), jnp.bfloat16)
