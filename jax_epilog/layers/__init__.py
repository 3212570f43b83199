"""The layers: `functional` (`dense`, `mlp`: one custom VJP over a stack that fuses each
activation's derivative and bias gradient into the next GEMM), `fp8_step` (an FP8 stack's
training step: scale, quantize, GEMM with epilog, update the histories), `block_step` (the
block-scaled FP8 recipe, `Fp8(scaling="block")`: one custom VJP per layer), `gemms` (a layer's
forward GEMM with its named residual, shared by both), and the Flax modules `linen` and
`nnx` (public as `jax_epilog.linen` and `jax_epilog.nnx`). `stock_layers` and
`stock_serving` serve Flax's own dense layers in FP8 (`jax_epilog.serve_fp8`), `qwix_serving`
the same through a Qwix provider.

Imports `op`, `planning` and `float8`; the Flax modules (and the stock serving modules)
import Flax, `qwix_serving` Qwix, nothing else does.
"""
