"""Block-scaled FP8 (docs/fp8.md, "Block scaling"): `matmul` with `BlockScales` against a
float64 NumPy model written here independently of `jax_epilog` (CPU: the reference; `gpu`:
the cuBLASLt kernel), the quantization helpers' round trip, the CUDA lowering's custom call
(lowered for CUDA from this host), and the errors for what block scaling does not run.

The model: op(x) (rows, K) of each operand is its FP8 values times the scale of the 1×128
tile (values[j, i] for row i, columns 128j..128j+127) or 128×128 block (values[i, j]) they
are in; P = op(a) op(b)ᵀ in float64, plus the bias; y is P rounded to the result dtype.
"""

from __future__ import annotations

import functools
import itertools
import types
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog import BlockScales, quantize_1x128, quantize_128x128
from jax_epilog.float8 import block_kernel, blocks
from jax_epilog.op import matmul as matmul_module
from jax_epilog.op.epilogs import ACTIVATIONS

E4M3 = ml_dtypes.float8_e4m3fn
PAIRS = [("1x128", "128x128"), ("128x128", "1x128"), ("1x128", "1x128")]
LAYOUTS = list(itertools.product([False, True], repeat=2))  # (transpose_a, transpose_b)


# --- the float64 model ----------------------------------------------------------------------

def _expand(values, block: str, rows: int, k: int) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if block == "1x128":
        return np.repeat(values.T, 128, axis=1)
    return np.repeat(np.repeat(values, 128, axis=0), 128, axis=1)[:rows, :k]


def _op_rows(x, transposed: bool) -> np.ndarray:
    """op(x) as (rows, K) float64."""
    x = np.asarray(x).astype(np.float64)
    return x.T if transposed else x


def model(a, b, sa: BlockScales, sb: BlockScales, transpose_a, transpose_b, bias=None):
    """(P in float64, |op(a)| |op(b)|ᵀ: the size of the sum's terms, for tolerances)."""
    a_rows = _op_rows(a, transpose_a)
    b_rows = _op_rows(b, not transpose_b)
    a_rows = a_rows * _expand(sa.values, sa.block, *a_rows.shape)
    b_rows = b_rows * _expand(sb.values, sb.block, *b_rows.shape)
    p = a_rows @ b_rows.T
    if bias is not None:
        p = p + np.asarray(bias).astype(np.float64)
    return p, np.abs(a_rows) @ np.abs(b_rows).T


def _scales(rng, block: str, rows: int, k: int) -> BlockScales:
    shape = (k // 128, rows) if block == "1x128" else (-(-rows // 128), k // 128)
    values = 2.0 ** rng.uniform(-7, -1, size=shape)  # random, not powers of two (float16-safe)
    return BlockScales(jnp.asarray(values, jnp.float32), block)


def make(rng, m, n, k, blocks_, transpose_a, transpose_b):
    """Random FP8 operands in the stored layouts and random positive block scales."""
    def fp8(shape):
        return (rng.standard_normal(shape) * 8).astype(np.float32).astype(E4M3)
    a = fp8((k, m) if transpose_a else (m, k))
    b = fp8((n, k) if transpose_b else (k, n))
    return a, b, _scales(rng, blocks_[0], m, k), _scales(rng, blocks_[1], n, k)


def check(y, p, size, dtype, slack: float):
    """y within its rounding and `slack` · (the terms' size) of the model's P."""
    y = np.asarray(y).astype(np.float64)
    allowed = float(jnp.finfo(dtype).eps) * np.abs(p) + slack * size + 1e-30
    worst = np.max(np.abs(y - p) / allowed)
    assert worst <= 1.0, f"{worst:.3g} x the allowed error"


def _call(a, b, sa, sb, transpose_a, transpose_b, epilog="default", bias=None,
          out=jnp.bfloat16, **kw):
    return jax_epilog.matmul(a, b, epilog=epilog,
                             epilog_inputs={"bias": bias} if bias is not None else None,
                             transpose_a=transpose_a, transpose_b=transpose_b,
                             quantization_scales={"a": sa, "b": sb},
                             preferred_element_type=out, **kw)


# --- the reference (CPU) against the model --------------------------------------------------

# (m, n, k): rows of a 1, 127, 129 (the 1x128 tiles' rows need not be whole blocks; a partial
# last 128x128 block), 128x256, 384x128, odd multiples of 128 in K.
SHAPES = [(128, 256, 128), (384, 128, 384), (1, 128, 256), (127, 130, 128), (129, 384, 384)]


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_the_model(pair, shape):
    rng = np.random.default_rng(sum(shape))
    m, n, k = shape
    for (ta, tb), out in zip(LAYOUTS, [jnp.bfloat16, jnp.float32, jnp.float16, jnp.float32]):
        a, b, sa, sb = make(rng, m, n, k, pair, ta, tb)
        bias = jnp.asarray(rng.standard_normal(n), out)
        y = _call(a, b, sa, sb, ta, tb, "bias", bias, out=out)
        assert y.shape == (m, n) and y.dtype == out
        p, size = model(a, b, sa, sb, ta, tb, bias)
        check(y, p, size, out, slack=2.0**-20)


# --- quantization ---------------------------------------------------------------------------

def _outliers(rng, rows, k, channels=(3,), factor=1000.0):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, list(channels)] *= factor
    return jnp.asarray(x)


def _round_trip_bound(x, x8, scales: BlockScales):
    """|x - dequantized| ≤ half an e4m3 step (2⁻⁴ relative) or, below e4m3's normals, half its
    smallest subnormal step (2⁻¹⁰) times the tile's scale."""
    back = np.asarray(blocks.dequantize(x8, scales), np.float64)
    x = np.asarray(x, np.float64)
    scale = _expand(scales.values, scales.block, *x.shape)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + scale * 2.0**-10 + 1e-30)
    return scale


@pytest.mark.parametrize("rows", [1, 127, 129, 256])
def test_1x128_round_trip(rows):
    rng = np.random.default_rng(rows)
    x = _outliers(rng, rows, 384)
    x8, scales = quantize_1x128(x)
    assert x8.dtype == jnp.float8_e4m3fn and scales.block == "1x128"
    assert scales.values.shape == (3, rows) and scales.values.dtype == jnp.float32
    _round_trip_bound(x, x8, scales)
    # every tile's largest |value| lands on e4m3's largest, 448
    tile_max = np.abs(np.asarray(x8, np.float32)).reshape(rows, 3, 128).max(axis=2)
    np.testing.assert_array_equal(tile_max, 448.0)
    # the weight gradient's copy: xᵀ quantized along the rows
    xt8, t_scales = quantize_1x128(x[:128] if rows >= 128 else jnp.tile(x, (128, 1))[:128],
                                   transposed=True)
    assert xt8.shape == (384, 128) and t_scales.values.shape == (1, 384)


def _hard_tiles(rng, rows, k, dtype):
    """Random x (rows, K) zero-padded to a multiple of 128 rows, as the block layer pads it,
    with what a tile can hold: outlier channels past e4m3's largest value, an all-zero
    128×128 block, negative values and an infinity."""
    x = np.array(_outliers(rng, rows, k, channels=(3, k - 56), factor=3e4))
    if k >= 256:  # a second column of blocks, so the zero block is not all of x
        x[:min(rows, 128), 128:256] = 0.0
    x[rows // 2, k - 1] = -np.inf
    x = np.pad(x, ((0, -rows % 128), (0, 0)))
    return jnp.asarray(x, dtype)


def _same_bytes(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def _both_copies_by_reference(x, dtype):
    return quantize_1x128(x, dtype), quantize_1x128(x, dtype, transposed=True)


BOTH_CASES = list(itertools.product([1, 127, 129, 256], [jnp.bfloat16, jnp.float32],
                                    ["float8_e4m3fn", "float8_e5m2"]))


@pytest.mark.parametrize("rows,dtype,fmt", BOTH_CASES,
                         ids=[f"{r}-{d.__name__}-{f[7:]}" for r, d, f in BOTH_CASES])
def test_1x128_both_is_the_two_copies_byte_for_byte(rows, dtype, fmt):
    """Every `BOTH_COPIES_CHOICES` kernel (on a CPU "pallas" is the XLA formulation) and the
    Pallas kernel itself (run by the interpreter) give exactly `quantize_1x128`'s bytes and
    scales, both ways."""
    x = _hard_tiles(np.random.default_rng(rows), rows, 384, dtype)
    want = jax.jit(_both_copies_by_reference, static_argnums=1)(x, fmt)
    for kernel in blocks.BOTH_COPIES_CHOICES:
        (x8, s), (xt8, st) = jax.jit(blocks.quantize_1x128_both, static_argnums=1,
                                     static_argnames="kernel")(x, fmt, kernel=kernel)
        _same_bytes(((x8, s.values), (xt8, st.values)), want)
        assert s.block == st.block == "1x128"
    _same_bytes(block_kernel.quantize_both(x, dtype=fmt, interpret=True),
                (want[0][0], want[0][1].values, want[1][0], want[1][1].values))


PROLOGUE_CASES = [("gelu", False), ("relu", False), ("gelu", True), (None, False)]


def _plus_zero(a):
    """FP8 bytes with -0 (0x80) taken for +0; float32 arrays as they are."""
    if a.dtype == jnp.float32:
        return np.asarray(a)
    u = np.asarray(a).view(np.uint8)
    return np.where(u == 0x80, np.uint8(0), u)


def _as_separate_passes(got, want, written, fraction=0.03):
    """One pass with a prologue against the separate passes (`want`, quantized from the
    `written` tensor): the same bytes and scales (within a bfloat16 rounding) but for at most
    `fraction` of them, which may differ where the float32 math (tanh, subnormals, the sign
    of a zero) was evaluated by another compiled form (measured on the H200: up to 1.6%); and both copies dequantize to `written` within e4m3's rounding (tiles
    without Inf or NaN), all but 0.1% of the values."""
    (x8, s), (xt8, st) = got
    for g, w in zip((x8, s.values, xt8, st.values),
                    (want[0][0], want[0][1].values, want[1][0], want[1][1].values)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if g.dtype == jnp.float32:  # a tile's scale: its amax may round the other way
            assert np.mean(~np.isclose(g, w, rtol=2.0**-7, equal_nan=True)) <= fraction
        else:
            assert np.mean(_plus_zero(g) != _plus_zero(w)) <= fraction
    written = np.asarray(written, np.float32)
    for copy, reference in ((blocks.dequantize(x8, s), written),
                            (blocks.dequantize(xt8, st), written.T)):
        tile_amax = np.repeat(np.abs(reference).reshape(reference.shape[0], -1, 128).max(
            axis=2), 128, axis=1)
        finite = np.isfinite(tile_amax)  # (tiles holding Inf or NaN: the bytes above)
        error = np.abs(np.asarray(copy) - reference)[finite]
        beyond = error > 2.0**-4 * np.abs(reference[finite]) + tile_amax[finite] * 2.0**-9
        # (gelu' far out, |Z| near 5: one tanh rounds 1 + tanh to 0, another does not)
        assert np.mean(beyond) <= 0.001, np.mean(beyond)


def _written(x, z, activation, derivative):
    """What a separate XLA fusion writes for `quantize_1x128_both` to quantize."""
    if derivative:
        return matmul_module.activation_gradient(x, z, activation)  # the layer's dZ
    return x if activation is None else \
        ACTIVATIONS[activation].fn(x.astype(jnp.float32)).astype(x.dtype)


@pytest.mark.parametrize("rows", [128, 384])
@pytest.mark.parametrize("activation,derivative", PROLOGUE_CASES,
                         ids=[f"{a}{'-derivative' if d else ''}" for a, d in PROLOGUE_CASES])
def test_1x128_both_with_a_prologue_is_the_separate_passes(rows, activation, derivative):
    """`activation=` quantizes act(Z) and `pre_activation=` dY · act'(Z), each rounded to the
    16-bit dtype, as an XLA fusion writing that tensor followed by `quantize_1x128` would
    (`_as_separate_passes`), every kernel and the Pallas kernel run by the interpreter;
    `column_sums` are the written tensor's column sums."""
    rng = np.random.default_rng(rows)
    x = _hard_tiles(rng, rows, 384, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((rows, 384)) * 3, jnp.bfloat16)
    kw = dict(activation=activation, pre_activation=z if derivative else None)
    written = jax.jit(_written, static_argnums=(2, 3))(x, z, activation, derivative)
    want = jax.jit(_both_copies_by_reference, static_argnums=1)(written, "float8_e4m3fn")
    want_sums = np.sum(np.asarray(written, np.float32), axis=0)
    for kernel in blocks.BOTH_COPIES_CHOICES:
        *copies, sums = jax.jit(functools.partial(
            blocks.quantize_1x128_both, kernel=kernel, column_sums=True, **kw))(x)
        _as_separate_passes(copies, want, written)
        np.testing.assert_allclose(sums, want_sums, rtol=1e-5, atol=1e-3)
    prologue = block_kernel.Prologue(activation, derivative, "bfloat16")
    x8, s, xt8, st, sums = block_kernel.quantize_both(
        x, *((z,) if derivative else ()), dtype="float8_e4m3fn", prologue=prologue, sums=True,
        interpret=True)
    _as_separate_passes(((x8, BlockScales(s, "1x128")), (xt8, BlockScales(st, "1x128"))),
                        want, written)
    np.testing.assert_allclose(sums, want_sums, rtol=1e-3, atol=1e-2)


def test_1x128_both_refuses_a_derivative_it_cannot_take():
    x = _hard_tiles(np.random.default_rng(2), 128, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="pre_activation: the derivative from Z runs for "
                                         "activation='gelu' only, got activation='relu'"):
        blocks.quantize_1x128_both(x, activation="relu", pre_activation=x)
    with pytest.raises(ValueError, match=r"pre_activation: expected x's shape \(128, 256\)"):
        blocks.quantize_1x128_both(x, activation="gelu", pre_activation=x[:, :128])
    with pytest.raises(ValueError, match="activation: expected None or one of relu, gelu, "
                                         "got 'tanh'"):
        blocks.quantize_1x128_both(x, activation="tanh")


def test_1x128_both_refuses_an_unknown_kernel_and_unpadded_rows(monkeypatch):
    """An unknown `kernel` (or `BOTH_COPIES`) and rows that are not a multiple of 128 are
    refused, naming what to change."""
    x = _hard_tiles(np.random.default_rng(3), 256, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel: expected one of xla, pallas, xla_separate, "
                                         "got 'triton'"):
        blocks.quantize_1x128_both(x, kernel="triton")
    monkeypatch.setattr(blocks, "BOTH_COPIES", "triton")
    with pytest.raises(ValueError, match="blocks.BOTH_COPIES: expected one of .*'triton'"):
        blocks.quantize_1x128_both(x)
    with pytest.raises(ValueError, match="x: the quantized axis .rows.* got 129; zero-pad"):
        blocks.quantize_1x128_both(x[:129])


@pytest.mark.parametrize("rows", [128, 129, 384])
def test_128x128_round_trip_and_transpose(rows):
    x = _outliers(np.random.default_rng(rows), rows, 256)
    x8, scales = quantize_128x128(x)
    assert scales.values.shape == (-(-rows // 128), 2)
    _round_trip_bound(x, x8, scales)
    if rows % 128 == 0:
        xt8, st = blocks.transpose_128x128(x8, scales)
        np.testing.assert_array_equal(np.asarray(blocks.dequantize(xt8, st)),
                                      np.asarray(blocks.dequantize(x8, scales)).T)


def test_zero_tiles_get_scale_one():
    x = jnp.zeros((2, 256), jnp.float32).at[0, 200].set(3.0)
    x8, scales = quantize_1x128(x)
    np.testing.assert_array_equal(np.asarray(scales.values)[0], 1.0)  # tile 0: all zeros
    assert float(blocks.dequantize(x8, scales)[0, 200]) == 3.0


def test_block_scaling_beats_per_tensor_on_outlier_channels():
    """0.1% of the activation channels ×1000: the 1x128 × 128x128 product's error against
    float32 is below per-tensor FP8's (measured here 0.75×: e4m3 keeps ordinary values of a
    ×1000 tensor in its normal range, so both errors are mostly e4m3's own rounding), and on
    ordinary data no larger."""
    rng = np.random.default_rng(7)
    k = 1024
    w = jnp.asarray(rng.standard_normal((256, k)) / np.sqrt(k), jnp.float32)  # (N, K)
    for channels, bound in (((5,), 0.85), ((), 1.0)):
        x = _outliers(rng, 256, k, channels)
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        xq, sx = quantize_1x128(x)
        wq, sw = quantize_128x128(w)
        y_block = _call(xq, wq, sx, sw, False, True, out=jnp.float32)
        (xt, sxt), (wt, swt) = jax_epilog.quantize(x), jax_epilog.quantize(w)
        y_tensor = jax_epilog.matmul(xt, wt, transpose_b=True, preferred_element_type=jnp.float32,
                                     quantization_scales={"a": sxt, "b": swt})
        errors = [np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)
                  for y in (y_block, y_tensor)]
        assert errors[0] <= bound * errors[1], errors


# --- bad input ------------------------------------------------------------------------------

def _operands(m=128, n=128, k=256):
    rng = np.random.default_rng(0)
    return make(rng, m, n, k, ("1x128", "128x128"), False, True)


def test_two_128x128_operands_are_refused():
    a, b, _, sb = _operands()
    sa = BlockScales(jnp.ones((1, 2), jnp.float32), "128x128")
    with pytest.raises(ValueError, match="both have 128x128"):
        _call(a, b, sa, sb, False, True)


def test_k_not_a_multiple_of_128_is_refused():
    a, b, sa, sb = _operands(k=256)
    with pytest.raises(ValueError, match="K a multiple of 128.*zero-pad K"):
        _call(a[:, :200], b[:, :200], sa, sb, False, True)
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_1x128(jnp.ones((4, 200)))


@pytest.mark.parametrize("key,values,error,match", [
    ("a", jnp.ones((2, 127), jnp.float32), ValueError, r"expected shape \(2, 128\)"),
    ("b", jnp.ones((2, 1), jnp.float32), ValueError, r"expected shape \(1, 2\)"),
    ("a", jnp.ones((2, 128), jnp.bfloat16), TypeError, "expected a float32 array, got bf"),
])
def test_wrong_scale_arrays_name_the_argument(key, values, error, match):
    a, b, sa, sb = _operands()
    scales = {"a": sa, "b": sb}
    scales[key] = BlockScales(values, scales[key].block)
    with pytest.raises(error, match=rf"quantization_scales\['{key}'\]\.values: {match}"):
        _call(a, b, scales["a"], scales["b"], False, True)


def test_block_and_scalar_scales_do_not_mix():
    a, b, sa, _ = _operands()
    with pytest.raises(TypeError, match=r"quantization_scales\['b'\].*BlockScales too"):
        _call(a, b, sa, 1.0, False, True)


def test_unknown_block_is_refused():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match=r"\['a'\]\.block: expected one of"):
        _call(a, b, BlockScales(sa.values, "1x32"), sb, False, True)


@pytest.mark.parametrize("kw,match", [
    (dict(epilog="relu_bias"), "epilog: block-scaled calls run DEFAULT, BIAS"),
    (dict(out=jnp.float8_e4m3fn), "preferred_element_type: .*FP8 result"),
    (dict(result_amax=True), "result_amax"),
    (dict(fast_accumulation=True), "fast_accumulation"),
])
def test_options_block_scaling_does_not_take(kw, match):
    a, b, sa, sb = _operands()
    if kw.get("epilog") == "relu_bias":
        kw["bias"] = jnp.zeros(128, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        _call(a, b, sa, sb, False, True, **kw)


def test_batched_operands_and_vmap_are_refused():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="a: block-scaled calls take no leading"):
        _call(a[None], b, sa, sb, False, True)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda a: _call(a, b, sa, sb, False, True))(jnp.stack([a, a]))


def test_sharded_operands_give_the_unsharded_result():
    """Under a mesh a block-scaled call is bound whole (its scales are tiles, not scalars the
    partitioner could replicate): a sharded over 4×2 host devices, y to a rounding of the
    unsharded one (XLA may split K and sum the partial products in another order)."""
    import os
    import subprocess
    import sys
    code = (
        "import jax, numpy as np, jax_epilog\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('d', 'm'))\n"
        "x8, sx = jax_epilog.quantize_1x128(jax.random.normal(jax.random.key(0), (256, 256)))\n"
        "w8, sw = jax_epilog.quantize_128x128(jax.random.normal(jax.random.key(1), (128, 256)))\n"
        "f = jax.jit(lambda a, b, sa, sb: jax_epilog.matmul(\n"
        "    a, b, transpose_b=True, quantization_scales={'a': sa, 'b': sb}))\n"
        "whole = f(x8, w8, sx, sw)\n"
        "sharded = f(jax.device_put(x8, NamedSharding(mesh, P('d', 'm'))), w8, sx, sw)\n"
        "w, s = (np.asarray(y, np.float32) for y in (whole, sharded))\n"
        "assert np.all(np.abs(w - s) <= 2.0**-7 * np.abs(w) + 1e-3)  # K split: sum order\n"
        "print('ok')\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr[-2000:]


# --- the CUDA lowering (from this host) -----------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_cuda_lowering_calls_the_block_target(pair, monkeypatch):
    from jax_epilog.op import lowering
    monkeypatch.setattr(lowering.cuda_library, "query_support", lambda *a, **k: (True, ""))
    a, b, sa, sb = make(np.random.default_rng(0), 129, 100, 256, pair, True, False)
    f = jax.jit(lambda a, b, sa, sb: _call(a, b, sa, sb, True, False, backend="cublaslt"))
    text = f.trace(a, b, sa, sb).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "@jax_epilog_matmul_block(" in line)
    rows = {"1x128": 1, "128x128": 128}
    assert f"a_block_rows = {rows[pair[0]]} : i32" in call
    assert f"b_block_rows = {rows[pair[1]]} : i32" in call
    assert "transpose_a = false" in call and "transpose_b = true" in call  # TN, relaid in XLA
    # the scales in cuBLASLt's layout: inner dims padded to 4; N padded to 112 for b's rows;
    # a's rows to 144 (a multiple of 16) under 1x128 scales, with the scales
    want_a = "2x144xf32" if pair[0] == "1x128" else "2x4xf32"
    assert ("1x144x256xf8E4M3FN" if pair[0] == "1x128" else "1x129x256xf8E4M3FN") in call
    want_b = "2x112xf32" if pair[1] == "1x128" else "1x4xf32"
    assert want_a in call and want_b in call, call


def test_cuda_lowering_of_the_pallas_kernel(monkeypatch):
    """`kernel="pallas"` lowered for CUDA from this host (JAX's Triton lowering told it is on
    a Hopper GPU): every primitive of the kernel has a Triton lowering, and the module is one
    Triton call, with 4 warps where it quantizes x itself and 8 where it applies an activation
    (the measured best of each)."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    if not hasattr(registration, "gpu_info_lib"):
        pytest.skip("this jax asks the GPU's compute capability another way")
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    x = _hard_tiles(np.random.default_rng(0), 256, 384, jnp.bfloat16)
    for activation, warps in ((None, 4), ("gelu", 8)):
        f = jax.jit(lambda x: blocks.quantize_1x128_both(x, kernel="pallas",
                                                         activation=activation))
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1 and f"num_warps = {warps}" in text


# --- the GPU --------------------------------------------------------------------------------

GPU_SHAPES = [(256, 256, 512), (129, 384, 256), (1, 128, 128), (127, 130, 384)]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
@pytest.mark.parametrize("epilog", ["default", "bias"])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__)
def test_gpu_kernel_matches_the_model(pair, epilog, out):
    gpu = jax.devices("cuda")[0]
    rng = np.random.default_rng(11)
    shapes = GPU_SHAPES if out == jnp.bfloat16 else GPU_SHAPES[1:2]  # other results: odd rows
    for (m, n, k), (ta, tb) in itertools.product(shapes, LAYOUTS):
        a, b, sa, sb = make(rng, m, n, k, pair, ta, tb)
        bias = jnp.asarray(rng.standard_normal(n), out) if epilog == "bias" else None
        f = jax.jit(lambda a, b, sa, sb, bias: _call(a, b, sa, sb, ta, tb, epilog, bias,
                                                     out=out, backend="cublaslt"))
        args = jax.device_put((a, b, sa, sb, bias), gpu)
        if out == jnp.float32 and epilog == "bias":
            # Measured on the H200 (cuBLASLt 13.1): no block-scaled kernel with a bias and a
            # float32 result; the call runs the reference and says so.
            with pytest.warns(RuntimeWarning, match="runs no FP8 kernel for epilog BIAS"):
                text = f.lower(*args).as_text()
            assert "jax_epilog_matmul_block" not in text
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
                text = f.lower(*args).as_text()
            assert "jax_epilog_matmul_block" in text, (m, n, k, ta, tb)
        p, size = model(a, b, sa, sb, ta, tb, bias)
        # Hopper's FP8 tensor cores sum a 128-K block in reduced precision (about 14 bits),
        # then promote: float32 results measured up to 1.25 x 2**-12 of the terms' size.
        check(f(*args), p, size, out, slack=2.0**-11)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (1024, 4096)], ids=str)
def test_gpu_pallas_both_copies_match_xla_bytes(shape, monkeypatch):
    """The Pallas kernel (Triton) on the GPU writes exactly the XLA formulation's bytes,
    the transposed copy included (stored as uint8: Triton's transposed FP8 stores have
    miscompiled), and really runs as a Triton kernel."""
    gpu = jax.devices("cuda")[0]
    x = jax.device_put(_hard_tiles(np.random.default_rng(5), *shape, jnp.bfloat16), gpu)
    want = jax.jit(_both_copies_by_reference, static_argnums=1)(x, "float8_e4m3fn")
    monkeypatch.setattr(blocks, "BOTH_COPIES", "pallas")
    f = jax.jit(blocks.quantize_1x128_both)
    assert "triton" in f.lower(x).as_text()
    (x8, s), (xt8, st) = f(x)
    _same_bytes(((x8, s.values), (xt8, st.values)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,derivative", PROLOGUE_CASES[:3],
                         ids=[f"{a}{'-derivative' if d else ''}" for a, d in PROLOGUE_CASES[:3]])
def test_gpu_pallas_prologue_matches_the_separate_passes(activation, derivative, monkeypatch):
    """The Pallas kernel with a prologue on the GPU (Triton's tanh) against XLA's separate
    fusion and quantization on the GPU, and its column sums."""
    gpu = jax.devices("cuda")[0]
    rng = np.random.default_rng(6)
    x = jax.device_put(_hard_tiles(rng, 384, 512, jnp.bfloat16), gpu)
    z = jax.device_put(jnp.asarray(rng.standard_normal((384, 512)) * 3, jnp.bfloat16), gpu)
    written = jax.jit(_written, static_argnums=(2, 3))(x, z, activation, derivative)
    want = jax.jit(_both_copies_by_reference, static_argnums=1)(written, "float8_e4m3fn")
    f = jax.jit(functools.partial(blocks.quantize_1x128_both, kernel="pallas",
                                  activation=activation, column_sums=True))
    if derivative:
        f = jax.jit(functools.partial(blocks.quantize_1x128_both, kernel="pallas",
                                      activation=activation, pre_activation=z,
                                      column_sums=True))
    assert "triton" in f.lower(x).as_text()
    *copies, sums = f(x)
    _as_separate_passes(copies, want, written)
    np.testing.assert_allclose(sums, np.sum(np.asarray(written, np.float32), axis=0),
                               rtol=1e-3, atol=1e-2)


# --- the benchmark --------------------------------------------------------------------------

@pytest.mark.slow
def test_benchmark_smoke_report(tmp_path):
    """benchmarks/block_fp8_bench.py end to end on tiny shapes: every variant reported (the
    GEMMs, the training step's, the quantization's: the same bytes every way), the errors
    and their sweep finite and the targets judged (timings are never asserted)."""
    import json

    import block_fp8_bench

    block_fp8_bench.main(["--smoke", "--max-s", "5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "block_fp8.json").read_text())
    (row,) = report["speed"]
    assert set(row["variants"]) == set(block_fp8_bench.VARIANTS)
    for variant in row["variants"].values():
        assert variant["careful"]["seconds"] > 0 and variant["user"]["seconds"] > 0
    for data in ("ordinary", "outliers"):
        assert all(0 < e < 0.2 for e in report["errors"][data].values()), report["errors"]
    assert [e["factor"] for e in report["sweep"]] == list(block_fp8_bench.OUTLIER_FACTORS)
    assert set(report["step"]["variants"]) == set(block_fp8_bench.STEP_VARIANTS)
    # FP8 ran (no custom calls to count on a CPU): the step differs from XLA's by FP8 rounding
    step = report["step"]["variants"]
    assert 1e-3 < step["ours_fp8_block"]["relative_diff_vs_xla_bf16"] < 0.5
    # the quantization kernels change no bit of the step
    for variant in ("ours_fp8_block_separate", "ours_fp8_block_xla"):
        assert step[variant]["relative_diff_vs_xla_bf16"] == \
            step["ours_fp8_block"]["relative_diff_vs_xla_bf16"]
    quantize = report["quantize"]["variants"]
    assert list(quantize) == ["xla_separate", "xla", "pallas"]
    assert all(v["same_bytes_as_xla_separate"] and v["careful"]["seconds"] > 0
               for v in quantize.values())
    assert len(report["targets"]) == 4 + 4
    assert "## Targets" in (tmp_path / "block_fp8.md").read_text()


@pytest.mark.slow
def test_pallas_tuning_smoke_report(tmp_path):
    """benchmarks/pallas_tuning.py end to end on a tiny shape (the Pallas interpreter off the
    GPU, which ignores the warp count: what this checks is the report): every prologue and
    warp count timed and compared with the default."""
    import json

    import pallas_tuning

    pallas_tuning.main(["--smoke", "--max-s", "5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "pallas_tuning.json").read_text())
    assert len(report["cases"]) == len(pallas_tuning.PROLOGUES)
    for case in report["cases"]:
        assert list(case["variants"]) == ["xla"] + [f"pallas_w{w}" for w in pallas_tuning.WARPS]
        for v in case["variants"].values():
            assert v["same_bytes_as_default"] and v["careful"]["seconds"] > 0 \
                and v["user"]["seconds"] > 0
