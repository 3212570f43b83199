"""Self-calibrating delayed scaling (`Fp8(scaling="delayed")`, and `"auto"` given a state), on
the CPU.

A pass (forward or backward) that reads a cold amax history runs current scaling: from a
fresh state the training step is current scaling's bit for bit (values, gradients, the next
state); from a warm state it is the delayed program without calibration (`fp8.uncalibrated`,
the program before calibration existed) bit for bit; the compiled step holds one conditional
per pass and none where nothing is delayed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Fp8, fp8, plan
from test_fp8_layers import close, model_stack, random_cotangent
from test_layers import make_stack

DELAYED = Fp8(layers="all", scaling="delayed", amax_history_length=4)
AUTO = Fp8(layers="all", amax_history_length=4)  # scaling="auto": delayed, given a state
CURRENT = Fp8(layers="all", scaling="current", amax_history_length=4)

# (widths, activations): K and N multiples of 16, as FP8 GEMMs want; ReLU stacks have
# GEMM-written FP8 gradients (a backward cond), GELU ones only GEMM-written inputs
STACKS = [((48, 64, 32, 16), ("relu", "relu", None), True),
          ((32, 64, 16), ("gelu", "relu"), True),
          ((48, 32, 16), ("relu", "relu"), False)]


def step_fn(config, activations):
    """jit(value_and_grad) w.r.t. (x, params, state) of `sum(mlp(...) * dy)`: the gradient
    w.r.t. the state is the next state."""
    def loss(x, params, state, dy):
        y = jax_epilog.mlp(x, params, activation=activations[0],
                           final_activation=activations[-1], fp8=config, fp8_state=state)
        return jnp.sum(y.astype(jnp.float32) * dy)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def problem(rows, widths, bias, dtype, seed=0):
    x, params = make_stack(seed + rows, widths, lead=(rows,), bias=bias)
    x, params = jax.tree.map(lambda a: a.astype(dtype), (x, params))
    return x, params, jnp.asarray(random_cotangent(seed + rows, (rows, widths[-1])))


def assert_identical(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# every stack in both compute dtypes, the rows cycling through 1, 127 and 129
CASES = [(rows, widths, activations, bias, dtype) for rows, ((widths, activations, bias), dtype)
         in zip((1, 127, 129) * 2, [(s, d) for s in STACKS for d in (jnp.float32, jnp.bfloat16)])]


@pytest.mark.parametrize("rows, widths, activations, bias, dtype", CASES)
def test_cold_then_warm_steps(rows, widths, activations, bias, dtype):
    """From a fresh state, delayed (and "auto") scaling steps as current scaling with the same
    state, bit for bit, the next state holding this step's amaxes; from that warm state, on a
    new batch, as the uncalibrated delayed program, bit for bit, which differs from current
    scaling."""
    x, params, dy = problem(rows, widths, bias, dtype)
    fresh = DELAYED.init_state(len(params))
    current = step_fn(CURRENT, activations)(x, params, fresh, dy)
    for config in (DELAYED, AUTO):
        assert_identical(step_fn(config, activations)(x, params, fresh, dy), current)
    warm = current[1][2]
    assert all(float(h.input[0]) > 0 and float(h.gradient[0]) > 0 for h in warm)
    x2 = x * 3  # a larger batch: the history's amax no longer fits it (saturates)
    with fp8.uncalibrated():
        uncalibrated = step_fn(DELAYED, activations)(x2, params, warm, dy)
    for config in (DELAYED, AUTO):
        assert_identical(step_fn(config, activations)(x2, params, warm, dy), uncalibrated)
    differs = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), uncalibrated[1][:2],
                           step_fn(CURRENT, activations)(x2, params, warm, dy)[1][:2])
    assert any(jax.tree.leaves(differs))


def conditionals(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().as_text().count(" conditional(")


@pytest.mark.parametrize("activations, backward_cond", [(("relu", None), True),
                                                        (("gelu", None), False)])
def test_one_conditional_per_pass(activations, backward_cond):
    """The compiled training step holds one conditional in the forward and, where a GEMM
    writes an FP8 gradient (below a ReLU layer), one in the backward; the inference forward
    one; current scaling, `fp8=True` without a state, and the uncalibrated program none."""
    x, params, dy = problem(127, (48, 64, 32, 16), True, jnp.bfloat16)
    state = DELAYED.init_state(3)
    activations = (activations[0], activations[0], activations[1])
    for config in (DELAYED, AUTO):
        step = step_fn(config, activations)
        assert conditionals(step, x, params, state, dy) == 1 + backward_cond
        forward = lambda x, p, s: jax_epilog.mlp(x, p, activation=activations[0], fp8=config,
                                                 fp8_state=s)
        assert conditionals(forward, x, params, state) == 1
    assert conditionals(step_fn(CURRENT, activations), x, params, state, dy) == 0
    stateless = jax.grad(lambda x, p: jnp.sum(jax_epilog.mlp(x, p, fp8=AUTO).astype(
        jnp.float32)), argnums=(0, 1))
    assert conditionals(stateless, x, params) == 0
    with fp8.uncalibrated():
        assert conditionals(step_fn(DELAYED, activations), x, params, state, dy) == 0


@pytest.mark.parametrize("cold_value", [0.0, np.nan])
def test_one_cold_history_calibrates_its_pass(cold_value):
    """A warm state with one cold history: the pass that reads it runs current scaling, the
    other stays delayed (as `model_stack` computes), and the cold history gets its amax."""
    widths, activations = (48, 64, 32, 16), ("relu", "relu", None)
    x, params, dy = problem(129, widths, True, jnp.float32)
    warm = step_fn(CURRENT, activations)(x, params, DELAYED.init_state(3), dy)[1][2]
    x2 = x * 3
    with_cold_input = (warm[0], warm[1]._replace(input=jnp.full(4, cold_value, jnp.float32)),
                       warm[2])
    with_cold_gradient = (warm[0]._replace(gradient=warm[0].gradient.at[:].set(cold_value)),
                          warm[1], warm[2])
    for state in (with_cold_input, with_cold_gradient):
        _, (dx, grads, next_state) = step_fn(DELAYED, activations)(x2, params, state, dy)
        y = jax_epilog.mlp(x2, params, fp8=DELAYED, fp8_state=state)
        histories = [tuple(np.asarray(a) for a in h) for h in state]
        want = model_stack(np.asarray(x2), params, activations, np.asarray(dy), [True] * 3,
                           DELAYED, histories=histories)
        for g, w in zip([y, dx, *jax.tree.leaves(grads)],
                        [want[0], want[1], *[a for pair in want[2] for a in pair]]):
            close(g, w, 2e-5)
        for h, (wi, wg) in zip(next_state, want[3]):
            np.testing.assert_allclose(h.input[:1], wi[:1], rtol=1e-6)
            np.testing.assert_allclose(h.gradient[:1], wg[:1], rtol=1e-6)
    # the forward with the cold input history is current scaling's forward
    assert_identical(jax_epilog.mlp(x2, params, fp8=DELAYED, fp8_state=with_cold_input),
                     jax_epilog.mlp(x2, params, fp8=CURRENT))


def test_auto_is_resolved_once_where_the_stack_is_planned():
    """`scaling="auto"` becomes "delayed" given a state and "current" without, in the plan
    (whose config every later choice reads); explicit choices stay; asking an unresolved
    config whether it is delayed is an error that says what to do."""
    stack = plan.Stack((plan.Layer("relu", True), plan.Layer(None, True)), None, "auto", "auto")
    ctx = plan.default_context()
    for scaling, has_state, want in [("auto", True, "delayed"), ("auto", False, "current"),
                                     ("current", True, "current"),
                                     ("delayed", True, "delayed")]:
        config = Fp8(layers="all", scaling=scaling)
        planned = plan.plan_stack(ctx, stack, 64, (32, 48, 16), "bfloat16", config,
                                  has_state=has_state)
        assert planned.fp8.scaling == want
        assert (planned.calibration is not None) == (want == "delayed")
        assert any(lp.writes_fp8_result for lp in planned.layers) == (want == "delayed")
    assert Fp8().scaling == "auto" and Fp8().keeps_state
    assert not Fp8(scaling="current").keeps_state
    with pytest.raises(ValueError, match=r"Fp8\.resolved\(has_state\)"):
        Fp8().delayed
    with pytest.raises(ValueError, match="scaling: expected one of"):
        Fp8(scaling="late")
    assert dataclasses.replace(Fp8(), scaling="delayed").resolved(False).scaling == "delayed"


def test_fp8_true_without_a_state_is_current_scaling():
    """The functional layers without `fp8_state=`: `fp8=True` is current scaling, the same
    program (no state needed, no cond)."""
    x, params, dy = problem(127, (48, 64, 16), True, jnp.bfloat16)
    fn = lambda config: jax.grad(lambda x, p: jnp.sum(jax_epilog.mlp(
        x, p, fp8=config).astype(jnp.float32) * dy), argnums=(0, 1))(x, params)
    assert_identical(fn(AUTO), fn(CURRENT))
