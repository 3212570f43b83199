"""`jax_epilog.linen`: Flax Linen modules over `jax_epilog.dense` / `mlp` / `swiglu` (implemented in
`jax_epilog.layers.linen`)."""

from jax_epilog.layers.linen import FP8_COLLECTION, MLP, Dense, SwiGLU

__all__ = ["Dense", "FP8_COLLECTION", "MLP", "SwiGLU"]
