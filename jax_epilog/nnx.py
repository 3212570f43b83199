"""`jax_epilog.nnx`: Flax NNX modules over `jax_epilog.dense` / `mlp` / `swiglu` (implemented in
`jax_epilog.layers.nnx`), and FP8 training for stock NNX layers: `Fp8DotGeneral` / `Fp8Einsum`
(a `dot_general` / `einsum_op`, `jax_epilog.layers.stock_flax`) and `fp8_training` (a whole
model, `jax_epilog.layers.stock_training`)."""

from jax_epilog.layers.nnx import MLP, AmaxHistory, Dense, SwiGLU, update_amax_histories
from jax_epilog.layers.stock_flax import NnxFp8DotGeneral as Fp8DotGeneral
from jax_epilog.layers.stock_flax import NnxFp8Einsum as Fp8Einsum
from jax_epilog.layers.stock_flax import OverwriteWithGradient, overwrite_with_gradient
from jax_epilog.layers.stock_fp8 import Fp8FallbackWarning
from jax_epilog.layers.stock_training import fp8_training

__all__ = ["AmaxHistory", "Dense", "Fp8DotGeneral", "Fp8Einsum", "Fp8FallbackWarning", "MLP",
           "OverwriteWithGradient", "SwiGLU", "fp8_training", "overwrite_with_gradient",
           "update_amax_histories"]
