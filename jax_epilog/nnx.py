"""`jax_epilog.nnx`: Flax NNX modules over `jax_epilog.dense` / `mlp` / `swiglu` (implemented in
`jax_epilog.layers.nnx`)."""

from jax_epilog.layers.nnx import MLP, AmaxHistory, Dense, SwiGLU, update_amax_histories

__all__ = ["AmaxHistory", "Dense", "MLP", "SwiGLU", "update_amax_histories"]
