"""`jax_epilog.linen`: Flax Linen modules over `jax_epilog.dense` / `mlp` / `swiglu` (implemented in
`jax_epilog.layers.linen`), and FP8 training for stock Linen layers: `Fp8DotGeneral` /
`Fp8Einsum` (a `dot_general_cls` / einsum op, `jax_epilog.layers.stock_flax`) and
`fp8_training` (a whole model, `jax_epilog.layers.stock_training`)."""

from jax_epilog.layers.linen import FP8_COLLECTION, MLP, Dense, SwiGLU
from jax_epilog.layers.stock_flax import Fp8DotGeneral, Fp8Einsum
from jax_epilog.layers.stock_fp8 import Fp8FallbackWarning
from jax_epilog.layers.stock_training import fp8_training

__all__ = ["Dense", "FP8_COLLECTION", "Fp8DotGeneral", "Fp8Einsum", "Fp8FallbackWarning", "MLP",
           "SwiGLU", "fp8_training"]
