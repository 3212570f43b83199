"""Block-scaled FP8 training, `Fp8(scaling="block")` (docs/fp8.md, "Block-scaled training"),
on the CPU, where every block-scaled `matmul` runs the exact reference.

`model_layer` below is an independent NumPy model of one layer's step: x in 1×128 tiles along
K, W in 128×128 blocks, dZ in 1×128 tiles along N for the data gradient, xᵀ and dZᵀ in 1×128
tiles along the tokens for the weight gradient, e4m3 everywhere, each tile's amax mapped to
448, exact dequantization and a float64 product. Values and gradients must match it to
float32 rounding, and differ from the unquantized layer by FP8 rounding only.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.float8 import blocks as quantization
from jax_epilog.layers import gating
from jax_epilog.op import activations
from jaxprs import equations
from test_layers import saved_residuals

BLOCK = Fp8(scaling="block", layers="all")
E4M3 = ml_dtypes.float8_e4m3fn


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


# --- the independent model ----------------------------------------------------------------

def _quantized(tiles):
    """`tiles` (..., 128-element tiles on the last axis, float32) quantized per tile and
    dequantized: q = 448 / amax in float32 (1 for a zero tile), a saturating e4m3 cast."""
    amax = np.max(np.abs(tiles), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        q = np.where(amax > 0, np.float32(448.0) / amax, np.float32(1.0)).astype(np.float32)
    x8 = np.clip(tiles * q, -448, 448).astype(E4M3)
    return x8.astype(np.float32) * (np.float32(1.0) / q)


def tiles_along_last(x):
    """x (rows, K) quantized per 1×128 tile along K."""
    rows, k = x.shape
    return _quantized(np.asarray(x, np.float32).reshape(rows, k // 128, 128)).reshape(rows, k)


def tiles_along_rows(x):
    """x (rows, K) quantized per 128×1 tile along the rows (zero-padded to a multiple of 128)."""
    rows = x.shape[0]
    padded = np.pad(np.asarray(x, np.float32), ((0, -rows % 128), (0, 0)))
    return tiles_along_last(padded.T).T[:rows]


def blocks(w):
    """w (K, N) quantized per 128×128 block."""
    k, n = w.shape
    b = np.asarray(w, np.float32).reshape(k // 128, 128, n // 128, 128).transpose(0, 2, 1, 3)
    q = _quantized(b.reshape(k // 128, n // 128, 128 * 128)).reshape(b.shape)
    return q.transpose(0, 2, 1, 3).reshape(k, n)


def _act(activation, z):
    """(act(z), act'(z)); GELU's in float32 as the layers compute it (its derivative is not
    what this file tests, and dZ must round to the same FP8 values)."""
    if activation == "relu":
        return np.maximum(z, 0), (z > 0).astype(np.float64)
    if activation == "gelu":
        z32 = jnp.asarray(z, jnp.float32)
        return (np.asarray(activations.gelu(z32), np.float64),
                np.asarray(activations.gelu_derivative(z32), np.float64))
    return z, np.ones_like(z)


def model_layer(x, w, b, activation, dy, z=None):
    """(y, dx, dW, db) of act(x W + b) under block scaling, float64 products. The backward
    takes act'(z) at `z` where given (the layer's own pre-activation, equal to the model's to
    float32 rounding: one ulp at a tile's largest dZ would move that whole tile's scale)."""
    f64 = lambda a: np.asarray(a, np.float64)
    z_model = (f64(tiles_along_last(x)) @ f64(blocks(w)) + f64(b)).astype(np.float32)
    if z is not None:
        _close(z, z_model, "z")
    y, _ = _act(activation, z_model.astype(np.float64))
    _, derivative = _act(activation, np.asarray(z_model if z is None else z, np.float64))
    dz = (f64(dy).astype(np.float32) * derivative.astype(np.float32)).astype(np.float32)
    dx = f64(tiles_along_last(dz)) @ f64(blocks(w)).T
    dw = f64(tiles_along_rows(x)).T @ f64(tiles_along_rows(dz))
    return y, dx, dw, dz.astype(np.float64).sum(axis=0)


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want)) + 1e-30
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale, err_msg=what)


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _layer(rng, rows, k, n):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return x, w, b


# --- one layer against the model, and against float32 --------------------------------------

@pytest.mark.parametrize("rows", [1, 127, 129])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_dense_matches_the_model(rows, activation):
    rng = np.random.default_rng(rows)
    x, w, b = _layer(rng, rows, 256, 384)
    dy = rng.standard_normal((rows, 384)).astype(np.float32)
    y, vjp = jax.vjp(lambda *a: jax_epilog.dense(*a, activation=activation, fp8=BLOCK), x, w, b)
    dx, dw, db = vjp(jnp.asarray(dy))
    z = jax_epilog.dense(x, w, b, fp8=BLOCK)
    want = model_layer(x, w, b, activation, dy, z)
    for what, got, ref in zip(("y", "dx", "dW", "db"), (y, dx, dw, db), want):
        _close(got, ref, what)
    # ... and FP8 rounding away from float32 autodiff: above float32's, within e4m3's (one
    # token's tiles along the tokens hold one value each, its tile's amax: dW is then exact
    # but for the activation's derivative at the quantized z).
    # Not for ReLU: its derivative flips sign wherever FP8 moved z across 0 (~2% of values),
    # a difference of the quantized forward, not of the gradient's GEMMs.
    if activation == "relu":
        return
    exact = lambda *a: jax_epilog.dense(*a, activation=activation)
    y32, vjp32 = jax.vjp(exact, x, w, b)
    for what, got, ref in zip(("y", "dx", "dW"), (y, dx, dw), (y32, *vjp32(jnp.asarray(dy)))):
        error = _relative(got, ref)
        exact_dw = (what, rows, activation) == ("dW", 1, None)
        assert (error < 1e-6 if exact_dw else 1e-3 * (rows > 1 or what != "dW") < error < 0.06), \
            (what, error)


def test_mlp_gradients_against_float32_autodiff():
    """A 3-layer GELU stack (smooth, so FP8 moves no derivative across a kink) with a loss
    on top: every gradient within 0.1 of float32 autodiff of the plain expression (relative
    Frobenius; FP8 rounding compounds over the layers), and no worse than per-tensor FP8's
    (measured here: 0.027-0.077 against 0.030-0.105)."""
    rng = np.random.default_rng(0)
    widths = (256, 384, 128, 256)
    x = rng.standard_normal((129, widths[0])).astype(np.float32)
    layers = [((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
               (0.1 * rng.standard_normal(n)).astype(np.float32))
              for k, n in zip(widths, widths[1:])]
    target = rng.standard_normal((129, widths[-1])).astype(np.float32)

    def loss(x, layers, fp8):
        return jnp.mean((jax_epilog.mlp(x, layers, activation="gelu", fp8=fp8) - target) ** 2)

    def plain(x, layers):
        h = x
        for i, (w, b) in enumerate(layers):
            h = h @ w + b
            h = jax.nn.gelu(h, approximate=True) if i + 1 < len(layers) else h
        return jnp.mean((h - target) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    want = jax.tree.leaves(jax.grad(plain, argnums=(0, 1))(x, layers))
    errors = {name: [_relative(g, w) for g, w in zip(jax.tree.leaves(grad(x, layers, fp8)), want)]
              for name, fp8 in (("block", BLOCK), ("tensor", Fp8(layers="all")))}
    for block, tensor in zip(errors["block"], errors["tensor"]):
        assert 1e-3 < block < 0.1 and block < 1.1 * tensor


def test_residuals_are_fp8():
    """What the backward keeps: x's transposed e4m3 copy, W's e4m3 blocks, their float32
    scales and the packed ReLU mask; never a 16/32-bit copy of x."""
    x, w, b = _layer(np.random.default_rng(1), 256, 256, 128)
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, b))
    saved = saved_residuals(lambda x, w, b: jax_epilog.dense(x, w, b, activation="relu",
                                                             fp8=BLOCK), x, w, b)
    assert ("f8_e4m3fn", (256, 256)) in saved  # xᵀ (K, tokens)
    assert ("f8_e4m3fn", (256, 128)) in saved  # W (K, N)
    assert ("u8", (256, 16)) in saved          # the ReLU mask, 1 bit per value
    wide = [s for s in saved if s[0] in ("bf16", "f32") and np.prod(s[1]) >= 256 * 128]
    assert not wide, saved


@pytest.mark.parametrize("both_copies", ["xla", "xla_separate", "pallas"])
def test_quantization_choice_holds_forward_and_backward(both_copies, monkeypatch):
    """`blocks.BOTH_COPIES` is read once when the stack is traced, and the backward's dZ runs
    the same way even where it is traced after the setting changed back (as the benchmark
    sets it around the forward alone): only "xla_separate" transposes a 16-bit x (forward)
    and dZ (backward), the others transpose 1-byte copies; the gradients are the same bits
    every way (on a CPU "pallas" is the XLA formulation)."""
    x, w, b = _layer(np.random.default_rng(4), 129, 256, 128)
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, b))

    def loss(x, w, b, both_copies):
        monkeypatch.setattr(quantization, "BOTH_COPIES", both_copies)
        y = jax_epilog.dense(x, w, b, activation="relu", fp8=BLOCK)
        monkeypatch.setattr(quantization, "BOTH_COPIES", "xla")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    jaxpr = jax.make_jaxpr(grad, static_argnums=3)(x, w, b, both_copies)
    transposed = [str(e.invars[0].aval.dtype) for e in equations(jaxpr)  # x (tokens, K), dZ
                  if e.primitive.name == "transpose"
                  and e.invars[0].aval.shape in ((256, 256), (256, 128))]
    wide = [t for t in transposed if t in ("bfloat16", "float32")]
    assert len(wide) == (2 if both_copies == "xla_separate" else 0), transposed
    assert transposed.count("float8_e4m3fn") == (0 if both_copies == "xla_separate" else 2)
    got = jax.jit(grad, static_argnums=3)(x, w, b, both_copies)
    want = jax.jit(grad, static_argnums=3)(x, w, b, "xla")
    for g, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_bfloat16_layer_is_block_scaled_fp8():
    """In bfloat16 the result differs from the bf16 layer by FP8 rounding (so FP8 ran)."""
    x, w, b = _layer(np.random.default_rng(2), 64, 128, 256)
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, b))
    y = jax.jit(lambda *a: jax_epilog.dense(*a, activation="relu", fp8=BLOCK))(x, w, b)
    assert y.dtype == jnp.bfloat16
    want = model_layer(*(np.asarray(a, np.float32) for a in (x, w, b)), "relu",
                       np.zeros((64, 256), np.float32))[0]
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-7, atol=2**-7)
    assert _relative(y, jax_epilog.dense(x, w, b, activation="relu")) > 1e-3


# --- which layers, and what is refused ------------------------------------------------------

def test_auto_runs_narrow_or_small_layers_in_the_compute_dtype():
    """`layers="auto"`: a 10-wide head (not a multiple of 128) stays in the compute dtype; so
    does every layer of a stack too small for FP8 to pay."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    layers = [(rng.standard_normal((128, 10)).astype(np.float32), None)]
    auto = Fp8(scaling="block")
    np.testing.assert_array_equal(jax_epilog.mlp(x, layers, fp8=auto),
                                  jax_epilog.mlp(x, layers))
    from jax_epilog.planning import block_plan

    def choices(rows, widths):
        return [g.choice.choice for g in
                block_plan.block_stack_plan(auto, rows, widths, "bfloat16").gemms]

    assert choices(65536, (4096, 4096, 10)) == ["fp8", "bf16"]
    assert choices(64, (128, 128)) == ["bf16"]


@pytest.mark.parametrize("widths, match", [
    ((100, 128), r"^x: .*features \(last axis\) a multiple of 128.*got 100; zero-pad it to 128"),
    ((128, 96), r"^layers\[0\] kernel: .*columns N a multiple of 128.*got 96")])
def test_widths_not_multiples_of_128_are_refused(widths, match):
    x = jnp.ones((4, widths[0]), jnp.float32)
    w = jnp.ones(widths, jnp.float32)
    with pytest.raises(ValueError, match=match):
        jax_epilog.dense(x, w, fp8=BLOCK)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gradient="float8_e5m2"), r"^gradient: .*float8_e4m3fn"),
    (dict(margin=1), r"^margin: "),
    (dict(amax_reduction_axes="data"), r"^amax_reduction_axes: ")])
def test_block_config_refuses_what_it_has_no_use_for(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8(scaling="block", **kwargs)


def test_block_config_keeps_no_state_and_gradients_are_e4m3():
    fp8 = Fp8(scaling="block")
    assert fp8.gradient == "float8_e4m3fn" and Fp8().gradient == "float8_e5m2"
    assert not fp8.keeps_state and not fp8.delayed and fp8.resolved(True) is fp8
    x, w = jnp.ones((4, 128)), jnp.ones((128, 128))
    with pytest.raises(ValueError, match=r"^fp8_state: .*keeps no state"):
        jax_epilog.dense(x, w, fp8=fp8, fp8_state=Fp8().init_state(1))


# --- Flax: a training step, and checkpoint/resume ------------------------------------------

def _sgd_steps(loss, params, steps):
    step = jax.jit(lambda p: jax.tree.map(lambda v, g: v - 0.05 * g, p, jax.grad(loss)(p)))
    for _ in range(steps):
        params = step(params)
    return params


def test_linen_trains_and_resumes_exactly():
    """Linen `MLP(fp8=Fp8(scaling="block"))`: only "params" (no amax collection); three
    steps equal two steps, a checkpoint round trip, then one more, bit for bit."""
    pytest.importorskip("flax.linen")
    from flax import serialization

    from jax_epilog import linen as fused_linen

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((129, 128)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((129, 128)), jnp.float32)
    model = fused_linen.MLP((256, 128), fp8=BLOCK)
    variables = model.init(jax.random.key(0), x)
    assert variables.keys() == {"params"}
    loss = lambda v: jnp.mean((model.apply(v, x) - target) ** 2)
    straight = _sgd_steps(loss, variables, 3)
    saved = serialization.to_bytes(_sgd_steps(loss, variables, 2))
    resumed = _sgd_steps(loss, serialization.from_bytes(variables, saved), 1)
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)
    assert float(loss(straight)) < float(loss(variables))


def test_nnx_trains_and_resumes_exactly():
    nnx = pytest.importorskip("flax.nnx")
    from jax_epilog import nnx as fused_nnx

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((127, 128)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((127, 128)), jnp.float32)
    model = fused_nnx.MLP(128, [256, 128], fp8=BLOCK, rngs=nnx.Rngs(0))
    assert all(layer.fp8_state() is None for layer in model.layers)
    graph, params = nnx.split(model, nnx.Param)
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(params)  # no histories

    def loss(p):
        return jnp.mean((nnx.merge(graph, p)(x) - target) ** 2)

    straight = _sgd_steps(loss, params, 3)
    checkpoint = jax.tree.map(np.asarray, _sgd_steps(loss, params, 2))
    resumed = _sgd_steps(loss, jax.tree.map(jnp.asarray, checkpoint), 1)
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)
    assert float(loss(straight)) < float(loss(params))


# --- the SwiGLU block ----------------------------------------------------------------------

def model_swiglu(x, gate, up, down, dy, gu, dh):
    """(y, dx, dgate, dup, ddown) of `down(silu(x gate) * (x up))` under block scaling, float64
    products: x, h = silu(g)·u, dy and `[dg du]` in 1×128 tiles along their features for the
    forward and data-gradient GEMMs and along the tokens for the weight gradients, the kernels
    in 128×128 blocks, g and u kept in 1×128 tiles for the backward, e4m3 everywhere.

    `gu` and `dh` are the block's own `[g u]` and dh, checked against the model's GEMMs, and
    h and `[dg du]` come from the block's own elementwise functions: one float32 ulp in a
    value that is quantized again moves its rounding or its whole tile's scale (XLA fuses
    with FMAs and sums in another order), and what this file tests is the quantization and
    the GEMMs, as `model_layer` takes GELU from the layers."""
    f32, f64 = (lambda a: np.asarray(a, np.float32)), (lambda a: np.asarray(a, np.float64))
    kernel = np.concatenate([gate, up], 1)
    f = gate.shape[1]
    _close(gu, f64(tiles_along_last(x)) @ f64(blocks(kernel)), "[g u]")
    _close(dh, f64(tiles_along_last(dy)) @ f64(blocks(down)).T, "dh")
    h = f32(jax.jit(gating.hidden, static_argnums=1)(f32(gu), f))
    y = f64(tiles_along_last(h)) @ f64(blocks(down))
    ddown = f64(tiles_along_rows(h)).T @ f64(tiles_along_rows(dy))
    g, u = tiles_along_last(f32(gu[:, :f])), tiles_along_last(f32(gu[:, f:]))
    dgu = f32(jax.jit(gating.hidden_gradient, static_argnums=3)(f32(dh), g, u, jnp.float32))
    dx = f64(tiles_along_last(dgu)) @ f64(blocks(kernel)).T
    dkernel = f64(tiles_along_rows(x)).T @ f64(tiles_along_rows(dgu))
    return y, dx, dkernel[:, :f], dkernel[:, f:], ddown


def _own_gemms(x, gate, up, down, dy):
    """The block's `[g u]` and dh, by the same public calls it makes."""
    kernel = np.concatenate([gate, up], 1)
    gu = jax_epilog.dense(x, kernel, fp8=BLOCK)
    dy8, sdy = quantization.quantize_1x128(jnp.asarray(dy))
    down8, sdown = quantization.quantize_128x128(jnp.asarray(down))
    dh = jax_epilog.matmul(dy8, down8, transpose_b=True,
                           quantization_scales={"a": sdy, "b": sdown},
                           preferred_element_type=jnp.float32)
    return gu, dh


def _swiglu_block(rng, rows, d, f, d_out):
    x = rng.standard_normal((rows, d)).astype(np.float32)
    gate, up = ((rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((f, d_out)) / np.sqrt(f)).astype(np.float32)
    dy = rng.standard_normal((rows, d_out)).astype(np.float32)
    return x, gate, up, down, dy


def _plain_swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


@pytest.mark.parametrize("rows,d,f,d_out", [(1, 128, 256, 128), (127, 256, 128, 384),
                                            (129, 128, 384, 256)])
def test_swiglu_matches_the_model(rows, d, f, d_out):
    x, gate, up, down, dy = _swiglu_block(np.random.default_rng(rows), rows, d, f, d_out)
    block = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=BLOCK)
    y, vjp = jax.vjp(block, x, gate, up, down)
    got = (y, *vjp(jnp.asarray(dy)))
    exact = jax.vjp(_plain_swiglu, x, gate, up, down)
    for what, g, want, plain in zip(("y", "dx", "dgate", "dup", "ddown"), got,
                                    model_swiglu(x, gate, up, down, dy,
                                                 *_own_gemms(x, gate, up, down, dy)),
                                    (exact[0], *exact[1](jnp.asarray(dy)))):
        _close(g, want, what)
        # and FP8 rounding away from float32 autodiff (so the model comparison can fail)
        assert 1e-3 < _relative(g, plain) < 0.1, (what, _relative(g, plain))


def test_swiglu_block_scaled_gradients_are_no_worse_than_per_tensor():
    """Against float32 autodiff of the plain block, on a loss, with 4 of x's 256 features
    ×1000 (the outliers block scaling is for): every gradient's error no larger than
    per-tensor FP8's (here 0.053-0.069 against 0.060-0.101)."""
    rng = np.random.default_rng(11)
    x, gate, up, down, _ = _swiglu_block(rng, 256, 256, 384, 256)
    x[:, rng.choice(256, 4, replace=False)] *= 1000.0
    target = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.mean((fn(*a) - target) ** 2)

    want = jax.grad(loss(_plain_swiglu), argnums=(0, 1, 2, 3))(x, gate, up, down)
    errors = {}
    for name, fp8 in (("block", BLOCK), ("tensor", Fp8(layers="all"))):
        fn = lambda x, g, u, w, fp8=fp8: jax_epilog.swiglu(x, (g, u), w, fp8=fp8)
        got = jax.grad(loss(fn), argnums=(0, 1, 2, 3))(x, gate, up, down)
        errors[name] = [_relative(g, w) for g, w in zip(got, want)]
    for block, tensor in zip(errors["block"], errors["tensor"]):
        assert block <= tensor, errors


def test_swiglu_residuals_are_fp8():
    """What the backward keeps: x's and h's transposed e4m3 copies, g and u in e4m3, both
    kernels' e4m3 blocks and float32 scales; never a 16/32-bit activation."""
    rows, d, f = 256, 128, 384
    x, gate, up, down, _ = _swiglu_block(np.random.default_rng(2), rows, d, f, d)
    x, gate, up, down = (jnp.asarray(a, jnp.bfloat16) for a in (x, gate, up, down))
    saved = saved_residuals(lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=BLOCK),
                            x, gate, up, down)
    arrays = sorted(s for s in saved if s[0] != "f32")
    assert arrays == sorted([("f8_e4m3fn", (d, rows)), ("f8_e4m3fn", (rows, f)),
                             ("f8_e4m3fn", (rows, f)), ("f8_e4m3fn", (f, rows)),
                             ("f8_e4m3fn", (d, 2 * f)), ("f8_e4m3fn", (f, d))]), saved
    assert all(np.prod(shape) <= rows * f // 64 for dtype, shape in saved if dtype == "f32")


@pytest.mark.parametrize("d,f,d_out,match", [
    (100, 128, 128, r"^x: .*D, its features \(last axis\) a multiple of 128.*got 100; "
                    r"zero-pad it to 128"),
    (128, 200, 128, r"^gate_up: .*F, its columns a multiple of 128.*got 200"),
    (128, 128, 96, r"^down: .*D_out, its columns a multiple of 128.*got 96"),
])
def test_swiglu_widths_not_multiples_of_128_are_refused_or_run_in_the_compute_dtype(
        d, f, d_out, match):
    x, gate, up, down, _ = _swiglu_block(np.random.default_rng(3), 8, d, f, d_out)
    with pytest.raises(ValueError, match=match):
        jax_epilog.swiglu(x, (gate, up), down, fp8=BLOCK)
    auto = jax_epilog.swiglu(x, (gate, up), down, fp8=Fp8(scaling="block"))
    np.testing.assert_allclose(auto, _plain_swiglu(x, gate, up, down), rtol=1e-5, atol=1e-5)


def test_swiglu_block_scaling_keeps_no_state_and_the_modules_run_it():
    from flax import nnx

    from jax_epilog import linen as fused_linen
    from jax_epilog import nnx as fused_nnx

    rows, d, f = 129, 128, 256
    x, *_ = _swiglu_block(np.random.default_rng(4), rows, d, f, d)
    with pytest.raises(ValueError, match=r"fp8_state: .*keeps no state"):
        jax_epilog.swiglu(x, jnp.ones((d, 2 * f)), jnp.ones((f, d)), fp8=BLOCK,
                          fp8_state=Fp8().init_state(2))
    block = fused_nnx.SwiGLU(d, f, fp8=BLOCK, rngs=nnx.Rngs(0))
    assert block.fp8_state() is None
    graph, params = nnx.split(block, nnx.Param)
    assert jax.tree.structure(nnx.state(block)) == jax.tree.structure(params)  # no histories
    want = jax_epilog.swiglu(x, (block.gate.kernel[...], block.up.kernel[...]),
                             block.down.kernel[...], fp8=BLOCK)
    np.testing.assert_array_equal(block(x), want)
    linen_block = fused_linen.SwiGLU(f, fp8=BLOCK)
    variables = linen_block.init(jax.random.key(0), x)
    assert set(variables) == {"params"}
    p = variables["params"]
    np.testing.assert_array_equal(
        linen_block.apply(variables, x),
        jax_epilog.swiglu(x, (p["gate"]["kernel"], p["up"]["kernel"]), p["down"]["kernel"],
                          fp8=BLOCK))


# --- on the GPU: the three GEMMs run cuBLASLt's block-scaled kernel ---------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 129, 2048])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_gpu_layer_runs_the_kernels_and_matches_the_cpu(rows, activation):
    """bfloat16, as training runs it: every GEMM of the step is the block-scaled custom call
    (no reference fallback), and the step equals the CPU's (the exact reference) within the
    kernel's accumulation and one bf16 rounding."""
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    rng = np.random.default_rng(rows)
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in _layer(rng, rows, 512, 384))
    dy = jnp.asarray(rng.standard_normal((rows, 384)), jnp.bfloat16)

    def step(x, w, b, dy):
        y, vjp = jax.vjp(lambda *a: jax_epilog.dense(*a, activation=activation, fp8=BLOCK),
                         x, w, b)
        return (y, *vjp(dy))

    args = (x, w, b, dy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
        lowered = jax.jit(step).lower(*jax.device_put(args, gpu))
    assert "jax_epilog_matmul_block" in lowered.as_text()
    run = lambda device, *a: jax.jit(step)(*jax.device_put(a, device))
    if activation == "relu":
        # Where the two forwards round a pre-activation to opposite sides of 0, the ReLU masks
        # differ and so does dZ there (one such row moved dx by 3% on the H200): dy is zeroed
        # there, so the gradients compare the GEMMs, not the kink.
        same = ((np.asarray(run(gpu, *args)[0], np.float32) > 0)
                == (np.asarray(run(cpu, *args)[0], np.float32) > 0))
        args = (x, w, b, jnp.where(same, dy, 0).astype(dy.dtype))
    got, want = run(gpu, *args), run(cpu, *args)
    for what, g, r in zip(("y", "dx", "dW", "db"), got, want):
        error = _relative(g, r)
        assert error < 2e-2, (what, error)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 129, 2048])
def test_gpu_swiglu_runs_the_kernels_and_matches_the_cpu(rows):
    """The block-scaled SwiGLU block in bfloat16: its six GEMMs are the block-scaled custom
    call (no reference fallback), and its step equals the CPU's (the exact reference) within
    the kernels' accumulation and bf16 rounding."""
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    args = tuple(jnp.asarray(a, jnp.bfloat16)
                 for a in _swiglu_block(np.random.default_rng(rows), rows, 512, 384, 256))

    def step(x, gate, up, down, dy):
        y, vjp = jax.vjp(lambda *a: jax_epilog.swiglu(a[0], a[1:3], a[3], fp8=BLOCK),
                         x, gate, up, down)
        return (y, *vjp(dy))

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
        lowered = jax.jit(step).lower(*jax.device_put(args, gpu))
    assert lowered.as_text().count("jax_epilog_matmul_block") >= 6
    run = lambda device: jax.jit(step)(*jax.device_put(args, device))
    for what, g, r in zip(("y", "dx", "dgate", "dup", "ddown"), run(gpu), run(cpu)):
        error = _relative(g, r)
        assert error < 2e-2, (what, error)


def test_layer_without_bias_equals_a_zero_bias():
    x, w, _ = _layer(np.random.default_rng(6), 129, 128, 256)
    dy = jnp.asarray(np.random.default_rng(7).standard_normal((129, 256)), jnp.float32)
    plain = jax.vjp(lambda x, w: jax_epilog.dense(x, w, activation="relu", fp8=BLOCK), x, w)
    zero = jax.vjp(lambda x, w: jax_epilog.dense(x, w, jnp.zeros(256), activation="relu",
                                                 fp8=BLOCK), x, w)
    np.testing.assert_array_equal(plain[0], zero[0])
    for got, want in zip(plain[1](dy), zero[1](dy)):
        np.testing.assert_array_equal(got, want)


def test_remat_policy_keeps_the_named_residuals():
    """Under `jax.checkpoint` with a names policy, the block layer's mask and FP8 input copy
    are saved by their names (as the other layers' are), and the gradient is unchanged."""
    from jax_epilog.layers.gemms import LAYER_INPUT_NAME, RELU_MASK_NAME

    x, w, b = _layer(np.random.default_rng(8), 256, 128, 256)
    layer = lambda x, w, b: jnp.sum(jax_epilog.dense(x, w, b, activation="relu", fp8=BLOCK))
    policy = jax.checkpoint_policies.save_only_these_names(RELU_MASK_NAME, LAYER_INPUT_NAME)
    saved = saved_residuals(jax.checkpoint(layer, policy=policy), x, w, b)
    assert ("u8", (256, 32)) in saved and ("f8_e4m3fn", (128, 256)) in saved, saved
    got = jax.grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1, 2))(x, w, b)
    for g, want in zip(got, jax.grad(layer, argnums=(0, 1, 2))(x, w, b)):
        np.testing.assert_array_equal(g, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [129, 2048])
def test_gpu_gelu_stack_fuses_the_activation_into_the_quantization(rows, monkeypatch):
    """A two-layer GELU stack in bfloat16 on the GPU: the hidden activation is applied where
    the Pallas kernel quantizes the second layer's input, and gelu' where it quantizes dZ
    (with the bias gradient's column sums), so no 16-bit act(Z) or dZ fusion precedes it;
    the step equals the CPU's (the exact reference) within the kernels' rounding."""
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    monkeypatch.setattr(quantization, "BOTH_COPIES", "pallas")
    rng = np.random.default_rng(rows)
    x, w1, b1 = (jnp.asarray(a, jnp.bfloat16) for a in _layer(rng, rows, 512, 384))
    _, w2, b2 = (jnp.asarray(a, jnp.bfloat16) for a in _layer(rng, rows, 384, 256))
    dy = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)

    def step(x, w1, b1, w2, b2, dy):
        y, vjp = jax.vjp(lambda x, w1, b1, w2, b2: jax_epilog.mlp(
            x, [(w1, b1), (w2, b2)], activation="gelu", fp8=BLOCK), x, w1, b1, w2, b2)
        return (y, *vjp(dy))

    args = (x, w1, b1, w2, b2, dy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
        text = jax.jit(step).lower(*jax.device_put(args, gpu)).as_text()
    assert text.count("jax_epilog_matmul_block") >= 6 and "triton" in text
    run = lambda device: jax.jit(step)(*jax.device_put(args, device))
    got, want = run(gpu), run(cpu)
    for what, g, r in zip(("y", "dx", "dW1", "db1", "dW2", "db2"), got, want):
        error = _relative(g, r)
        assert error < 3e-2, (what, error)
