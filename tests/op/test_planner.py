"""`jax_epilog.op.planner`: the op asks the planner that `planning` registers, and without one
plans the exact reference, which computes the same results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog.op import planner
from jax_epilog.planning import call_plan


@pytest.fixture
def no_planner():
    previous = planner.register(planner.Reference())
    try:
        yield
    finally:
        planner.register(previous)


def _relu_bias(x, w, b):
    return jax_epilog.matmul(x, w, epilog="relu_bias", epilog_inputs={"bias": b})


def _operands(seed=0, m=129, k=127, n=33):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (m, k), jnp.float32),
            jax.random.normal(keys[1], (k, n), jnp.float32),
            jax.random.normal(keys[2], (n,), jnp.float32))


def test_importing_jax_epilog_registers_planning():
    assert planner.current() is call_plan.PLANNER


def test_register_returns_the_planner_it_replaces(no_planner):
    mine = planner.Reference()
    assert isinstance(planner.register(mine), planner.Reference)
    assert planner.current() is mine


def test_without_planning_cuda_lowers_the_reference(no_planner):
    x, w, b = _operands()
    text = jax.jit(_relu_bias).trace(x, w, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_epilog_matmul" not in text and "dot_general" in text


def test_with_planning_an_export_for_cuda_emits_the_custom_call():
    x, w, b = _operands(1)
    text = jax.jit(lambda *a: _relu_bias(*a) * 1.0).trace(x, w, b).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_epilog_matmul" in text  # no CUDA device here: the kernel (an export)


def test_without_planning_values_and_gradients_are_the_reference(no_planner):
    x, w, b = _operands(2, m=1, k=129, n=127)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a)))

    reference = lambda x, w, b: jax_epilog.reference_matmul(  # noqa: E731
        x, w, epilog="relu_bias", epilog_inputs={"bias": b}, precision="highest")
    got = jax.value_and_grad(loss(_relu_bias), argnums=(0, 1, 2))(x, w, b)
    want = jax.value_and_grad(loss(reference), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
