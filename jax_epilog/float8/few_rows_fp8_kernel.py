"""The served FP8 GEMM of a few rows as one Pallas kernel (Triton on CUDA):
`act(x_scale · w_scale · (x8 @ W8ᵀ) + bias)` for an e4m3 input x8 of at most
`weight_only_kernel.MAX_ROWS` rows and a weight stored in FP8 as `(N, K)`.

Both operands stay 1-byte: each program computes `block_n` output channels as the product
`W8[channels] @ x8ᵀ` (the weight's channels the MMA's long side, the few rows its short
side, so Hopper's FP8 tensor-core instructions take them as they lie, K-major, and nothing
is converted), then scales, bias and activation in float32 and one transposed store. The
input's quantization (`serving.quantize_input`) stays in XLA; this replaces XLA's FP8 dot
and the fusion after it (the "xla_fp8" way), with the same arithmetic: exact FP8 products
summed in float32, `act(z · x_scale · w_scale + bias)` in float32, rounded once.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.weight_only_kernel import Tiling, default_tiling, padded_rows
from jax_epilog.op.epilogs import ACTIVATIONS


def _kernel(x_ref, x_scale_ref, w_ref, w_scale_ref, *refs, block_m: int, block_n: int,
            block_k: int, activation: Optional[str], per_row: bool, per_channel: bool,
            has_bias: bool):
    from jax.experimental import pallas as pl
    bias_ref, out_ref = (refs[0], refs[1]) if has_bias else (None, refs[0])
    rows, k = x_ref.shape
    channels = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    row = jnp.minimum(jnp.arange(block_m), rows - 1)  # past x's rows, its last again

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + jax.lax.dot_general(w_ref[channels, ks], x_ref[row, ks],
                                         (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    zt = jax.lax.fori_loop(0, k // block_k, step, jnp.zeros((block_n, block_m), jnp.float32))
    w_scale = w_scale_ref[channels] if per_channel else w_scale_ref[...]
    x_scale = x_scale_ref[row] if per_row else x_scale_ref[...]
    z = zt.T * x_scale[:, None] * w_scale[None, :]
    if bias_ref is not None:
        z = z + bias_ref[channels].astype(jnp.float32)[None, :]
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    out_ref[row, channels] = z.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "dtype", "tiling", "interpret"))
def few_rows_fp8_gemm(x8, x_scale, data, w_scale, bias=None, *, activation: Optional[str] = None,
                      dtype=jnp.bfloat16, tiling: Optional[Tiling] = None,
                      interpret: bool = False):
    """`act(x_scale · w_scale · (x8 @ dataᵀ) + bias)` in `dtype`: x8 `(rows, K)` and data
    `(N, K)` e4m3, `x_scale` float32 `()` or `(rows,)`, `w_scale` `()` or `(N,)`, bias `(N,)`
    or None; `weight_only_kernel.fits` must hold for (rows, K, N, dtype)."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x8.shape
    n = data.shape[0]
    cut = tiling or default_tiling(k, n)
    if n % cut.block_n or k % cut.block_k:
        raise ValueError(f"tiling: {cut} does not divide K {k} and N {n}")
    per_row, per_channel = jnp.ndim(x_scale) == 1, jnp.ndim(w_scale) == 1
    flat = lambda s, vector: jnp.reshape(s.astype(jnp.float32), (-1,) if vector else (1,))  # noqa: E731
    operands = [x8, flat(x_scale, per_row), data, flat(w_scale, per_channel)]
    if bias is not None:
        operands.append(bias)
    params = None
    if not interpret:
        from jax_epilog.float8.block_kernel import compiler_params
        params = compiler_params(cut.num_warps, cut.num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, block_m=padded_rows(rows), block_n=cut.block_n,
                          block_k=cut.block_k, activation=activation, per_row=per_row,
                          per_channel=per_channel, has_bias=bias is not None),
        out_shape=jax.ShapeDtypeStruct((rows, n), dtype), grid=(n // cut.block_n,),
        interpret=interpret, name="few_rows_fp8_gemm", compiler_params=params)(*operands)
