"""FP8 with row scales (docs/fp8.md, "Row scaling"; cuBLASLt's outer vector scaling): `matmul`
with `BlockScales(values, "row")` on both operands against a float64 NumPy model written here
(CPU: the reference; `gpu`: the cuBLASLt kernel), `quantize_rows`, the CUDA lowering's custom
call (lowered for CUDA from this host), and the errors for what row scaling does not run.

The model: op(x) (rows, K) of each operand is its FP8 values times its row's scale; the
forward epilogs apply to P = op(a) op(b)ᵀ (+ bias) in float64; y is R rounded to the result
dtype.
"""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog import BlockScales, quantize_rows
from test_block_fp8 import _call, check  # the same call and tolerance as block scaling's

E4M3 = ml_dtypes.float8_e4m3fn
LAYOUTS = list(itertools.product([False, True], repeat=2))  # (transpose_a, transpose_b)
# (m, n, k): rows 1, 127, 129; N and K not multiples of 8 or 128 (the lowering pads them).
SHAPES = [(128, 256, 128), (1, 128, 256), (127, 130, 100), (129, 384, 40), (16, 24, 1000)]
EPILOGS = ["default", "bias", "relu_bias", "gelu_bias", "gelu"]


def model(a, b, sa, sb, transpose_a, transpose_b, epilog="default", bias=None):
    """(R in float64, |op(a)| |op(b)|ᵀ: the size of the sum's terms, for tolerances)."""
    a_rows = np.asarray(a).astype(np.float64)
    a_rows = a_rows.T if transpose_a else a_rows
    b_rows = np.asarray(b).astype(np.float64)
    b_rows = b_rows if transpose_b else b_rows.T
    a_rows = a_rows * np.asarray(sa.values, np.float64)[:, None]
    b_rows = b_rows * np.asarray(sb.values, np.float64)[:, None]
    r = a_rows @ b_rows.T
    if bias is not None:
        r = r + np.asarray(bias).astype(np.float64)
    if "relu" in epilog:
        r = np.maximum(r, 0)
    if "gelu" in epilog:  # cuBLASLt's GELU: the tanh approximation
        r = 0.5 * r * (1 + np.tanh(np.sqrt(2 / np.pi) * (r + 0.044715 * r ** 3)))
    return r, np.abs(a_rows) @ np.abs(b_rows).T


def make(rng, m, n, k, transpose_a, transpose_b):
    """Random FP8 operands in the stored layouts and random positive row scales."""
    def fp8(shape):
        return (rng.standard_normal(shape) * 8).astype(np.float32).astype(E4M3)

    def scales(rows):  # random, not powers of two, spread over 2**6
        return BlockScales(jnp.asarray(2.0 ** rng.uniform(-7, -1, rows), jnp.float32), "row")
    a = fp8((k, m) if transpose_a else (m, k))
    b = fp8((n, k) if transpose_b else (k, n))
    return a, b, scales(m), scales(n)


# --- the reference (CPU) against the model --------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("epilog", EPILOGS)
def test_reference_matches_the_model(shape, epilog):
    rng = np.random.default_rng(sum(shape))
    m, n, k = shape
    for (ta, tb), out in zip(LAYOUTS, [jnp.bfloat16, jnp.float32, jnp.float16, jnp.float32]):
        a, b, sa, sb = make(rng, m, n, k, ta, tb)
        bias = jnp.asarray(rng.standard_normal(n), out) if "bias" in epilog else None
        y = _call(a, b, sa, sb, ta, tb, epilog, bias, out=out)
        assert y.shape == (m, n) and y.dtype == out
        r, size = model(a, b, sa, sb, ta, tb, epilog, bias)
        check(y, r, size, out, slack=2.0**-20)


@pytest.mark.parametrize("rows", [1, 127, 129])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_rows_maps_each_rows_amax_to_the_largest_value(rows, dtype):
    rng = np.random.default_rng(rows)
    # rows spread over 10 orders of magnitude; one of them all zeros
    x = rng.standard_normal((rows, 200)) * 10.0 ** rng.uniform(-6, 4, (rows, 1))
    if rows > 1:
        x[rows // 2] = 0
    x = jnp.asarray(x, dtype)
    x8, scales = quantize_rows(x)
    assert x8.dtype == jnp.float8_e4m3fn and scales.block == "row"
    assert scales.values.shape == (rows,) and scales.values.dtype == jnp.float32
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    amax = np.max(np.abs(x64), axis=1)
    want = np.where(amax > 0, amax / 448.0, 1.0)
    np.testing.assert_allclose(np.asarray(scales.values), want, rtol=1e-6)
    back = np.asarray(x8.astype(jnp.float32), np.float64) * np.asarray(scales.values)[:, None]
    assert np.all(np.abs(back - x64) <= np.abs(x64) * 2.0**-4 + want[:, None] * 2.0**-10)
    assert np.all(np.max(np.abs(np.asarray(x8.astype(jnp.float32))), axis=1)[amax > 0] == 448)


def test_row_scales_keep_small_rows_that_one_scale_flushes():
    """A weight whose output channels differ by 10⁵ in size: with one scale the small ones
    fall below e4m3's subnormals and lose their values, with a scale per row they keep
    e4m3's relative precision."""
    rng = np.random.default_rng(0)
    size = 10.0 ** rng.uniform(-5, 0, 64)
    w = rng.standard_normal((64, 256)) * size[:, None]
    w8, row_scales = quantize_rows(jnp.asarray(w, jnp.float32))
    rows = np.asarray(w8.astype(jnp.float32), np.float64) * np.asarray(row_scales.values)[:, None]
    t8, t_scale = jax_epilog.quantize(jnp.asarray(w, jnp.float32))
    tensor = np.asarray(t8.astype(jnp.float32), np.float64) * float(t_scale)
    error = lambda back: np.linalg.norm(back - w, axis=1) / np.linalg.norm(w, axis=1)
    assert np.max(error(rows)) < 0.04
    # with one scale, their values map below 448 · 3·10⁻⁵ / 4σ: e4m3's few-bit subnormals
    small = size < 3e-5
    assert small.sum() >= 5 and np.min(error(tensor)[small]) > 3 * np.max(error(rows))


# --- bad input ------------------------------------------------------------------------------

def _operands(m=32, n=48, k=64):
    return make(np.random.default_rng(0), m, n, k, False, True)


def test_row_scales_on_one_operand_only_are_refused():
    a, b, sa, sb = _operands()
    blocks = BlockScales(jnp.ones((1, 48), jnp.float32), "1x128")
    with pytest.raises(ValueError, match=r"quantization_scales\['b'\]: with row scales for the "
                                         r"other operand this one needs row scales too"):
        _call(a, b, sa, blocks, False, True)
    with pytest.raises(TypeError, match=r"quantization_scales\['a'\].*BlockScales too"):
        _call(a, b, 1.0, sb, False, True)


@pytest.mark.parametrize("key,values,error,match", [
    ("a", jnp.ones((31,), jnp.float32), ValueError, r"expected shape \(32,\) for row scales"),
    ("b", jnp.ones((1, 48), jnp.float32), ValueError, r"expected shape \(48,\) for row scales"),
    ("a", jnp.ones((32,), jnp.bfloat16), TypeError, "expected a float32 array, got bf"),
])
def test_wrong_scale_arrays_name_the_argument(key, values, error, match):
    a, b, sa, sb = _operands()
    scales = {"a": sa, "b": sb}
    scales[key] = BlockScales(values, "row")
    with pytest.raises(error, match=rf"quantization_scales\['{key}'\]\.values: {match}"):
        _call(a, b, scales["a"], scales["b"], False, True)


@pytest.mark.parametrize("kw,match", [
    (dict(epilog="bgradb"), "epilog: calls with row scales run DEFAULT, BIAS, RELU, .*got "
                            "BGRADB"),
    (dict(out=jnp.float8_e4m3fn), "preferred_element_type: calls with row scales take no an "
                                  "FP8 result"),
    (dict(result_amax=True), "result_amax: calls with row scales"),
])
def test_options_row_scaling_does_not_take(kw, match):
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match=match):
        _call(a, b, sa, sb, False, True, **kw)


def test_quantize_rows_names_bad_input():
    with pytest.raises(ValueError, match=r"x: expected a 2-D array \(rows, K\), got shape \(4,\)"):
        quantize_rows(jnp.ones(4))
    with pytest.raises(TypeError, match="x: expected a floating-point array, got int32"):
        quantize_rows(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="dtype"):
        quantize_rows(jnp.ones((4, 4)), "int8")


def test_batched_operands_and_vmap_are_refused():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="a: calls with row scales take no leading"):
        _call(a[None], b, sa, sb, False, True)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda a: _call(a, b, sa, sb, False, True))(jnp.stack([a, a]))


# --- the CUDA lowering (from this host) -----------------------------------------------------

def test_cuda_lowering_calls_the_block_target_with_row_scales(monkeypatch):
    """The block target with both scale attributes -1 (row scales), TN operands, K and N
    padded to 16 (FP8) with b's padded rows scaled by 1, each scale vector one row."""
    from jax_epilog.op import lowering
    monkeypatch.setattr(lowering.cuda_library, "query_support", lambda *a, **k: (True, ""))
    a, b, sa, sb = make(np.random.default_rng(0), 129, 100, 40, True, False)
    f = jax.jit(lambda a, b, sa, sb: _call(a, b, sa, sb, True, False, "gelu_bias",
                                           jnp.ones(100, jnp.bfloat16), backend="cublaslt"))
    text = f.trace(a, b, sa, sb).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "@jax_epilog_matmul_block(" in line)
    assert "a_block_rows = -1 : i32" in call and "b_block_rows = -1 : i32" in call
    assert "transpose_a = false" in call and "transpose_b = true" in call  # TN, relaid in XLA
    assert "1x129x48xf8E4M3FN" in call and "1x112x48xf8E4M3FN" in call, call
    assert "1x129xf32" in call and "1x112xf32" in call, call


def test_cuda_fallback_is_xla_s_fp8_dot_with_the_row_scales_after(monkeypatch):
    """Where cuBLASLt has no kernel, CUDA runs the reference with XLA's FP8 dot to float32
    and the row scales applied after it (dequantized operands would make it a float32 GEMM,
    0.06x XLA's bf16 GEMM at 256 x 14336 x 4096 on the H200), with the warning."""
    from jax_epilog.op import lowering
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: True)
    monkeypatch.setattr(lowering.cuda_library, "query_support",
                        lambda *a, **k: (False, "CUBLAS_STATUS_NOT_SUPPORTED (test)"))
    a, b, sa, sb = make(np.random.default_rng(0), 129, 100, 40, False, True)
    f = jax.jit(lambda a, b, sa, sb: _call(a, b, sa, sb, False, True, "gelu_bias",
                                           jnp.ones(100, jnp.bfloat16), backend="cublaslt"))
    with pytest.warns(RuntimeWarning, match="runs no FP8 kernel for epilog GELU_BIAS"):
        text = f.trace(a, b, sa, sb).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_epilog_matmul" not in text
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1 and "xf8E4M3FN>, tensor<100x40xf8E4M3FN>) -> tensor<1x129x100xf32>" \
        in dots[0], dots


@pytest.mark.parametrize("shape", [(1, 33, 40), (129, 100, 40), (127, 130, 300)], ids=str)
@pytest.mark.parametrize("epilog", ["default", "gelu_bias"])
@pytest.mark.parametrize("exact", [True, False], ids=["fallback", "backend_xla"])
def test_the_fallback_s_fp8_dot_matches_the_model(shape, epilog, exact):
    """CUDA's product with row scales where it runs no kernel (`fp8_dot`: XLA's FP8 dot, the
    row scales after; the fallback, and `backend="xla"`) against the float64 model, as tight
    as the exact reference, in every layout."""
    from jax_epilog.op import reference
    from jax_epilog.op.epilogs import Epilog
    rng = np.random.default_rng(sum(shape) + 1)
    m, n, k = shape
    for ta, tb in LAYOUTS:
        a, b, sa, sb = make(rng, m, n, k, ta, tb)
        bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16) if "bias" in epilog else None
        inputs = [] if bias is None else [bias[None]]
        y, = jax.jit(lambda a, b, *rest: reference.epilog_matmul(
            a[None], b[None], *rest, epilog=int(getattr(Epilog, epilog.upper())),
            transpose_a=ta, transpose_b=tb, result_dtype="bfloat16",
            block_scaling=("row", "row"), exact=exact, fp8_dot=True))(
                a, b, *inputs, sa.values, sb.values)
        r, size = model(a, b, sa, sb, ta, tb, epilog, bias)
        check(y[0], r, size, jnp.bfloat16, slack=2.0**-20)


# --- the GPU --------------------------------------------------------------------------------

GPU_SHAPES = [(256, 256, 512), (129, 384, 256), (1, 128, 128), (127, 130, 100)]
#: cuBLASLt 13.1 on the H200 (2026-12-05): no row-scaled kernel with a float32 result and a
#: bias epilog, as with per-tensor scales (docs/fp8.md); those calls run the reference.
NO_KERNEL = {("float32", epilog) for epilog in ("bias", "relu_bias", "gelu_bias")}


@pytest.mark.gpu
@pytest.mark.parametrize("epilog", EPILOGS)
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
def test_gpu_kernel_matches_the_model(epilog, out):
    """The kernel (no fallback to the reference, except in `NO_KERNEL`, which must fall
    back) against the model, every layout, odd rows and widths; fast accumulation too (the
    serving layers ask for it)."""
    no_kernel = (jnp.dtype(out).name, epilog) in NO_KERNEL
    gpu = jax.devices("cuda")[0]
    rng = np.random.default_rng(12)
    for (m, n, k), (ta, tb), fast in itertools.product(GPU_SHAPES, LAYOUTS, [False, True]):
        a, b, sa, sb = make(rng, m, n, k, ta, tb)
        bias = jnp.asarray(rng.standard_normal(n), out) if "bias" in epilog else None
        f = jax.jit(lambda a, b, sa, sb, bias: _call(
            a, b, sa, sb, ta, tb, epilog, bias, out=out, backend="cublaslt",
            fast_accumulation=fast))
        args = jax.device_put((a, b, sa, sb, bias), gpu)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text = f.lower(*args).as_text()
        fell_back = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert bool(fell_back) == no_kernel, (m, n, k, ta, tb, fast, fell_back)
        assert ("jax_epilog_matmul_block" in text) != no_kernel, (m, n, k, ta, tb, fast)
        r, size = model(a, b, sa, sb, ta, tb, epilog, bias)
        # Hopper's FP8 tensor cores sum in reduced precision (about 14 bits) before
        # promoting, and fast accumulation promotes less often.
        check(f(*args), r, size, out, slack=2.0**-8 if fast else 2.0**-11)
