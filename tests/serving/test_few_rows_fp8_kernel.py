"""The served FP8 GEMM of few rows' Pallas kernel (`float8.few_rows_fp8_kernel`): on the CPU
with Pallas' interpreter, on a CUDA GPU (`gpu`) compiled by Triton, against the "xla_fp8"
way (`serving.xla_fp8`: XLA's FP8 dot of the same quantized input, which every other platform
runs) and, through the served layers, against the float64 model of test_serving."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog.float8 import few_rows_fp8_kernel
from jax_epilog.float8.few_rows_fp8_kernel import Tiling, default_tiling, few_rows_fp8_gemm, fits
from jax_epilog.float8.weights import quantize_weight
from jax_epilog.layers import serving
from test_serving import assert_served, random, served_model


def layer(k, n, granularity="tensor", bias=True, dtype=jnp.bfloat16, key=1):
    """(stored weight, bias or None): the output channels' sizes spread over 2**6."""
    columns = 2.0 ** jax.random.uniform(jax.random.key(key + 50), (n,), minval=-6, maxval=0)
    stored = quantize_weight(random(key, (k, n), scale=k ** -0.5) * columns,
                             granularity=granularity)
    return stored, (random(key + 1, (n,), dtype, scale=0.1) if bias else None)


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


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_few_rows_fp8_kernel_is_the_xla_fp8_way(granularity, rows, split_k):
    """Per tensor: one input scale; per channel: the input per token (the layers' rule). With
    K split in three, each program sums a third of K and XLA adds the parts."""
    stored, bias = layer(96, 64, granularity)
    x = random(3, (rows, 96), jnp.bfloat16)
    check_fp8(x, stored, bias, "gelu", tiling=Tiling(32, 32, 4, 2, split_k), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("tiling", [None, Tiling(64, 256, 4, 3), Tiling(128, 128, 4, 5),
                                    Tiling(64, 256, 4, 3, 2), Tiling(128, 128, 4, 5, 4)],
                         ids=str)
def test_gpu_few_rows_fp8_kernel_is_the_xla_fp8_way(tiling, granularity, rows):
    stored, bias = layer(1024, 1536, granularity)
    check_fp8(random(3, (rows, 1024), jnp.bfloat16), stored, bias, "relu", tiling=tiling)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rows", [1, 3, 17, 33, 64])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_kernel_at_every_row_count(rows, activation, split_k):
    """Rows not a power of two repeat x's last row in the program (no padded copy of x) and
    store its result again (its partial sums, with K split)."""
    stored, bias = layer(96, 64)
    check_fp8(random(3, (rows, 96), jnp.bfloat16), stored, bias, activation,
              tiling=Tiling(32, 32, 4, 2, split_k), interpret=True)


@pytest.mark.parametrize("rows", [1, 7])
def test_the_default_tiling_splits_a_long_k_and_the_kernel_sums_the_parts(rows):
    """Few channels and a long K: K split before the channel blocks narrow; a 16-bit x
    quantized by the kernel in each part from the same rows' amaxes."""
    stored, bias = layer(4096, 64, key=7)
    assert default_tiling(rows, 4096, 64, 2).split_k == 2
    x = random(5, (rows, 4096), jnp.bfloat16)
    x8, x_scale = serving.quantize_input(x, stored)
    want = serving.xla_fp8(x8, x_scale, stored, bias, "gelu", jnp.bfloat16)
    got = few_rows_fp8_gemm(x, None, stored.data, stored.scale, bias,
                            row_amax=few_rows_fp8_kernel.row_amax(x), activation="gelu",
                            input_scaling="tensor", interpret=True)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=2 ** -6,
                               atol=2 ** -7 * np.max(np.abs(f32(want))))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("k,n", [(32, 32), (96, 160), (1056, 224)])
def test_kernel_shapes_biases_and_result_types(k, n, dtype, bias):
    """K and N multiples of 16 that are not powers of two, float16 as well as bfloat16."""
    stored, b = layer(k, n, "channel", bias, dtype)
    x = random(4, (5, k), dtype)
    x8, x_scale = serving.quantize_input(x, stored)
    got = few_rows_fp8_gemm(x8, x_scale, stored.data, stored.scale, b, activation="gelu",
                            dtype=dtype, tiling=Tiling(32, 32, 4, 2), interpret=True)
    want = serving.xla_fp8(x8, x_scale, stored, b, "gelu", dtype)
    assert got.dtype == dtype and got.shape == (5, n)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=2 ** -6,
                               atol=2 ** -7 * np.max(np.abs(f32(want))))


@pytest.mark.parametrize("x_itemsize", [1, 2])
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (4096, 4096), (8192, 8192),
                                 (96, 160), (1056, 224)])
def test_the_default_tiling_divides_the_shape_and_fits_shared_memory(k, n, rows, x_itemsize):
    """For an e4m3 x and for a 16-bit x (twice the input tile's bytes)."""
    t = default_tiling(rows, k, n, x_itemsize)
    assert n % t.block_n == 0 and k % (t.block_k * t.split_k) == 0
    assert (n // t.block_n * t.split_k >= few_rows_fp8_kernel.MIN_PROGRAMS
            or t.block_n == few_rows_fp8_kernel.MIN_BLOCK)
    assert t.split_k == 1 or k // (t.block_k * t.split_k) >= few_rows_fp8_kernel.MIN_SPLIT_STEPS
    padded = few_rows_fp8_kernel.padded_rows(rows)
    tiles = t.num_stages * (t.block_n + x_itemsize * padded) * t.block_k
    assert tiles <= few_rows_fp8_kernel.STAGE_BYTES or t.num_stages == 2
    assert tiles <= few_rows_fp8_kernel.SHARED_MEMORY


def test_the_measured_tiling_at_decode_sizes():
    """128 channels x 256 of K, 5 stages where they fit; 3 with 64 rows (5 did not launch)."""
    assert default_tiling(16, 4096, 14336) == Tiling(128, 256, 4, 5)
    assert default_tiling(64, 4096, 14336) == Tiling(128, 256, 4, 3)
    # 128 programs, not 32: K split in four (14 blocks of 256 each), 128 channels each
    assert default_tiling(16, 14336, 4096) == Tiling(128, 256, 4, 5, 4)
    assert default_tiling(16, 4096, 4096) == Tiling(64, 256, 4, 5, 2)
    # A 16-bit x's tiles take twice the bytes: fewer stages
    assert default_tiling(16, 4096, 14336, 2) == Tiling(128, 256, 4, 4)
    assert default_tiling(64, 4096, 14336, 2) == Tiling(128, 256, 4, 2)


def test_the_serving_plan_sends_the_kernel_no_more_rows_than_it_takes():
    from jax_epilog.planning import serving_plan
    assert serving_plan.FP8_PALLAS_MAX_ROWS <= few_rows_fp8_kernel.MAX_ROWS


def test_a_tiling_that_does_not_divide_the_shape_is_refused():
    stored, _ = layer(96, 160)
    x8, x_scale = serving.quantize_input(random(3, (2, 96), jnp.bfloat16), stored)
    with pytest.raises(ValueError, match=r"^tiling: .* does not divide K 96 .* and N 160"):
        few_rows_fp8_gemm(x8, x_scale, stored.data, stored.scale,
                          tiling=Tiling(64, 64, 4, 2), interpret=True)


@pytest.mark.parametrize("rows,k,n,dtype,fit", [
    (1, 64, 64, jnp.bfloat16, True), (64, 96, 160, jnp.float16, True),
    (65, 64, 64, jnp.bfloat16, False), (0, 64, 64, jnp.bfloat16, False),
    (4, 80, 64, jnp.bfloat16, False), (4, 64, 48, jnp.bfloat16, False),
    (4, 64, 64, jnp.float32, False)])
def test_fits_says_where_the_kernel_runs(rows, k, n, dtype, fit):
    """At most 64 rows, a 16-bit result, K and N multiples of 32; elsewhere the served layer
    runs XLA's FP8 dot."""
    assert fits(rows, k, n, dtype) == fit


def test_off_cuda_the_way_is_xla_s_fp8_dot():
    """Only CUDA runs the kernel: the CPU's program has no Pallas call, and its values are
    the "xla_fp8" way's."""
    stored, bias = layer(64, 64)
    x = jax.device_put(random(3, (4, 64), jnp.bfloat16), jax.devices("cpu")[0])
    fn = jax.jit(lambda *a: serving.fp8_pallas(*a, "gelu", jnp.bfloat16))
    text = fn.lower(x, stored, bias).as_text()
    assert "few_rows_fp8_gemm" not in text and "triton" not in text
    # Both compiled: run op by op (as older jax does outside jit), the reference would round
    # its intermediates to bfloat16 where the fused program keeps float32.
    xla_way = jax.jit(lambda x, w, b: serving.xla_fp8(*serving.quantize_input(x, w), w, b,
                                                      "gelu", jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(fn(x, stored, bias), np.float32),
                                  np.asarray(xla_way(x, stored, bias), np.float32))


def with_input_scale(stored, x):
    """`stored` with the static input scale `calibrate` would give it for `x` alone."""
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    return dataclasses.replace(stored, input_scale=jnp.float32(amax / 448.0))


def ieee_quantize(x, stored):
    """`serving.quantize_input(x, stored)` in numpy: every division correctly rounded to
    float32, as the kernel divides on a GPU (`div.rn.f32`). XLA's own divisions are not always
    (a vectorised loop on the CPU gave 336.0 for 2.90625 / 0.008649553, whose float32 is
    336.00003, so the tie at 336 went to 320 where the kernel rounds to 352; on the H200, at
    64 x 1024, 15 of 64 row scales were an ulp off and 16 of 65536 e4m3 values a step off)."""
    largest = np.float32(few_rows_fp8_kernel.INPUT_LARGEST)
    h = np.asarray(x, np.float32)
    if stored.input_scale is not None:
        scale = np.float32(stored.input_scale)
        values = h / scale
    else:
        amax = np.max(np.abs(h), axis=1, keepdims=True)  # NaN propagates, as XLA's max
        if jnp.ndim(stored.scale) == 0:
            amax = np.full_like(amax, np.max(amax))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            q = largest / amax
        q = np.where((amax > 0) & np.isfinite(amax) & np.isfinite(q), q, np.float32(1))
        values, scale = h * q, np.float32(1) / q
        scale = scale[:, 0] if jnp.ndim(stored.scale) == 1 else scale[0, 0]
    x8 = np.clip(values, -largest, largest).astype(ml_dtypes.float8_e4m3fn)  # keeps NaN
    return jnp.asarray(x8), jnp.asarray(scale, jnp.float32)


def check_quantizing(x, stored, bias, **kw):
    """The kernel quantizing 16-bit x itself (as `serving.fp8_pallas` calls it) against the
    kernel on x quantized as `serving.quantize_input` quantizes it with correctly rounded
    divisions (`ieee_quantize`): the same e4m3 operands and scales, so the same bits."""
    static = stored.input_scale is not None
    scaling = None if static else "row" if jnp.ndim(stored.scale) == 1 else "tensor"
    got = few_rows_fp8_gemm(x, stored.input_scale, stored.data, stored.scale, bias,
                            row_amax=None if static else few_rows_fp8_kernel.row_amax(x),
                            activation="gelu", dtype=x.dtype, input_scaling=scaling, **kw)
    x8, x_scale = jax.device_put(ieee_quantize(x, stored), next(iter(x.devices())))
    want = few_rows_fp8_gemm(x8, x_scale, stored.data, stored.scale, bias, activation="gelu",
                             dtype=x.dtype, **kw)
    assert got.dtype == x.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("scaling", ["tensor", "row", "static"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_the_kernel_quantizes_a_16_bit_input_as_xla_does(dtype, scaling, rows):
    """Per tensor (one amax over every row), per row (before a per-channel weight), or by a
    static scale (`calibrate`'s, by division), with rows past x's repeating its last."""
    stored, bias = layer(96, 160, "channel" if scaling == "row" else "tensor", dtype=dtype)
    x = random(5, (rows, 96), dtype) * (1.0 + jnp.arange(rows, dtype=dtype)[:, None])
    if scaling == "static":
        stored = with_input_scale(stored, x * 0.5)  # saturates the larger half
    check_quantizing(x, stored, bias, tiling=Tiling(32, 32, 4, 2), interpret=True)


def test_a_zero_row_quantized_alone_keeps_scale_one():
    """A row of zeros has amax 0: its multiplier is 1 (`scaling.multiplier`), its output the
    bias's activation; the other rows are untouched by it."""
    stored, bias = layer(96, 64, "channel")
    x = random(6, (5, 96), jnp.bfloat16).at[2].set(0.0)
    check_quantizing(x, stored, bias, tiling=Tiling(32, 32, 4, 2), interpret=True)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_input_is_quantized_as_xla_quantizes_it(bad, granularity):
    """A NaN or an infinity in a row: XLA's amax is then NaN or inf, its multiplier 1 (for
    every row per tensor, for that row per token); the kernel's the same (Triton's max drops
    NaN, so the kernel reads a NaN amax as inf)."""
    stored, bias = layer(96, 64, granularity)
    x = random(6, (5, 96), jnp.bfloat16).at[3, 7].set(bad)
    check_quantizing(x, stored, bias, tiling=Tiling(32, 32, 4, 2), interpret=True)


AMAXES = np.ones(4, np.float32)


@pytest.mark.parametrize("x_dtype,x_scale,amaxes,scaling,message", [
    (jnp.float8_e4m3fn, None, None, None, "x_scale: an e4m3 x comes with"),
    (jnp.float8_e4m3fn, 1.0, AMAXES, "tensor", "x_scale: an e4m3 x comes with"),
    (jnp.bfloat16, None, None, None, "x_scale: a 16-bit x is quantized with one static"),
    (jnp.bfloat16, AMAXES, None, None, "x_scale: a 16-bit x is quantized"),
    (jnp.bfloat16, 1.0, AMAXES, None, "x_scale: a 16-bit x is quantized"),
    (jnp.bfloat16, 1.0, AMAXES, "tensor", "input_scaling: expected one of"),
    (jnp.bfloat16, None, AMAXES, "column", "input_scaling: expected one of"),
    (jnp.bfloat16, None, None, "row", r"row_amax: expected x's rows' amaxes, shape \(4,\), "
                                      "got None"),
    (jnp.bfloat16, None, AMAXES[:3], "row", r"shape \(4,\), got \(3,\)"),
    (jnp.float32, None, AMAXES, "tensor", "x: expected e4m3 or a 16-bit float, got float32")])
def test_inputs_the_kernel_cannot_take_are_named(x_dtype, x_scale, amaxes, scaling, message):
    stored, _ = layer(64, 64)
    x = random(3, (4, 64), jnp.bfloat16).astype(x_dtype)
    with pytest.raises(ValueError, match=message):
        few_rows_fp8_gemm(x, x_scale, stored.data, stored.scale, row_amax=amaxes,
                          input_scaling=scaling, tiling=Tiling(32, 32, 4, 2), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_gpu_default_tiling_at_llama_sizes(k, n, rows):
    """The default tiling where it is used most (and where 5 stages of 64 rows overflowed
    shared memory)."""
    stored, bias = layer(k, n, "tensor")
    check_fp8(random(3, (rows, k), jnp.bfloat16), stored, bias, "gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("scaling", ["tensor", "row", "static"])
@pytest.mark.parametrize("k,n", [(1024, 1536), (14336, 4096)])
def test_gpu_the_kernel_quantizes_a_16_bit_input_as_xla_does(k, n, scaling, rows):
    """Triton's amax, multiplier and cast against XLA's quantization, bit for bit."""
    stored, bias = layer(k, n, "channel" if scaling == "row" else "tensor")
    x = random(5, (rows, k), jnp.bfloat16)
    if scaling == "static":
        stored = with_input_scale(stored, x * 0.5)
    check_quantizing(x, stored, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_gpu_a_non_finite_input_is_quantized_as_xla_quantizes_it(bad, granularity):
    stored, bias = layer(1024, 1536, granularity)
    check_quantizing(random(6, (5, 1024), jnp.bfloat16).at[3, 7].set(bad), stored, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_gpu_served_dense_over_few_rows_is_the_kernel(rows, granularity, monkeypatch):
    """`dense` with a stored weight over few rows by the fp8_pallas way: the Pallas call and
    no other GEMM (no XLA GEMM, no cuBLAS(Lt) call), values as the float64 model's."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8_pallas")
    stored, bias = layer(1024, 1536, granularity)
    x = random(3, (rows, 1024), jnp.bfloat16)
    fn = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu"))
    text = fn.lower(x, stored, bias).compile().as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "jax_epilog_matmul" not in text
    assert "__triton_gemm" not in text and "cublas" not in text
    assert_served(fn(x, stored, bias), served_model(
        np.asarray(x.astype(jnp.float32)), stored, np.asarray(bias.astype(jnp.float32)),
        "gelu"), jnp.bfloat16)
