"""The served weight-only GEMM's Pallas kernel (`float8.weight_only_kernel`): on the CPU with
Pallas' interpreter, on a CUDA GPU (`gpu`) compiled by Triton, against `weight_only_model`
(float64: x times the dequantized stored weight, bias, activation) and against the XLA
formulation every other platform runs (`serving._weight_only_xla`: the same float32 sums in
another order, so within a rounding of the 16-bit result)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog.float8 import weight_only_kernel
from jax_epilog.float8.few_rows_fp8_kernel import few_rows_fp8_gemm
from jax_epilog.float8.weight_only_kernel import Tiling, default_tiling, fits, weight_only_gemm
from jax_epilog.float8.weights import quantize_weight
from jax_epilog.layers import serving
from test_serving import assert_served, random, weight_only_model

SMALL = Tiling(block_n=16, block_k=32, num_warps=4, num_stages=2)


def layer(k, n, granularity="tensor", bias=True, dtype=jnp.bfloat16, key=1):
    """(stored weight, bias or None): the output channels' sizes spread over 2**6."""
    columns = 2.0 ** jax.random.uniform(jax.random.key(key + 50), (n,), minval=-6, maxval=0)
    stored = quantize_weight(random(key, (k, n), scale=k ** -0.5) * columns,
                             granularity=granularity)
    return stored, (random(key + 1, (n,), dtype, scale=0.1) if bias else None)


def check(y, x, stored, bias, activation, dtype):
    """y against the float64 model, and within one rounding of the XLA formulation's."""
    assert y.shape == (x.shape[0], stored.data.shape[0]) and y.dtype == dtype
    f32 = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    assert_served(y, weight_only_model(f32(x), stored, f32(bias), activation), jnp.bfloat16)
    xla = serving._weight_only_xla(x, stored.data, stored.scale, bias, activation)
    np.testing.assert_allclose(f32(y), f32(xla), rtol=2 ** -7, atol=2 ** -7 * np.max(
        np.abs(f32(xla))))


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 64])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_kernel_is_the_weight_only_formula_at_every_row_count(rows, activation):
    """Rows not a power of two repeat x's last row in the program (no padded copy)."""
    stored, bias = layer(96, 48)
    x = random(3, (rows, 96), jnp.bfloat16)
    y = weight_only_gemm(x, stored.data, stored.scale, bias, activation=activation,
                         tiling=SMALL, interpret=True)
    check(y, x, stored, bias, activation, jnp.bfloat16)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("k,n", [(16, 16), (48, 112), (1008, 144)])
def test_kernel_scales_biases_and_shapes(k, n, dtype, bias, granularity):
    """One scale or one per output channel, with and without a bias, K and N multiples of 16
    that are not powers of two, float16 as well as bfloat16."""
    stored, b = layer(k, n, granularity, bias, dtype)
    x = random(4, (5, k), dtype)
    y = weight_only_gemm(x, stored.data, stored.scale, b, activation="gelu",
                         tiling=SMALL._replace(block_k=16), interpret=True)
    check(y, x, stored, b, "gelu", dtype)


def test_the_default_tiling_divides_the_shape_and_keeps_the_sms_busy():
    for k, n in [(4096, 14336), (14336, 4096), (4096, 4096), (8192, 8192), (48, 112),
                 (1008, 144)]:
        t = default_tiling(k, n)
        assert n % t.block_n == 0 and k % t.block_k == 0
        assert t.block_n >= weight_only_kernel.MIN_BLOCK and t.block_k >= weight_only_kernel.MIN_BLOCK
        assert (n // t.block_n >= weight_only_kernel.MIN_PROGRAMS
                or t.block_n == weight_only_kernel.MIN_BLOCK)
    stored, bias = layer(48, 112)
    y = weight_only_gemm(random(3, (2, 48), jnp.bfloat16), stored.data, stored.scale, bias,
                         interpret=True)  # the default tiling, in the interpreter
    check(y, random(3, (2, 48), jnp.bfloat16), stored, bias, None, jnp.bfloat16)


def test_a_tiling_that_does_not_divide_the_shape_is_refused():
    stored, _ = layer(48, 112)
    with pytest.raises(ValueError, match=r"^tiling: .* does not divide K 48 and N 112"):
        weight_only_gemm(random(3, (2, 48), jnp.bfloat16), stored.data, stored.scale,
                         tiling=Tiling(32, 32, 4, 2), interpret=True)


@pytest.mark.parametrize("rows,k,n,dtype,fit", [
    (1, 64, 64, jnp.bfloat16, True), (64, 64, 64, jnp.float16, True),
    (65, 64, 64, jnp.bfloat16, False), (0, 64, 64, jnp.bfloat16, False),
    (4, 72, 64, jnp.bfloat16, False), (4, 64, 40, jnp.bfloat16, False),
    (4, 64, 64, jnp.float32, False)])
def test_fits_says_where_the_kernel_runs(rows, k, n, dtype, fit):
    """At most 64 rows, a 16-bit input (float32's product would change precision), K and N
    multiples of 16; elsewhere `weight_only` runs the XLA formulation."""
    assert fits(rows, k, n, dtype) == fit


def test_weight_only_off_cuda_is_the_xla_formulation():
    """Only CUDA runs the kernel: elsewhere the lowered program has no Pallas call."""
    stored, bias = layer(64, 64)
    x = random(3, (4, 64), jnp.bfloat16)
    fn = jax.jit(lambda x, w, b: serving.weight_only(x, w, b, "gelu"))
    cpu = jax.devices("cpu")[0]
    x, stored, bias = jax.device_put((x, stored, bias), cpu)
    text = fn.lower(x, stored, bias).as_text()
    assert "weight_only_gemm" not in text and "triton" not in text
    check(fn(x, stored, bias), x, stored, bias, "gelu", jnp.bfloat16)


# --- on a CUDA GPU ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("k,n,granularity", [(1024, 1536, "tensor"), (4096, 1024, "channel")])
def test_gpu_kernel_is_the_weight_only_formula(rows, k, n, granularity):
    stored, bias = layer(k, n, granularity)
    x = random(3, (rows, k), jnp.bfloat16)
    check(weight_only_gemm(x, stored.data, stored.scale, bias, activation="gelu"), x, stored,
          bias, "gelu", jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [Tiling(n, k, w, s) for n, k, w, s in [
    (16, 256, 4, 3), (32, 512, 4, 5), (64, 256, 2, 4), (64, 512, 8, 3)]], ids=str)
def test_gpu_kernel_every_tiling_gives_the_formula(tiling):
    stored, bias = layer(2048, 2048, "channel")
    x = random(3, (16, 2048), jnp.bfloat16)
    check(weight_only_gemm(x, stored.data, stored.scale, bias, activation="relu",
                           tiling=tiling), x, stored, bias, "relu", jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_served_dense_over_few_rows_is_one_kernel(rows, monkeypatch):
    """`dense` with a stored weight over few rows: the Pallas call and nothing else that reads
    the weight (no XLA GEMM, no cuBLASLt call)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")
    stored, bias = layer(1024, 1536)
    x = random(3, (rows, 1024), jnp.bfloat16)
    fn = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu"))
    text = fn.lower(x, stored, bias).compile().as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "jax_epilog_matmul" not in text
    assert "__triton_gemm" not in text and "cublas" not in text
    check(fn(x, stored, bias), x, stored, bias, "gelu", jnp.bfloat16)


# --- SwiGLU's gate and up in one kernel --------------------------------------------------------

def swiglu_xla(x, weights):
    """h as the XLA formulation computes it: g and u each rounded to x's dtype."""
    g, u = (serving._weight_only_xla(x, w.data, w.scale, None, None) for w in weights)
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)


def swiglu_model(x, gate, up):
    """h in float64 from the dequantized stored weights."""
    g, u = (weight_only_model(np.asarray(x.astype(jnp.float32)), w, None, None)
            for w in (gate, up))
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("rows", [1, 16, 23])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
def test_swiglu_kernel_is_the_hidden_of_both_gemms(fused, granularity, rows):
    """A (gate, up) pair, or one `(D, 2F)` weight whose channels' offset the kernel reads
    (no slice of the FP8 data): h against the float64 model and the XLA formulation."""
    d, f = 64, 48
    kernel = random(7, (d, 2 * f), scale=d ** -0.5)
    if fused:
        both = quantize_weight(kernel, granularity=granularity)
        arg = ((both.data, both.scale),)
        pieces = [both.data[:f], both.data[f:]]
        scales = [both.scale[:f], both.scale[f:]] if granularity == "channel" else [both.scale] * 2
        gate, up = (type(both)(p, s) for p, s in zip(pieces, scales))
    else:
        gate, up = (quantize_weight(w, granularity=granularity)
                    for w in (kernel[:, :f], kernel[:, f:]))
        arg = ((gate.data, gate.scale), (up.data, up.scale))
    x = random(3, (rows, d), jnp.bfloat16)
    h = weight_only_kernel.weight_only_swiglu(x, arg, tiling=SMALL, interpret=True)
    assert h.shape == (rows, f) and h.dtype == jnp.bfloat16
    assert_served(h, swiglu_model(x, gate, up), jnp.bfloat16)
    want = swiglu_xla(x, (gate, up))
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=2 ** -7 * float(jnp.max(jnp.abs(want))))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_served_swiglu_over_few_rows_is_two_kernels(rows, monkeypatch):
    """The served SwiGLU block weight-only: the gate/up kernel and the down kernel, nothing
    else that reads a weight, values as the float64 model's."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "weight_only")
    d, f = 1024, 1536
    gate, up, down = (quantize_weight(random(i, shape, scale=shape[0] ** -0.5))
                      for i, shape in enumerate([(d, f), (d, f), (f, d)]))
    x = random(5, (rows, d), jnp.bfloat16)
    fn = jax.jit(lambda x, gu, w: jax_epilog.swiglu(x, gu, w))
    text = fn.lower(x, (gate, up), down).compile().as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "jax_epilog_matmul" not in text
    assert "__triton_gemm" not in text and "cublas" not in text
    h = swiglu_model(x, gate, up).astype(np.float32).astype(jnp.bfloat16)
    want = weight_only_model(np.asarray(jnp.asarray(h, jnp.float32)), down, None, None)
    assert_served(fn(x, (gate, up), down), want, jnp.bfloat16)


# --- the FP8 GEMM of few rows (both operands FP8) ------------------------------------------------

def check_fp8(x, stored, bias, activation, **kw):
    """The kernel on x quantized as the served layers quantize it, against the XLA FP8 way
    (`serving.xla_fp8`, which rounds the product to bf16 before its epilogue: one rounding more)."""
    x8, x_scale = serving.quantize_input(x, stored)
    got = few_rows_fp8_gemm(x8, x_scale, stored.data, stored.scale, bias, activation=activation,
                            **kw)
    want = serving.xla_fp8(x8, x_scale, stored, bias, activation, jnp.bfloat16)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=2 ** -6,
                               atol=2 ** -7 * np.max(np.abs(f32(want))))


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_few_rows_fp8_kernel_is_the_xla_fp8_way(granularity, rows):
    """Per tensor: one input scale; per channel: the input per token (the layers' rule)."""
    stored, bias = layer(96, 64, granularity)
    x = random(3, (rows, 96), jnp.bfloat16)
    check_fp8(x, stored, bias, "gelu", tiling=Tiling(32, 32, 4, 2), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("tiling", [None, Tiling(64, 256, 4, 3), Tiling(128, 128, 4, 5)],
                         ids=str)
def test_gpu_few_rows_fp8_kernel_is_the_xla_fp8_way(tiling, granularity, rows):
    stored, bias = layer(1024, 1536, granularity)
    check_fp8(random(3, (rows, 1024), jnp.bfloat16), stored, bias, "relu", tiling=tiling)
