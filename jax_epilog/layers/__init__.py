"""The layers: `functional` (`dense`, `mlp`: one custom VJP over a stack that fuses each
activation's derivative and bias gradient into the next GEMM), `fp8_step` (an FP8 stack's
training step: scale, quantize, GEMM with epilog, update the histories), `block_step` (the
block-scaled FP8 recipe, `Fp8(scaling="block")`: one custom VJP per layer), `gemms` (a layer's
forward GEMM with its named residual, shared by both), `kv_cache` (a decoder's KV cache,
16-bit or FP8, and its in-place writes) and `decode_attention` (a decode step's attention
over it), and the Flax modules `linen` and `nnx` (public as `jax_epilog.linen` and
`jax_epilog.nnx`); FP8 training of stock Flax layers: `stock_fp8` (`fp8_dot_general`, any
`dot_general` as an FP8 GEMM), `stock_flax` (it as Flax's dot_general / einsum ops) and
`stock_training` (`fp8_training`, a whole model by rules); `stock_layers` and
`stock_serving` serve Flax's own dense layers in FP8 (`jax_epilog.serve_fp8`), `qwix_serving`
the same through a Qwix provider.

Imports `op`, `planning` and `float8`; the Flax modules (`linen`, `nnx`, `stock_flax`,
`stock_training`, the stock serving modules) import Flax, `qwix_serving` Qwix, nothing else
does.
"""
