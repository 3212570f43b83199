"""The served FP8 GEMM of a few rows as one Pallas kernel (Triton on CUDA):
`act(x_scale · w_scale · (x8 @ W8ᵀ) + bias)` for an e4m3 input x8 of at most `MAX_ROWS` rows
and a weight stored in FP8 as `(N, K)` (`Fp8Weight.data`, K-major).

Decoding reads every weight once for a few rows, so the GEMM is bound by reading the weight.
Each program computes `block_n` output channels as the product `W8[channels] @ x8ᵀ`: the
weight's channels are the MMA's long side and the few rows its short side, so Hopper's FP8
tensor-core instructions take both operands as they lie (K-major, 1 byte) and nothing is
converted. Then the scales (x's one or one per row, the weight's one or one per channel), the
bias and the activation in float32, and one store in the result dtype. The input's
quantization (`serving.quantize_input`) stays in XLA.

The arithmetic is the "xla_fp8" way's (`serving.xla_fp8`, what every other platform runs):
exact FP8 products summed in float32, then `act(z · x_scale · w_scale + bias)` in float32;
XLA's FP8 dot rounds the product to the result dtype before that epilogue, this kernel only
after it. It runs where `fits` says so (at most `MAX_ROWS` rows, a 16-bit result, K and N
multiples of `MIN_BLOCK`); the tests run it with `interpret=True`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.op.epilogs import ACTIVATIONS

#: The most rows the kernel takes: each program keeps all of them in its accumulator.
MAX_ROWS = 64
#: The smallest block along K and N (FP8 MMAs are 32 deep); K and N must be multiples of it.
MIN_BLOCK = 32
#: The fewest rows a program computes (Triton's dot needs 16 along every side).
MIN_ROWS = 16


class Tiling(NamedTuple):
    """How the kernel is cut: `block_n` output channels per program, `block_k` of K per loop
    step, `num_warps` per program, `num_stages` tiles in flight (Triton's pipelining)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: Measured on the H200 (`benchmarks/few_rows_tuning.py`, K4096 x N14336, 8 layers per
#: call, the input quantized per tensor in XLA, ratios to XLA's bf16 GEMM with GELU, careful
#: harness (user's)): at 16 rows 128 channels x 256 of K with 5 stages ran 1.68 (1.63), 64 x
#: 256 with 3 stages 1.69 (1.63), XLA's FP8 dot 1.67 (1.71), XLA's weight-only GEMM 1.52
#: (1.50); at 1 row 128 x 256 x 5 stages 1.62 (1.56), XLA's weight-only 1.52 (1.52), XLA's
#: FP8 dot 1.43 (1.36). Narrower programs where N has few channels (`default_tiling`).
BLOCK_N = 128
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 5
#: Programs `default_tiling` keeps at least (narrower blocks where N is small): 132 SMs on
#: the H200.
MIN_PROGRAMS = 100
#: Shared memory `default_tiling` gives the pipeline's tiles at most: 227 KiB per program
#: on Hopper, with room for the epilogue's transpose. (5 stages of 128 x 256 weight and
#: 64 x 256 input tiles, 240 KiB, failed to launch on the H200.)
STAGE_BYTES = 180 * 1024


def fits(rows: int, k: int, n: int, dtype) -> bool:
    """Whether the kernel computes `x8 (rows, K) @ W8 (N, K)ᵀ` with a `dtype` result: 1 to
    `MAX_ROWS` rows, a 16-bit result, K and N multiples of `MIN_BLOCK`."""
    return (1 <= rows <= MAX_ROWS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and k % MIN_BLOCK == 0 and n % MIN_BLOCK == 0)


def _largest_divisor(limit: int, size: int) -> int:
    """The largest power of two <= `limit` (and >= `MIN_BLOCK`) that divides `size`."""
    block = limit
    while block > MIN_BLOCK and size % block:
        block //= 2
    return block


def padded_rows(rows: int) -> int:
    """The rows a program computes: a power of two from `MIN_ROWS` to `MAX_ROWS`."""
    return max(MIN_ROWS, 1 << (rows - 1).bit_length())


def default_tiling(rows: int, k: int, n: int) -> Tiling:
    """The measured tiling fitted to the shape: blocks that divide K and N, `block_n` halved
    (not below `MIN_BLOCK`) while there are fewer than `MIN_PROGRAMS` programs, and no more
    stages than fit `STAGE_BYTES`."""
    block_n = _largest_divisor(BLOCK_N, n)
    while block_n > MIN_BLOCK and n // block_n < MIN_PROGRAMS:
        block_n //= 2
    block_k = _largest_divisor(BLOCK_K, k)
    stages = min(NUM_STAGES, STAGE_BYTES // ((block_n + padded_rows(rows)) * block_k))
    return Tiling(block_n, block_k, NUM_WARPS, max(2, stages))


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
def few_rows_fp8_gemm(x8, x_scale, data, w_scale, bias=None, *,
                      activation: Optional[str] = None, dtype=jnp.bfloat16,
                      tiling: Optional[Tiling] = None, interpret: bool = False):
    """`act(x_scale · w_scale · (x8 @ dataᵀ) + bias)` in `dtype`: x8 `(rows, K)` and data
    `(N, K)` e4m3, `x_scale` float32 `()` or `(rows,)`, `w_scale` `()` or `(N,)`, bias `(N,)`
    or None; `fits` must hold for (rows, K, N, dtype). `tiling`: as given (its blocks must
    divide K and N), else `default_tiling`."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x8.shape
    n = data.shape[0]
    cut = tiling or default_tiling(rows, k, n)
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
