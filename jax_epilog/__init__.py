"""jax-epilog: cuBLASLt's fused epilog matmuls as JAX primitives.

`matmul` runs `a @ b` with a bias, ReLU/GELU, a 1-bit ReLU mask or a fused backward (DRELU_BGRAD
and friends) in one cuBLASLt kernel on CUDA, and the same semantics in plain JAX everywhere
else. `dense` and `mlp` are differentiable layers built on it; `jax_epilog.nnx` and
`jax_epilog.linen` wrap them as Flax modules (those need Flax installed, and are imported only
when first used, so `import jax_epilog` never imports Flax). `pack_relu_mask` and
`unpack_relu_mask` convert between a boolean array and cuBLASLt's packed ReLU mask. `Fp8`
configures FP8 training in the layers (`fp8=`); `Fp8History` is a layer's delayed-scaling
state (`fp8_state=`); `quantize` makes an FP8 operand and its scale for `matmul`.
`explain(fn, *args)` prints how each stack and GEMM of a program runs on CUDA and which rule
or table entry decided it (`jax_epilog.plan`).
"""

import importlib

from .epilogs import Epilog, gelu_aux_columns, relu_mask_bytes
from .fp8 import Fp8, Fp8History
from .fp8 import quantize_tensor as quantize
from .layers import dense, mlp
from .matmul import EXPORT_SAFETY_CHECKS, matmul, reference_matmul
from .reference import pack_relu_mask, unpack_relu_mask

__version__ = "0.1.0"

__all__ = [
    "EXPORT_SAFETY_CHECKS",
    "Epilog",
    "Fp8",
    "Fp8History",
    "dense",
    "explain",
    "gelu_aux_columns",
    "matmul",
    "mlp",
    "pack_relu_mask",
    "quantize",
    "reference_matmul",
    "relu_mask_bytes",
    "unpack_relu_mask",
]

_LAZY_SUBMODULES = ("nnx", "linen")


def __getattr__(name):
    """`jax_epilog.nnx` / `jax_epilog.linen` without an import of their own (Flax is loaded
    on first use, not by `import jax_epilog`); `jax_epilog.explain` likewise (so that
    `python -m jax_epilog.tune` and `python -m jax_epilog.explanation` run modules not imported
    yet)."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "explain":
        return importlib.import_module(f"{__name__}.explanation").explain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY_SUBMODULES, "explain"])


def _install_hint(extra: str) -> str:
    """How to install one of the package's extras, from a checkout and from an index."""
    return (f'pip install ".[{extra}]" in a checkout of jax-epilog '
            f'(pip install "jax-epilog[{extra}]" from a package index)')
