"""jax-epilog: cuBLASLt's fused epilog matmuls as JAX primitives.

`matmul` runs `a @ b` with a bias, ReLU/GELU, a 1-bit ReLU mask or a fused backward (DRELU_BGRAD
and friends) in one cuBLASLt kernel on CUDA, and the same semantics in plain JAX everywhere
else. `dense` and `mlp` are differentiable layers built on it; `jax_epilog.nnx` and
`jax_epilog.linen` wrap them as Flax modules (those need Flax installed).
"""

from .epilogs import Epilog, gelu_aux_columns, relu_mask_bytes
from .layers import dense, mlp
from .matmul import EXPORT_SAFETY_CHECKS, matmul, reference_matmul

__version__ = "0.1.0"

__all__ = [
    "EXPORT_SAFETY_CHECKS",
    "Epilog",
    "dense",
    "gelu_aux_columns",
    "matmul",
    "mlp",
    "reference_matmul",
    "relu_mask_bytes",
]
