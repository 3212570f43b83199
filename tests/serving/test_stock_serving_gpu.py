"""`serve_fp8` on a CUDA GPU: a stock model's served layers run the way asked for (our FP8
GEMM's custom call with the bias in its epilog, or weight-only: an FP8 operand converted inside
XLA's GEMM, no custom call), equal to this package's own layers on the same stored weights,
and close to bf16. Skipped without a CUDA device."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import jax_epilog  # noqa: E402
import jax_epilog.nnx  # noqa: E402

CUSTOM_CALL = 'custom_call_target="jax_epilog_matmul'


class Block(nnx.Module):
    """The example GPT's stock MLP, bf16, with random biases."""

    def __init__(self, d, f, rngs):
        dense = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, f, **dense), nnx.Linear(f, d, **dense)])
        for i, layer in enumerate(self.layers):
            layer.bias[...] = jax.random.normal(jax.random.key(i), layer.bias.shape,
                                                jnp.bfloat16)

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x), approximate=True))


def ours_like(block, d, f):
    """`jax_epilog.nnx.MLP` holding `block`'s parameters, stored in FP8 as `serve_fp8`
    stores them (every 2-D kernel, per tensor)."""
    mlp = jax_epilog.nnx.MLP(d, [f, d], activation="gelu", dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(mlp, nnx.state(block, nnx.Param))
    nnx.update(mlp, jax_epilog.quantize_params(nnx.state(mlp, nnx.Param),
                                               include=lambda p, leaf: jnp.ndim(leaf) == 2))
    return mlp


@pytest.mark.gpu
@pytest.mark.parametrize("way,rows,custom_calls", [("fp8", 256, 2), ("fp8", 129, 2),
                                                   ("weight_only", 16, 0),
                                                   ("weight_only", 1, 0)])
def test_served_stock_block_runs_the_way_asked_for(way, rows, custom_calls, monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    d, f = 1024, 1536
    block = Block(d, f, nnx.Rngs(0))
    served = jax_epilog.serve_fp8(block, rules=".*")
    x = jax.random.normal(jax.random.key(3), (rows, d), jnp.bfloat16)
    graphdef, state = nnx.split(served)
    fn = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    hlo = fn.lower(state, x).compile().as_text()
    assert hlo.count(CUSTOM_CALL) == custom_calls
    if way == "weight_only":
        assert "f8e4m3fn" in hlo  # the stored weight read as FP8, converted in the GEMM
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        y = np.asarray(fn(state, x), np.float32)
    want = np.asarray(block(x), np.float32)
    assert np.max(np.abs(y - want)) <= 0.1 * np.max(np.abs(want))
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(ours_like(block, d, f), x), np.float32)
    # ours fuses GELU into the first GEMM's epilog, the stock block applies it after the
    # GEMM's bf16 result: the same values up to bf16 rounding of the hidden layer
    assert np.max(np.abs(y - ours)) <= 2 ** -6 * np.max(np.abs(ours))


@pytest.mark.gpu
def test_served_linen_dense_general_runs_one_fp8_gemm(monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")
    layer = linen.DenseGeneral((8, 128), axis=(-2, -1), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(4), (256, 16, 64), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    served, stored = jax_epilog.serve_fp8(layer, variables, x, rules=".*")
    fn = jax.jit(served.apply)
    assert fn.lower(stored, x).compile().as_text().count(CUSTOM_CALL) == 1
    y, want = np.asarray(fn(stored, x), np.float32), np.asarray(layer.apply(variables, x),
                                                                np.float32)
    assert np.max(np.abs(y - want)) <= 0.1 * np.max(np.abs(want))
