"""FP8 training of stock Flax layers (`jax_epilog.linen.Fp8DotGeneral`, `jax_epilog.nnx.
Fp8DotGeneral` / `Fp8Einsum`, `fp8_training`): the product against the quantized math in
float32 (operands quantized per tensor in NumPy, products and sums exact), against Flax's own
`fp8_ops` (same quantization, same state), the state across steps, training steps under jit
with optax, and the fallbacks and errors.

Per-tensor quantization is elementwise with one scale, so the quantized reference of any
`dot_general` is `dot_general` of the dequantized operands, whatever the dimension numbers:
that checks the mapping onto the GEMM without repeating it.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.linen import fp8_ops
from flax.training import train_state

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.float8.scaling import uncalibrated
from jax_epilog.layers.stock_fp8 import STATE_NAMES, fp8_dot_general, init_state

ALL = Fp8(layers="all", scaling="current")
OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
HIGHEST = jax.lax.Precision.HIGHEST


def _random(seed, *shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) * (1 + i) for i, (k, s) in
            enumerate(zip(keys, shapes))]


def _qdq(x, dtype):
    """x quantized per tensor (current scaling, the largest |x| to the format's largest) and
    dequantized, in NumPy."""
    x = np.asarray(x, np.float32)
    largest = float(ml_dtypes.finfo(dtype).max)
    q = np.float32(largest / np.abs(x).max())
    x8 = np.clip(x * q, -largest, largest).astype(dtype)
    return x8.astype(np.float32) / q


def _reference(lhs, rhs, dn, dy):
    """(y, dlhs, drhs) of the quantized math: e4m3 operands, the e5m2 gradient, exact sums."""
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    return _exact(_qdq(lhs, e4m3), _qdq(rhs, e4m3), dn, _qdq(dy, e5m2))


@functools.partial(jax.jit, static_argnums=(2,))
def _exact(lhs, rhs, dn, dy):
    dot = lambda a, b: jax.lax.dot_general(a, b, dn, precision=HIGHEST)
    y, vjp = jax.vjp(dot, lhs, rhs)
    return (y, *vjp(dy))


@functools.partial(jax.jit, static_argnums=(2,))
def _ours(lhs, rhs, dn, dy):
    y, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, dn, fp8=ALL), lhs, rhs)
    return (y, *vjp(dy))


def _close(got, want, rtol=2e-6):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


# --- the product against the quantized math ---------------------------------------------------

@pytest.mark.parametrize("m, k, n", [(1, 127, 129), (129, 1, 127), (127, 129, 1)])
def test_dense_product_and_gradients_are_the_quantized_math(m, k, n):
    x, w, dy = _random(0, (m, k), (k, n), (m, n))
    dn = (((1,), (0,)), ((), ()))
    _close(_ours(x, w, dn, dy), _reference(x, w, dn, dy))


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn", [
    # DenseGeneral: batch dim 0, two contracting dims not last, the kernel's in another order
    ((3, 5, 7, 4), (3, 4, 5, 6), (((1, 3), (2, 1)), ((0,), (0,)))),
    # leading dims folded into M (nn.Dense on a rank-3 input)
    ((2, 3, 9), (9, 5), (((2,), (0,)), ((), ()))),
    # the kernel's contracting dim last ("bd,nd->bn"), two batch dims
    ((2, 3, 4, 8), (3, 2, 6, 8), (((3,), (3,)), ((1, 0), (0, 1)))),
])
def test_general_dimension_numbers_are_the_quantized_math(lhs_shape, rhs_shape, dn):
    lhs, rhs = _random(1, lhs_shape, rhs_shape)
    y_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs).shape
    dy, = _random(2, y_shape)
    _close(_ours(lhs, rhs, dn, dy), _reference(lhs, rhs, dn, dy))


def test_within_fp8_rounding_of_the_unquantized_product():
    x, w, dy = _random(3, (64, 96), (96, 48), (64, 48))
    dn = (((1,), (0,)), ((), ()))
    want = [np.asarray(v, np.float64) for v in (x @ w, dy @ w.T, x.T @ dy)]
    for got, ref, bits in zip(_ours(x, w, dn, dy), want, (4, 3, 3)):
        # e4m3 keeps 3 mantissa bits, e5m2 2: each product is off by ~2**-bits relative
        assert np.abs(np.asarray(got) - ref).max() < 2.0**-bits * np.abs(ref).max()


def test_bfloat16_operands_give_bfloat16_results_and_gradients():
    x, w, dy = (a.astype(jnp.bfloat16) for a in _random(4, (16, 32), (32, 16), (16, 16)))
    y, dx, dw = _ours(x, w, (((1,), (0,)), ((), ())), dy)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    f32 = _reference(x.astype(jnp.float32), w.astype(jnp.float32), (((1,), (0,)), ((), ())),
                     dy.astype(jnp.float32))
    _close((y, dx, dw), f32, rtol=2**-7)


# --- Linen: against Flax's own FP8 op ---------------------------------------------------------

def _dense(cls, features=24):
    return nn.Dense(features, dot_general_cls=functools.partial(cls, amax_history_length=4))


def _steps(model, variables, x, steps):
    """`steps` gradient steps' gradients, the state overwritten by its gradient each step."""
    grad = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))
    out = []
    for _ in range(steps):
        grads = grad(variables)
        variables = {**variables, OWG: grads[OWG]}
        out.append(grads)
    return out


def test_linen_dense_matches_flax_fp8_and_keeps_flax_state():
    """Flax's recipe (delayed scaling, a cold history giving scale 1 under `uncalibrated`):
    the same gradients and, step by step, the same state, rolled as Flax rolls it."""
    x, = _random(5, (3, 127))
    ours = _dense(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=Fp8(layers="all")))
    flax = _dense(fp8_ops.Fp8DirectDotGeneralOp)
    v_ours, v_flax = ours.init(jax.random.key(0), x), flax.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, v_ours[OWG]["Fp8DotGeneral_0"]) == \
        jax.tree.map(jnp.shape, v_flax[OWG]["Fp8DirectDotGeneralOp_0"])
    with uncalibrated():
        got, want = _steps(ours, v_ours, x, 5), _steps(flax, v_flax, x, 5)
    for g, w in zip(got, want):
        _close(jax.tree.leaves(g["params"]), jax.tree.leaves(w["params"]), rtol=1e-6)
        _close([g[OWG]["Fp8DotGeneral_0"][n] for n in STATE_NAMES],
               [w[OWG]["Fp8DirectDotGeneralOp_0"][n] for n in STATE_NAMES], rtol=1e-6)
    history = got[-1][OWG]["Fp8DotGeneral_0"]["input_amax_history"]
    assert np.all(np.asarray(history) == float(jnp.max(jnp.abs(x))))  # 5 steps filled 4


def test_delayed_scaling_calibrates_a_cold_history_where_flax_saturates():
    """Inputs past e4m3's largest value (448): Flax's first step quantizes with scale 1 and
    clips them; ours takes the scale from this step's amax (`scaling.quantize_delayed`)."""
    x, = _random(6, (8, 64))
    x = x * 1000.0
    ours = _dense(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=Fp8(layers="all")))
    v = ours.init(jax.random.key(0), x)
    exact = nn.Dense(24).apply({"params": v["params"]}, x)
    flax = _dense(fp8_ops.Fp8DirectDotGeneralOp)
    err = lambda y: float(jnp.abs(y - exact).max() / jnp.abs(exact).max())
    assert err(ours.apply(v, x)) < 2**-4 < err(flax.apply(flax.init(jax.random.key(0), x), x))
    # Applied without the FP8 collection, "auto" scaling is current scaling: no state needed.
    assert err(ours.apply({"params": v["params"]}, x)) < 2**-4


def test_linen_einsum_matches_flax_fp8_einsum():
    x, w = _random(7, (4, 3, 32), (3, 32, 16))
    ours, flax = jax_epilog.linen.Fp8Einsum(fp8=Fp8(layers="all")), fp8_ops.Fp8Einsum()
    run = lambda m, v: m.apply(v, "bhd,hdn->bn", x, w)
    with uncalibrated():
        y_ours = run(ours, ours.init(jax.random.key(0), "bhd,hdn->bn", x, w))
        y_flax = run(flax, flax.init(jax.random.key(0), "bhd,hdn->bn", x, w))
    _close([y_ours], [y_flax], rtol=1e-6)


def test_linen_dense_general_with_batch_and_two_contracting_dims():
    x, = _random(8, (3, 5, 4, 7))
    layer = lambda cls: nn.DenseGeneral((2, 6), axis=(1, 3), batch_dims=(0,),
                                        dot_general_cls=cls)
    ours = layer(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=ALL))
    v = ours.init(jax.random.key(0), x)
    kernel = v["params"]["kernel"]  # (3, 5, 7, 2, 6)
    assert OWG not in v  # current scaling keeps no state
    dn = (((1, 3), (1, 2)), ((0,), (0,)))
    want = jax.lax.dot_general(jnp.asarray(_qdq(x, ml_dtypes.float8_e4m3fn)),
                               jnp.asarray(_qdq(kernel, ml_dtypes.float8_e4m3fn)), dn,
                               precision=HIGHEST)
    _close([ours.apply(v, x)], [want + v["params"]["bias"][:, None]])


def test_linen_train_state_step_under_jit_updates_the_state():
    """flax.training.train_state overwrites the FP8 collection with its gradient, as for
    Flax's own FP8 ops; the parameters take optax's update."""
    x, target = _random(9, (16, 48), (16, 24))
    model = _dense(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=Fp8(layers="all")))
    variables = model.init(jax.random.key(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.adam(1e-2))

    @jax.jit
    def step(state):
        loss = lambda p: jnp.mean((state.apply_fn(p, x) - target) ** 2)
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    state, first = step(state)
    for _ in range(3):
        state, value = step(state)
    histories = state.params[OWG]["Fp8DotGeneral_0"]
    assert float(histories["input_amax_history"][0]) == float(jnp.abs(x).max())
    assert float(histories["output_grad_amax_history"][0]) > 0
    assert float(value) < float(first)


# --- NNX ----------------------------------------------------------------------------------------

def test_nnx_linear_trains_with_optax_and_overwrites_its_state():
    x, target = _random(10, (8, 32), (8, 16))
    OWGV = jax_epilog.nnx.OverwriteWithGradient
    model = nnx.Linear(32, 16, rngs=nnx.Rngs(0), dot_general=jax_epilog.nnx.Fp8DotGeneral(
        fp8=Fp8(layers="all"), amax_history_length=3))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss = lambda m: jnp.mean((m(x) - target) ** 2)
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(
            0, nnx.Any(nnx.Param, OWGV)))(model)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        jax_epilog.nnx.overwrite_with_gradient(model, grads)
        return value

    losses = [float(step(model, optimizer)) for _ in range(4)]
    assert losses[-1] < losses[0]
    history = np.asarray(model.dot_general.kernel_amax_history[...])
    assert np.all(history > 0)  # 4 steps filled 3
    assert float(model.dot_general.input_amax_history[...][0]) == float(jnp.abs(x).max())


def test_nnx_linear_general_and_einsum_are_the_quantized_math():
    x, = _random(11, (5, 3, 8))
    rngs = nnx.Rngs(0)
    general = nnx.LinearGeneral((3, 8), (4, 2), axis=(-2, -1), use_bias=False, rngs=rngs,
                                dot_general=jax_epilog.nnx.Fp8DotGeneral(fp8=ALL))
    einsum = nnx.Einsum("bhd,hdn->bn", (3, 8, 6), None, rngs=rngs,
                        einsum_op=jax_epilog.nnx.Fp8Einsum(fp8=ALL))
    e4m3 = ml_dtypes.float8_e4m3fn
    xq = jnp.asarray(_qdq(x, e4m3))
    for layer, eqn in ((general, "bhd,hdnm->bnm"), (einsum, "bhd,hdn->bn")):
        want = jnp.einsum(eqn, xq, jnp.asarray(_qdq(layer.kernel[...], e4m3)),
                          precision=HIGHEST)
        _close([layer(x)], [want])


# --- fallbacks and errors -----------------------------------------------------------------------

def test_integer_operands_run_16_bit_with_a_warning_naming_the_layer_or_raise_strictly():
    x = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    w = jnp.ones((4, 2), jnp.int32)
    dn = (((1,), (0,)), ((), ()))
    with pytest.warns(jax_epilog.nnx.Fp8FallbackWarning, match=r"blocks/0/up .*int32"):
        y = fp8_dot_general(x, w, dn, fp8=ALL, name="blocks/0/up")
    np.testing.assert_array_equal(y, x @ w)
    with pytest.raises(ValueError, match=r"blocks/0/up \(int32.*\): cannot run in FP8 .*int32"):
        fp8_dot_general(x, w, dn, fp8=ALL, name="blocks/0/up", strict=True)


def test_small_gemm_under_auto_runs_16_bit_and_says_how_to_force_fp8():
    x, w = _random(12, (2, 8), (8, 3))
    with pytest.warns(jax_epilog.linen.Fp8FallbackWarning, match=r'layers="all"'):
        y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), fp8=Fp8(scaling="current"),
                            name="tiny")
    np.testing.assert_allclose(y, x @ w, rtol=1e-6)
    state = init_state(2)  # the 16-bit fallback hands the state back as its gradient
    grad = jax.grad(lambda s: fp8_dot_general(x, w, (((1,), (0,)), ((), ())), fp8=Fp8(),
                                              state=s, name="tiny").sum())(state)
    assert all(np.array_equal(grad[n], state[n]) for n in STATE_NAMES)


def test_linen_init_does_not_warn_of_the_auto_rule_on_its_sample_shapes():
    model = nn.Dense(8, dot_general_cls=jax_epilog.linen.Fp8DotGeneral)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        variables = model.init(jax.random.key(0), jnp.ones((1, 24)))
        jax_epilog.linen.fp8_training(model).init(jax.random.key(0), jnp.ones((1, 24)))
    with pytest.warns(jax_epilog.linen.Fp8FallbackWarning, match=r"Fp8DotGeneral_0 .*\[1, 24\]"):
        model.apply(variables, jnp.ones((1, 24)))


def test_current_scaling_hands_a_given_state_back_unchanged():
    x, w = _random(16, (4, 16), (16, 16))
    state = init_state(3)
    grad = jax.grad(lambda s: fp8_dot_general(x, w, (((1,), (0,)), ((), ())), fp8=ALL,
                                              state=s).sum())(state)
    assert all(np.array_equal(grad[n], state[n]) for n in STATE_NAMES)


def test_public_names():
    for module in (jax_epilog.linen, jax_epilog.nnx):
        for name in ("Fp8DotGeneral", "Fp8Einsum", "Fp8FallbackWarning", "fp8_training"):
            assert name in module.__all__ and getattr(module, name) is not None
    assert jax_epilog.nnx.OverwriteWithGradient is nnx.variable_type_from_name(OWG)
    assert callable(jax_epilog.nnx.overwrite_with_gradient)


def test_bad_arguments_name_themselves():
    x, w = _random(13, (4, 16), (16, 16))
    dn = (((1,), (0,)), ((), ()))
    with pytest.raises(ValueError, match=r"fp8: expected True or jax_epilog.Fp8"):
        fp8_dot_general(x, w, dn, fp8=Fp8(scaling="block"))
    with pytest.raises(ValueError, match=r'state: Fp8\(scaling="delayed"\) needs'):
        fp8_dot_general(x, w, dn, fp8=Fp8(scaling="delayed"))
    with pytest.raises(ValueError, match=r"state.kernel_scale: expected float32 of shape"):
        fp8_dot_general(x, w, dn, state={**init_state(4), "kernel_scale": jnp.ones(2)})
    with pytest.raises(TypeError, match="contracting dimensions"):
        fp8_dot_general(x, w, (((0,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="only Fp8\\(scaling=\"current\"\\)"):
        jax_epilog.linen.fp8_training(nn.Dense(4), fp8=Fp8())
    with pytest.raises(TypeError, match="rules: expected None, a module-path regex"):
        jax_epilog.nnx.fp8_training(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rules=[3])


# --- one call on a whole model ----------------------------------------------------------------

class _LinenModel(nn.Module):
    """Dense, DenseGeneral and Einsum; `dot_general_cls` given to the first two (the model
    written for FP8 by hand, which the intercepted stock model must equal)."""

    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="up", dot_general_cls=self.dot_general_cls)(x))
        h = nn.DenseGeneral((2, 16), name="split", dot_general_cls=self.dot_general_cls)(h)
        return nn.Einsum((2, 16, 8), "bhd,hdn->bn", name="out")(h)


def _fp8_gemms(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("epilog_matmul")


def test_linen_fp8_training_intercepts_the_chosen_layers_and_keeps_the_params():
    x, = _random(14, (4, 16))
    model = _LinenModel()
    variables = model.init(jax.random.key(0), x)
    trained = jax_epilog.linen.fp8_training(model, fp8=ALL)
    assert jax.tree.map(jnp.shape, trained.init(jax.random.key(0), x)) == \
        jax.tree.map(jnp.shape, variables)
    assert _fp8_gemms(lambda v: trained.apply(v, x), variables) == 3
    assert jax.lax.dot_general is fp8_ops.lax.dot_general  # JAX's own again afterwards
    # Two layers chosen by path: the same step as the model given the op by hand.
    chosen = jax_epilog.linen.fp8_training(model, rules=["up", "spl.*"], fp8=ALL)
    by_hand = _LinenModel(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=ALL))
    step = lambda m: jax.jit(jax.value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2)))
    assert _fp8_gemms(step(chosen), variables) == 2 * 3  # forward, dA, dB per layer
    got, want = step(chosen)(variables), step(by_hand)(variables)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_nnx_fp8_training_sets_the_ops_on_a_copy():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.split = nnx.LinearGeneral(32, (2, 16), rngs=rngs)
            self.out = nnx.Einsum("bhd,hdn->bn", (2, 16, 8), (8,), rngs=rngs)

        def __call__(self, x):
            return self.out(self.split(nnx.relu(self.up(x))))

    x, = _random(15, (4, 16))
    model = Model(nnx.Rngs(0))
    trained = jax_epilog.nnx.fp8_training(model, rules=r"up|out", fp8=ALL)
    assert model.up.dot_general is jax.lax.dot_general  # the model itself is unchanged
    assert trained.up.dot_general.name == "up"
    assert _fp8_gemms(lambda x: trained(x), x) == 2
    np.testing.assert_array_equal(trained.up.kernel[...], model.up.kernel[...])
    delayed = jax_epilog.nnx.fp8_training(model, fp8=Fp8(layers="all"))
    state = nnx.state(delayed, jax_epilog.nnx.OverwriteWithGradient)
    assert len(jax.tree.leaves(state)) == 3 * len(STATE_NAMES)
