"""The SwiGLU block's gate, shared by its every form (compute dtype, per-tensor and
block-scaled FP8, served): h = silu(g)·u from `[g u]` and its gradient `[dg du]`, each in
float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_and_derivative(g):
    """(silu(g), silu'(g)) in float32: silu = g·σ(g), silu' = σ(g)·(1 + g·(1 - σ(g)))."""
    g = g.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(g)
    return g * sigmoid, sigmoid * (1.0 + g * (1.0 - sigmoid))


def hidden(gu, width: int):
    """h = silu(g)·u in float32 from `[g u]` `(M, 2F)`, F = `width`."""
    return jax.nn.silu(gu[:, :width].astype(jnp.float32)) * gu[:, width:].astype(jnp.float32)


def hidden_gradient(dh, g, u, dtype):
    """`[dg du]` in `dtype`, each computed in float32: dg = dh·u·silu'(g), du = dh·silu(g)."""
    silu, dsilu = silu_and_derivative(g)
    dh = dh.astype(jnp.float32)
    return jnp.concatenate([(dh * u.astype(jnp.float32) * dsilu).astype(dtype),
                            (dh * silu).astype(dtype)], axis=1)
