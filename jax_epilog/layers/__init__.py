"""The layers: `functional` (`dense`, `mlp`: one custom VJP over a stack that fuses each
activation's derivative and bias gradient into the next GEMM), `fp8_step` (an FP8 stack's
training step: scale, quantize, GEMM with epilog, update the histories), `block_step` (the
block-scaled FP8 recipe, `Fp8(scaling="block")`: one custom VJP per layer), `gemms` (a layer's
forward GEMM with its named residual, shared by both), `kv_cache` (a decoder's KV cache,
16-bit or FP8, and its in-place writes) and `decode_attention` (a decode step's attention
over it), and the Flax modules `linen` and `nnx` (public as `jax_epilog.linen` and
`jax_epilog.nnx`).

Imports `op`, `planning` and `float8`; the Flax modules import Flax, nothing else does.
"""
