"""jax-epilog: cuBLASLt's fused epilog matmuls as JAX primitives.

`matmul` runs `a @ b` with a bias, ReLU/GELU, a 1-bit ReLU mask or a fused backward (DRELU_BGRAD
and friends) in one cuBLASLt kernel on CUDA, and the same semantics in plain JAX everywhere
else. `dense` and `mlp` are differentiable layers built on it, `swiglu` the Llama-style MLP
block; `jax_epilog.nnx` and `jax_epilog.linen` wrap them as Flax modules (those need Flax
installed, and are imported only when first used, so `import jax_epilog` never imports
Flax). `pack_relu_mask` and `unpack_relu_mask` convert between a boolean array and
cuBLASLt's packed ReLU mask. `Fp8` configures FP8 training in the layers (`fp8=`);
`Fp8History` is a layer's delayed-scaling state (`fp8_state=`); `quantize` makes an FP8
operand and its scale for `matmul`; `quantize_1x128` and `quantize_128x128` make a
block-scaled one and its `BlockScales` (one scale per 1×128 tile or 128×128 block, the
DeepSeek-V3 recipe; docs/fp8.md, "Block scaling"), `quantize_rows` one with a scale per
row ("Row scaling").
`quantize_params` stores a trained model's large kernels in FP8 (`Fp8Weight`) for serving,
and `calibrate` gives them static input scales (docs/serving.md). `KVCache` (made by
`init_kv_cache`, 16-bit or FP8 with a scale per vector) holds a decoder's keys and values,
`write_kv` writes a prefill's or a step's into it in place, and `decode_attention` attends
over it (docs/kv_cache.md).
`serve_fp8` serves a stock Flax model (`nnx.Linear`, `linen.Dense`, their General and Einsum
forms) in FP8 by one call, its code unchanged; `ServeRule` chooses its layers by path
(docs/stock_models.md; imported on first use, as the Flax modules are).
`explain(fn, *args)` prints how each stack and GEMM of a program runs on CUDA and which rule
or table entry decided it.

This module is the public surface; the implementation lives in subpackages, each a layer that
imports only the layers below it (docs/architecture.md):

- `runtime`: the C++ library, its FFI targets, the settings;
- `op`: the op itself: the epilog table, the primitives and their rules, the lowerings, the
  sharding rule, the reference, and `matmul`;
- `planning`: every choice of how a call or a stack runs (backend, layout, padding, FP8), and
  the measured decision tables;
- `float8`: FP8 recipes, scaling and quantization;
- `layers`: `dense`, `mlp`, the FP8 training step, the Flax modules;
- `tools`: the command lines (`python -m jax_epilog`, `.tune`, `.explanation`).
"""

import importlib as _importlib

from jax_epilog.float8.blocks import quantize_1x128, quantize_128x128, quantize_rows
from jax_epilog.float8.recipe import Fp8, Fp8History
from jax_epilog.float8.scaling import quantize_tensor as quantize
from jax_epilog.float8.weights import Fp8Weight, quantize_params
from jax_epilog.layers.decode_attention import decode_attention
from jax_epilog.layers.kv_cache import KVCache, init_kv_cache, write_kv
from jax_epilog.layers.serving import calibrate
from jax_epilog.layers.functional import dense, mlp
from jax_epilog.layers.swiglu import swiglu
from jax_epilog.op.block_scales import BlockScales
from jax_epilog.op.epilogs import Epilog, gelu_aux_columns, relu_mask_bytes
from jax_epilog.op.matmul import matmul, reference_matmul
from jax_epilog.op.activations import pack_relu_mask, unpack_relu_mask
from jax_epilog.runtime.library import load_if_a_gpu_is_present as _load_if_a_gpu_is_present
from jax_epilog.runtime.targets import EXPORT_SAFETY_CHECKS
from jax_epilog.op import planner as _planner
from jax_epilog.planning.call_plan import PLANNER as _PLANNER

# The op asks the planner of `planning` (the tables, this host) how a call runs.
_planner.register(_PLANNER)

# Registers the FFI targets now, where they can run: exported modules call them without
# lowering anything of ours first (docs/exporting.md).
_load_if_a_gpu_is_present()

__version__ = "0.1.0"

__all__ = [
    "BlockScales",
    "EXPORT_SAFETY_CHECKS",
    "Epilog",
    "Fp8",
    "Fp8History",
    "Fp8Weight",
    "KVCache",
    "ServeRule",
    "calibrate",
    "decode_attention",
    "dense",
    "explain",
    "gelu_aux_columns",
    "init_kv_cache",
    "matmul",
    "mlp",
    "pack_relu_mask",
    "quantize",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_params",
    "quantize_rows",
    "reference_matmul",
    "relu_mask_bytes",
    "serve_fp8",
    "swiglu",
    "unpack_relu_mask",
    "write_kv",
]

# Public modules imported on first use: the Flax modules (so that `import jax_epilog` never
# imports Flax), the settings, and the command lines.
_LAZY_MODULES = ("config", "explanation", "linen", "nnx", "tune")
_STOCK_SERVING = ("ServeRule", "serve_fp8")


def __getattr__(name):
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name == "explain":
        return _importlib.import_module(f"{__name__}.tools.explain").explain
    if name in _STOCK_SERVING:  # imports Flax
        return getattr(_importlib.import_module(f"{__name__}.layers.stock_serving"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*__all__, *_LAZY_MODULES, "__version__"])
