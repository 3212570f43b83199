"""Delayed scaling in the FP8 layers (`Fp8(scaling="delayed")`, `fp8_state=`), on the CPU.

The layers' values and the next state (the state's gradient) are checked against
`test_fp8_layers.model_stack` with histories, the independent NumPy model, over several steps;
on `exact_stack`'s data, where every quantization is exact, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog.planning import context
from jax_epilog import Fp8, Fp8History
from jax_epilog.float8 import scaling as fp8
from test_fp8_layers import (close, exact_stack, full_float32_matmuls, gemm_calls,  # noqa: F401
                             leaves, model_stack, random_cotangent)
from test_layers import make_stack

DELAYED = Fp8(layers="all", scaling="delayed", amax_history_length=3)


def step(x, params, activations, dy, config, state, dtype=None):
    """(y, dx, grads, next state) of `mlp` through `jax.vjp` with cotangent dy."""
    def fn(x, params, state):
        return jax_epilog.mlp(x, params, activation=activations[0],
                              final_activation=activations[-1], fp8=config, fp8_state=state,
                              dtype=dtype)
    y, vjp = jax.vjp(fn, x, params, state)
    dx, grads, next_state = vjp(jnp.asarray(dy, y.dtype))
    return y, dx, grads, next_state


def as_numpy(state):
    return [(np.asarray(h.input), np.asarray(h.gradient)) for h in state]


@pytest.mark.parametrize("widths, activations, bias", [
    ((33, 129, 10), ("relu", None), True),
    ((16, 64, 48, 8), ("gelu", "gelu", None), True),
    ((40, 127, 1, 16), (None, None, "relu"), False),
])
def test_three_steps_match_the_model(widths, activations, bias):
    """float32 compute: three steps from the initial state (current scaling first, the
    calibration, then scales from the recorded amaxes), values, gradients and each next
    state against the model."""
    x, params = make_stack(hash(widths) % 1000, widths, lead=(7,), bias=bias)
    activations = (*[activations[0]] * (len(widths) - 2), activations[-1])
    state = DELAYED.init_state(len(params))
    histories = as_numpy(state)
    for t in range(3):
        dy = random_cotangent(t, (7, widths[-1]))
        # the inputs change from step to step, so the history's largest amax is not the
        # current one and delayed scaling differs from current scaling
        xt = x * (1.0 + 0.5 * t)
        y, dx, grads, state = step(xt, params, activations, dy, DELAYED, state)
        want = model_stack(np.asarray(xt), params, activations, dy, [True] * len(params),
                           DELAYED, histories=histories)
        for g, w in zip(leaves(y, dx, grads), leaves(*want[:3])):
            close(g, w, 2e-5)
        for (gi, gg), (wi, wg) in zip(as_numpy(state), want[3]):
            np.testing.assert_allclose(gi, wi, rtol=1e-6)
            np.testing.assert_allclose(gg, wg, rtol=1e-6)
        histories = want[3]
    assert all(np.all(h > 0) for pair in histories for h in pair)  # 3 steps recorded
    current = model_stack(np.asarray(xt), params, activations, dy, [True] * len(params))
    assert max(float(np.max(np.abs(np.asarray(g) - w))) for g, w in
               zip(leaves(y, dx, grads), leaves(*current))) > 0  # not current scaling


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_stack_is_exact_over_steps(dtype):
    """On `exact_stack`'s data every quantization is exact at the recorded amax 7: both steps
    from a state warm at 7 equal current scaling bit for bit,
    with bfloat16 compute too, where layer 1's GEMM writes layer 2's FP8 input and its amax
    itself."""
    x, params, dy = exact_stack(0, (33, 129, 10), 127)
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)
    # warm at amax 7 (a cold history's GEMM-written tensors would take a power-of-two bound)
    state = tuple(Fp8History(h.input.at[0].set(7.0), h.gradient.at[0].set(7.0))
                  for h in DELAYED.init_state(2))
    want = model_stack(x, params, ("relu", None), dy, [True, True], dtype=dtype)
    for t in range(2):
        *got, state = step(cast(x), cast(params), ("relu", None), dy, DELAYED, state)
        for g, w in zip(leaves(*got), leaves(*want)):
            assert g.dtype == dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), w)
        for h in state:  # every quantized tensor of exact_stack has amax 7
            np.testing.assert_array_equal(h.input[:t + 2], 7.0)
            np.testing.assert_array_equal(h.gradient[:t + 2], 7.0)
            np.testing.assert_array_equal(h.input[t + 2:], 0.0)


def fp8_results(fn, *args):
    """The result dtypes of the `matmul`s in fn's jaxpr that ask `result_amax`."""
    return [call[4] for call in gemm_calls(fn, *args) if call[2]]


@pytest.mark.parametrize("dtype, activation, forward, backward", [
    (jnp.bfloat16, "relu", 2, 2), (jnp.bfloat16, "gelu", 2, 0), (jnp.bfloat16, None, 0, 0),
    (jnp.float32, "relu", 0, 2)])
def test_fp8_results_where_cublaslt_has_them(dtype, activation, forward, backward):
    """bfloat16 compute: each forward GEMM followed by an FP8 layer writes e4m3 with its amax
    (the last layer's result stays bfloat16); not without a bias or activation (no measured
    kernel: DEFAULT) nor with float32 compute (an FP8 result's bias is bfloat16). Each
    data-gradient GEMM below a ReLU FP8 layer writes the e5m2 gradient (no bias or aux: any
    compute dtype); not through GELU, whose derivative is no mask."""
    x, params = make_stack(5, (32, 48, 64, 16), lead=(8,), bias=activation is not None)
    x, params = jax.tree.map(lambda a: a.astype(dtype), (x, params))
    state = DELAYED.init_state(3)
    loss = lambda x, p, s: jnp.sum(jax_epilog.mlp(x, p, activation=activation, fp8=DELAYED,
                                                  fp8_state=s).astype(jnp.float32))
    found = fp8_results(jax.grad(loss, argnums=(0, 1, 2)), x, params, state)
    assert found == ["float8_e4m3fn"] * forward + ["float8_e5m2"] * backward
    assert fp8_results(loss, x, params, state) == ["float8_e4m3fn"] * forward


def test_bfloat16_steps_match_the_model_within_fp8_rounding():
    """bfloat16 compute on random data, where the model's float64 sums can round a value to a
    neighbouring FP8 quantum: within two e4m3 quanta of the largest value, and the recorded
    input amaxes of the layers fed by FP8 results are those of the float32 R."""
    widths, activations = (32, 64, 48, 16), ("gelu", "gelu", None)
    x, params = make_stack(6, widths, lead=(9,))
    x, params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, params))
    state = DELAYED.init_state(3)
    histories = as_numpy(state)
    for t in range(2):
        dy = random_cotangent(t, (9, 16))
        y, dx, grads, state = step(x, params, activations, dy, DELAYED, state)
        want = model_stack(np.asarray(x, np.float32), params, activations, dy, [True] * 3,
                           DELAYED, dtype=ml_dtypes.bfloat16, histories=histories)
        for g, w in zip(leaves(y, dx, grads), leaves(*want[:3])):
            close(g, w, 2 * 2.0**-3)
        for (gi, gg), (wi, wg) in zip(as_numpy(state), want[3]):
            np.testing.assert_allclose(gi, wi, rtol=2.0**-3)
            np.testing.assert_allclose(gg, wg, rtol=2.0**-3)
        histories = want[3]


@pytest.mark.parametrize("plain_is_faster", [False, True])
def test_state_passes_through_layers_that_stay_bf16(plain_is_faster, monkeypatch):
    """`Fp8(layers="auto", scaling="delayed")` on layers too small for FP8: the bf16 stack's
    values and gradients, on the path it takes without FP8 (the fused stack or, where
    measured faster, XLA's plain expression), the state's gradient is the state itself."""
    from jax_epilog.planning import decisions
    from jax_epilog.planning import table_format
    # The CPU poses as a CUDA GPU whose tables choose XLA (the plain expression) or cuBLASLt.
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(context, "on_cuda_gpu", lambda: True)
    monkeypatch.setattr(decisions, "stack_decision", lambda key: None)
    monkeypatch.setattr(decisions, "decision", lambda *problem: table_format.Decision(
        "xla" if plain_is_faster else "cublaslt", "test"))
    config = Fp8(scaling="delayed", amax_history_length=2)
    x, params = make_stack(7, (16, 32, 8), lead=(4,))
    state = tuple(Fp8History(jnp.asarray([1.0, 2.0]), jnp.asarray([3.0, 4.0]))
                  for _ in range(2))
    dy = random_cotangent(0, (4, 8))
    y, dx, grads, next_state = step(x, params, ("relu", None), dy, config, state)
    plain = jax.vjp(lambda x, p: jax_epilog.mlp(x, p), x, params)
    np.testing.assert_array_equal(y, plain[0])
    for g, w in zip(jax.tree.leaves((dx, grads)), jax.tree.leaves(plain[1](dy))):
        np.testing.assert_array_equal(g, w)
    for h, s in zip(next_state, state):
        np.testing.assert_array_equal(h.input, s.input)
        np.testing.assert_array_equal(h.gradient, s.gradient)
    kernels = [c for c in gemm_calls(lambda x: jax_epilog.mlp(x, params, fp8=config,
                                                            fp8_state=state), x)]
    assert (kernels == []) == plain_is_faster


def test_jit_and_value_and_grad_training_loop():
    """The user's loop: `value_and_grad` w.r.t. (params, state) under `jit`; the state's
    gradient is the next state, and a forward-only call leaves it alone."""
    x, params = make_stack(8, (32, 64, 16), lead=(12,))
    state = DELAYED.init_state(2)

    @jax.jit
    def train_step(params, state, x):
        loss = lambda p, s: jnp.mean(jax_epilog.mlp(x, p, fp8=DELAYED, fp8_state=s) ** 2)
        value, (grads, state) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, state, value

    values = []
    for _ in range(4):
        params, state, value = train_step(params, state, x)
        values.append(float(value))
    assert values[-1] < values[0]
    assert all(np.all(np.asarray(h.input)[:3] > 0) for h in state)
    forward = jax.jit(lambda p, s: jax_epilog.mlp(x, p, fp8=DELAYED, fp8_state=s))
    assert forward(params, state).shape == (12, 16)


def test_the_documented_loop_trains_from_a_fresh_state():
    """docs/fp8.md's loop: delayed steps from a fresh state (`Fp8()`: "auto" scaling with a
    state), the first calibrating itself, the same jitted function throughout."""
    x, params = make_stack(15, (32, 64, 16), lead=(24,))
    y = jnp.asarray(random_cotangent(6, (24, 16)))

    def loss(params, state, x, y, config):
        return jnp.mean((jax_epilog.mlp(x, params, fp8=config, fp8_state=state) - y) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnames="config")
    update = lambda p, g: jax.tree.map(lambda a, b: a - 0.05 * b, p, g)
    config = Fp8(layers="all", amax_history_length=8)
    state = config.init_state(len(params))
    first, (grads, state) = step(params, state, x, y, config=config)
    params = update(params, grads)
    assert all(float(h.input[0]) > 0 and float(h.gradient[0]) > 0 for h in state)
    for _ in range(5):
        value, (grads, state) = step(params, state, x, y, config=config)
        params = update(params, grads)
    assert float(value) < float(first)
    assert all(float(h.gradient[5]) > 0 for h in state)  # six steps recorded


def test_dense_takes_one_history():
    x, params = make_stack(9, (24, 40), lead=(5,))
    (kernel, bias), = params
    history = DELAYED.init_state(1)[0]
    fn = lambda x, k, b, s: jax_epilog.dense(x, k, b, activation="gelu", fp8=DELAYED,
                                             fp8_state=s)
    y, vjp = jax.vjp(fn, x, kernel, bias, history)
    *_, next_history = vjp(jnp.ones_like(y))
    assert isinstance(next_history, Fp8History)
    assert float(next_history.input[0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
    assert float(next_history.gradient[0]) > 0


@pytest.mark.parametrize("config, state, match", [
    (DELAYED, None, r"fp8_state: fp8=Fp8\(scaling=\"delayed\"\) needs the amax histories of "
                    r"its 2 layer\(s\)"),
    (None, "state", r"fp8_state: the amax histories of FP8 layers, only with fp8="),
    (DELAYED, "one", r"fp8_state: expected 2 Fp8History"),
    (DELAYED, "bad_shape", r"fp8_state\[1\].gradient: expected a float32 amax history"),
    (DELAYED, "bad_dtype", r"fp8_state\[0\].input: expected a float32 amax history"),
])
def test_bad_state_names_the_argument(config, state, match):
    x, params = make_stack(10, (16, 32, 8), lead=(3,))
    good = DELAYED.init_state(2)
    state = {None: None, "state": good, "one": good[:1],
             "bad_shape": (good[0], Fp8History(good[1].input, jnp.zeros((2, 3), jnp.float32))),
             "bad_dtype": (Fp8History(good[0].input.astype(jnp.bfloat16), good[0].gradient),
                           good[1])}[state]
    with pytest.raises(ValueError, match=match):
        jax_epilog.mlp(x, params, fp8=config, fp8_state=state)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling="late"), "scaling: expected one of"),
    (dict(amax_history_length=0), "amax_history_length: expected a positive int"),
    (dict(amax_history_length=True), "amax_history_length"),
])
def test_bad_scaling_config_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8(**kwargs)
    with pytest.raises(ValueError, match="layers: expected the number of layers"):
        DELAYED.init_state(0)


def test_scale_follows_the_largest_amax_of_the_history():
    history = jnp.asarray([2.0, 7.0, 0.0], jnp.float32)
    x = jnp.asarray([[1.0, -3.5]], jnp.float32)
    x8, scale, x_amax = fp8.quantize_delayed(x, history, "float8_e4m3fn", 0)
    assert float(scale) == 7.0 / 448.0 and float(x_amax) == 3.5
    np.testing.assert_array_equal(np.asarray(x8, np.float32), [[64.0, -224.0]])
    np.testing.assert_array_equal(fp8.record(history, x_amax), [3.5, 2.0, 7.0])
    # an all-zero history (the first step) takes x's own amax (self-calibration); without
    # calibration it gives scale 1, saturating what exceeds the format
    big = jnp.asarray([[1000.0, 10.0]], jnp.float32)
    x8, scale, _ = fp8.quantize_delayed(big, jnp.zeros(3), "float8_e4m3fn", 0)
    assert float(scale) == np.float32(1.0) / (np.float32(448.0) / np.float32(1000.0))
    assert float(x8[0, 0].astype(jnp.float32)) == 448.0
    with fp8.uncalibrated():
        x8, scale, _ = fp8.quantize_delayed(big, jnp.zeros(3), "float8_e4m3fn", 0)
    assert float(scale) == 1.0 and float(x8[0, 0].astype(jnp.float32)) == 448.0


def test_current_scaling_records_its_amaxes_and_delayed_scaling_calibrates_itself():
    """With current scaling `fp8_state` is optional: the values are those of the call without
    it, and the next state holds the amaxes the scales came from. Delayed scaling from that
    state is current scaling on the same data. From the fresh state delayed scaling
    calibrates itself: each input its own amax (here, float32 compute, every layer input is
    quantized by XLA: current scaling's forward exactly), each GEMM-written gradient a bound
    on its amax (close to current scaling's gradients); without that (`fp8.uncalibrated`)
    the inputs and the GEMM-written gradients would quantize at scale 1 (small values flush
    to zero)."""
    x, params = make_stack(12, (32, 64, 48, 16), lead=(20,))
    x = x * 1e-3  # small activations: at scale 1 most flush to zero in e4m3
    dy = random_cotangent(5, (20, 16)) * 1e-6  # below e5m2's smallest value at scale 1
    activations = ("relu", "relu", None)
    current = Fp8(layers="all", scaling="current", amax_history_length=3)
    fresh = current.init_state(3)
    *got, calibrated = step(x, params, activations, dy, current, fresh)
    want = model_stack(np.asarray(x), params, activations, dy, [True] * 3, current,
                       histories=as_numpy(fresh))
    plain = run_stack_without_state(x, params, activations, dy, current)
    for g, p, w in zip(leaves(*got), leaves(*plain), leaves(*want[:3])):
        np.testing.assert_array_equal(g, p)
        close(g, w, 2e-5)
    for (gi, gg), (wi, wg) in zip(as_numpy(calibrated), want[3]):
        np.testing.assert_allclose(gi, wi, rtol=1e-6)
        np.testing.assert_allclose(gg, wg, rtol=1e-6)
    *delayed, _ = step(x, params, activations, dy, DELAYED, calibrated)
    # Same amaxes, the same scales: equal values, but for the bias gradients of the ReLU
    # layers below an FP8 layer, summed from their FP8 gradient (as their weight gradients
    # are) where current scaling sums the 16-bit one.
    summed_from_fp8 = [delayed[2][0][1], delayed[2][1][1]]
    for d, g in zip(leaves(*delayed), leaves(*got)):
        if any(d is b for b in summed_from_fp8):
            close(d, g, 0.25)
        else:
            np.testing.assert_array_equal(d, g)
    for config in (DELAYED, Fp8(layers="all", amax_history_length=3)):  # "auto": delayed
        *calibrating, next_state = step(x, params, activations, dy, config, fresh)
        np.testing.assert_array_equal(calibrating[0], got[0])
        for c, g in zip(leaves(*calibrating), leaves(*got)):
            close(c, g, 0.25)
        for c, g in zip(next_state, calibrated):
            np.testing.assert_array_equal(c.input, g.input)
            # a GEMM-written gradient's amax is taken before ReLU's derivative zeroes some
            assert np.all(np.asarray(c.gradient) >= np.asarray(g.gradient))
            assert np.asarray(c.gradient)[0] > 0
    with fp8.uncalibrated():
        *cold, _ = step(x, params, activations, dy, DELAYED, fresh)
    assert close(cold[0], got[0], 1.0) > 1e-2  # layer 0's input at scale 1: not current
    # the GEMM-written gradients at scale 1 flush to zero in e5m2 (the top layer's, scaled
    # by its current amax, does not): the cold start calibration avoids
    assert [float(np.max(np.abs(np.asarray(dk)))) > 0 for dk, _ in cold[2]] == \
        [False, False, True]


def run_stack_without_state(x, params, activations, dy, config):
    y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p, activation=activations[0],
                                                 final_activation=activations[-1], fp8=config),
                     x, params)
    return (y, *vjp(jnp.asarray(dy, y.dtype)))


# --- Flax ----------------------------------------------------------------------------------

def test_linen_keeps_the_histories_in_flax_overwrite_with_gradient_collection():
    """Linen: the histories are variables of Flax's "overwrite with gradient" collection, which
    `TrainState.apply_gradients` replaces by their gradients; values equal `mlp`'s with the
    same state, parameters unchanged by delayed scaling."""
    pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    from jax_epilog import linen as fused_linen

    x, params = make_stack(13, (24, 32, 16), lead=(8,))
    model = fused_linen.MLP((32, 16), fp8=DELAYED)
    variables = model.init(jax.random.key(0), x)
    histories = variables[fused_linen.FP8_COLLECTION]
    assert fused_linen.FP8_COLLECTION == "_overwrite_with_gradient"
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(
        fused_linen.MLP((32, 16)).init(jax.random.key(0), x)["params"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.sgd(0.1))
    grads = jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(state.params)
    state = state.apply_gradients(grads=grads)
    layers_ = variables["params"]
    stack = [(layers_[f"layers_{i}"]["kernel"], layers_[f"layers_{i}"]["bias"])
             for i in range(2)]
    fresh = [Fp8History(histories[f"layers_{i}"]["input_amax_history"],
                        histories[f"layers_{i}"]["gradient_amax_history"]) for i in range(2)]
    _, vjp = jax.vjp(lambda s: jax_epilog.mlp(x, stack, fp8=DELAYED, fp8_state=s), fresh)
    y = model.apply(variables, x)
    (want,) = vjp(2 * y / y.size)
    np.testing.assert_array_equal(y, jax_epilog.mlp(x, stack, fp8=DELAYED, fp8_state=fresh))
    for i, history in enumerate(want):
        got = state.params[fused_linen.FP8_COLLECTION][f"layers_{i}"]
        np.testing.assert_allclose(got["input_amax_history"], history.input, rtol=1e-6)
        np.testing.assert_allclose(got["gradient_amax_history"], history.gradient, rtol=1e-6)
        assert float(got["input_amax_history"][0]) > 0
    dense = fused_linen.Dense(16, activation="gelu", fp8=DELAYED)
    v = dense.init(jax.random.key(1), x)
    assert set(v[fused_linen.FP8_COLLECTION]) == {"input_amax_history", "gradient_amax_history"}
    # fp8=True ("auto" scaling) keeps the histories too, and so runs delayed scaling
    assert fused_linen.Dense(16, fp8=True).init(jax.random.key(1), x).keys() == \
        {"params", fused_linen.FP8_COLLECTION}
    assert fused_linen.Dense(16, fp8=Fp8(scaling="current")).init(
        jax.random.key(1), x).keys() == {"params"}


def test_nnx_keeps_the_histories_as_amax_history_variables():
    """NNX: `AmaxHistory` variables per layer, not parameters (`nnx.Param` state unchanged);
    `nnx.grad` w.r.t. them gives their next values, which `update_amax_histories` writes."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_epilog import nnx as fused_nnx

    x, _ = make_stack(14, (24, 16), lead=(8,))
    model = fused_nnx.MLP(24, [32, 16], fp8=DELAYED, rngs=nnx.Rngs(0))
    plain = fused_nnx.MLP(24, [32, 16], rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == \
        jax.tree.structure(nnx.state(plain, nnx.Param))
    stack = [layer.kernel_and_bias() for layer in model.layers]
    states = [layer.fp8_state() for layer in model.layers]
    np.testing.assert_array_equal(model(x), jax_epilog.mlp(x, stack, fp8=DELAYED,
                                                           fp8_state=states))
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fused_nnx.AmaxHistory))
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=wrt)(model)
    fused_nnx.update_amax_histories(model, grads)
    _, vjp = jax.vjp(lambda s: jax_epilog.mlp(x, stack, fp8=DELAYED, fp8_state=s), states)
    y = jax_epilog.mlp(x, stack, fp8=DELAYED, fp8_state=states)
    (want,) = vjp(2 * y / y.size)
    for layer, history in zip(model.layers, want):
        np.testing.assert_allclose(layer.input_amax_history[...], history.input, rtol=1e-6)
        np.testing.assert_allclose(layer.gradient_amax_history[...], history.gradient,
                                   rtol=1e-6)
    dense = fused_nnx.Dense(24, 16, fp8=DELAYED, rngs=nnx.Rngs(1))
    assert dense.fp8_state() is not None and dense(x).shape == (8, 16)
    assert fused_nnx.Dense(24, 16, fp8=True, rngs=nnx.Rngs(1)).fp8_state() is not None
    assert fused_nnx.Dense(24, 16, fp8=Fp8(scaling="current"),
                           rngs=nnx.Rngs(1)).fp8_state() is None
