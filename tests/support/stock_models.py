"""Stock Flax models shared by the stock-layer tests (serving, training, Qwix's provider)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class Scanned(nnx.Module):
    """Three `nnx.Linear` blocks (20 -> 20, with biases) stacked by `nnx.vmap` and run by
    `nnx.scan`, a residual tanh each (MaxText's scanned layers)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return nnx.Linear(20, 20, rngs=rngs)
        self.layers = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return x + jnp.tanh(layer(x))
        return step(x, self.layers)
