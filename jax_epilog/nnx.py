"""`jax_epilog.nnx`: Flax NNX modules over `jax_epilog.dense` / `mlp` (implemented in
`jax_epilog.layers.nnx`)."""

from jax_epilog.layers.nnx import MLP, AmaxHistory, Dense, update_amax_histories

__all__ = ["AmaxHistory", "Dense", "MLP", "update_amax_histories"]
