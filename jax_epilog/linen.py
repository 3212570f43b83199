"""`jax_epilog.linen`: Flax Linen modules over `jax_epilog.dense` / `mlp` (implemented in
`jax_epilog.layers.linen`)."""

from jax_epilog.layers.linen import FP8_COLLECTION, MLP, Dense

__all__ = ["Dense", "FP8_COLLECTION", "MLP"]
