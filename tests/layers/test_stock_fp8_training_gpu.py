"""On a CUDA GPU: stock Flax layers given this package's FP8 op (one keyword, or
`fp8_training`) run every GEMM of their training step as our cuBLASLt FP8 custom call, and
compute the quantized math (checked against the same step on the CPU's reference lowering).

    python -m pytest -q -p no:xdist tests/layers/test_stock_fp8_training_gpu.py
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.runtime import targets

pytestmark = pytest.mark.gpu

ALL = Fp8(layers="all")


def _fp8_custom_calls(lowered) -> int:
    calls = [line for line in lowered.as_text().splitlines()
             if f"@{targets.MATMUL.name}" in line]
    assert calls, "no jax_epilog custom call in the program"
    return sum(bool(re.search(r"f8E(4M3FN|5M2)", line)) for line in calls)


def _compiled_without_fallback(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = jax.jit(fn).lower(*args)
        compiled = lowered.compile()
    fell_back = [str(w.message) for w in caught
                 if issubclass(w.category, (RuntimeWarning, jax_epilog.linen.Fp8FallbackWarning))]
    assert not fell_back, fell_back
    return lowered, compiled


def _on(device, tree):
    return jax.device_put(tree, device)


@pytest.mark.parametrize("layer, x_shape", [
    (lambda cls: nn.Dense(384, dtype=jnp.bfloat16, dot_general_cls=cls), (4, 256, 512)),
    (lambda cls: nn.DenseGeneral((3, 128), axis=(-2, -1), batch_dims=(0,),
                                 dtype=jnp.bfloat16, dot_general_cls=cls), (2, 512, 2, 256)),
])
def test_linen_step_runs_fp8_custom_calls_and_matches_the_cpu(layer, x_shape):
    model = layer(functools.partial(jax_epilog.linen.Fp8DotGeneral, fp8=ALL))
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.bfloat16)
    variables = model.init(jax.random.key(1), x)

    def step(variables, x):
        return jax.value_and_grad(
            lambda v: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2))(variables)

    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    lowered, compiled = _compiled_without_fallback(step, *_on(gpu, (variables, x)))
    assert _fp8_custom_calls(lowered) == 3  # forward, data gradient, weight gradient
    got = compiled(*_on(gpu, (variables, x)))
    want = jax.jit(step)(*_on(cpu, (variables, x)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        # GPU FP8 GEMMs accumulate differently (fast accumulation in the forward and the
        # data gradient), and a result's rounding to bf16 can move by one unit.
        np.testing.assert_allclose(g, w, atol=2e-2 * np.abs(w).max() + 1e-30)


def test_nnx_fp8_training_runs_every_chosen_gemm_as_an_fp8_custom_call():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(512, 1024, dtype=jnp.bfloat16, rngs=rngs)
            self.out = nnx.Einsum("bd,dn->bn", (1024, 256), (256,), dtype=jnp.bfloat16,
                                  rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.up(x)))

    model = jax_epilog.nnx.fp8_training(Model(nnx.Rngs(0)),
                                        fp8=Fp8(scaling="current", layers="all"))
    graph, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.bfloat16)

    def step(params, x):
        loss = lambda p: jnp.mean(nnx.merge(graph, p)(x).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss)(params)

    lowered, compiled = _compiled_without_fallback(step, params, x)
    assert _fp8_custom_calls(lowered) == 2 * 3
    loss, _ = compiled(params, x)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_an_intercepted_dense_takes_its_bias_into_the_fp8_gemm_and_matches_the_cpu(dtype):
    """`fp8_training` runs a Dense with a bias whole: bf16, the forward is our FP8 GEMM with
    the BIAS epilog (three FP8 custom calls a step); float32, which cuBLASLt has no FP8 BIAS
    kernel for, the forward is XLA's FP8 GEMM, never the reference fallback. Both compute
    what the CPU's lowering computes."""
    model = jax_epilog.linen.fp8_training(nn.Dense(384, dtype=dtype),
                                          fp8=Fp8(scaling="current", layers="all"))
    x = jax.random.normal(jax.random.key(0), (4, 255, 512), dtype)
    variables = model.init(jax.random.key(1), x)
    variables = jax.tree.map(lambda v: v + 0.5 if v.ndim == 1 else v, variables)  # a bias

    def step(variables, x):
        return jax.value_and_grad(
            lambda v: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2))(variables)

    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    lowered, compiled = _compiled_without_fallback(step, *_on(gpu, (variables, x)))
    if dtype == jnp.bfloat16:
        assert _fp8_custom_calls(lowered) == 3
    got = compiled(*_on(gpu, (variables, x)))
    want = jax.jit(step)(*_on(cpu, (variables, x)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=2e-2 * np.abs(w).max() + 1e-30)
