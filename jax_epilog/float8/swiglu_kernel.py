"""SwiGLU's backward `[dg du]` quantized by two Pallas kernels (Triton on CUDA), opt-in by
`layers.swiglu.GRADIENT_KERNEL = "pallas"` (not measured on a GPU yet).

The backward computes dg = dh·u·silu'(g) and du = dh·silu(g) from the data gradient dh and
the forward's e4m3 copies of g and u, takes the amax of `[dg du]` (current scaling) and
quantizes it, and the weight gradient wants the transposed copy too. XLA runs that as several
passes over `(M, 2F)` arrays (on the H200's `llama_large` profile about 2.4–3 ms a layer):
the amax pass, a 16-bit copy, the cast, a one-byte transpose. Here:

- `_amax_kernel`, grid (M/128, F/128): reads one 128×128 tile of dh, g8 and u8, computes both
  gradients and writes the column maxima of |dg| and |du| (one row of 128 per tile); XLA
  reduces those to the amax (and `scaling.reduce_amax` across devices where bound).
- `_quantize_kernel`, grid (M/128, 2F/128): tile column j < F/128 is dg's, the rest du's; it
  reads the same tiles again, computes the gradient, multiplies by the quantization
  multiplier and writes the e5m2 (or e4m3) tile and its transpose, both as uint8 (Triton's
  transposed FP8 stores miscompiled with ptxas 12.9, triton-lang/triton#11111).

The math is `gradients` (shared with the XLA path), each gradient rounded to the compute
dtype as the XLA path writes it. M and F must be multiples of 128 (`tileable`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_epilog.float8.block_kernel import triton_params
from jax_epilog.float8.scaling import multiplier, reduce_amax
from jax_epilog.op.reference import saturating_cast

TILE = 128
#: Warps per program and rows per tile (of 128 columns), as `block_kernel`'s: a 128×128
#: float32 tile is 64 values a thread. `benchmarks/pallas_tuning.py` times the others.
NUM_WARPS = 8
TILE_ROWS = 128


def silu_and_derivative(g):
    """(silu(g), silu'(g)) in float32: silu = g·σ(g), silu' = σ(g)·(1 + g·(1 - σ(g)))."""
    g = g.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(g)
    return g * sigmoid, sigmoid * (1.0 + g * (1.0 - sigmoid))


def gradients(dh, g, u, dtype):
    """(dg, du) in float32, each rounded to `dtype`: dg = dh·u·silu'(g), du = dh·silu(g)."""
    silu, dsilu = silu_and_derivative(g)
    dh = dh.astype(jnp.float32)
    dg = (dh * u.astype(jnp.float32) * dsilu).astype(dtype).astype(jnp.float32)
    du = (dh * silu).astype(dtype).astype(jnp.float32)
    return dg, du


def tileable(dh) -> bool:
    """Whether the kernels take dh `(M, F)`: both multiples of `TILE`."""
    return dh.ndim == 2 and dh.shape[0] % TILE == 0 and dh.shape[1] % TILE == 0


def _tile_gradients(dh_ref, g8_ref, u8_ref, g_scale_ref, u_scale_ref, dtype):
    # The scales arrive as rows of 128 equal values: a (1, 128) block broadcasts over a tile.
    g = g8_ref[...].astype(jnp.float32) * g_scale_ref[...]
    u = u8_ref[...].astype(jnp.float32) * u_scale_ref[...]
    return gradients(dh_ref[...], g, u, dtype)


def _amax_kernel(dh_ref, g8_ref, u8_ref, g_scale_ref, u_scale_ref, out_ref, *, dtype):
    dg, du = _tile_gradients(dh_ref, g8_ref, u8_ref, g_scale_ref, u_scale_ref, dtype)
    out_ref[...] = jnp.max(jnp.maximum(jnp.abs(dg), jnp.abs(du)), axis=0)[None, :]


def _quantize_kernel(dh_ref, g8_ref, u8_ref, g_scale_ref, u_scale_ref, q_ref, out_ref,
                     out_t_ref, *, dtype, fmt: str, halves: int):
    dg, du = _tile_gradients(dh_ref, g8_ref, u8_ref, g_scale_ref, u_scale_ref, dtype)
    from jax.experimental import pallas as pl

    value = jnp.where(pl.program_id(1) >= halves, du, dg)
    quantized = jax.lax.bitcast_convert_type(saturating_cast(value * q_ref[...], fmt),
                                             jnp.uint8)
    out_ref[...] = quantized
    out_t_ref[...] = quantized.T


@functools.partial(jax.jit, static_argnames=("fmt", "margin", "amax_axes", "dtype",
                                             "interpret", "num_warps", "tile_rows"))
def quantize_gradient(dh, g8, g_scale, u8, u_scale, *, fmt: str, margin: int, amax_axes,
                      dtype: str, interpret: bool = False, num_warps: int = NUM_WARPS,
                      tile_rows: int = TILE_ROWS):
    """(`[dg du]` quantized `(M, 2F)`, its transpose `(2F, M)`, the dequantization scale,
    the amax) for dh `(M, F)` and the e4m3 g8, u8 with their float32 scalar scales; the
    same as `scaling.quantize_scaled(jnp.concatenate(gradients(...)), fmt, margin,
    amax_axes=amax_axes)` and its transpose. Each program takes `tile_rows` × 128 (a
    divisor of 128) with `num_warps` warps."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    m, f = dh.shape
    halves = f // TILE
    params = None if interpret else triton_params(num_warps)
    row = lambda value: jnp.full((1, TILE), value, jnp.float32)
    tile = pl.BlockSpec((tile_rows, TILE), lambda i, j: (i, j))
    scalar_row = pl.BlockSpec((1, TILE), lambda i, j: (0, 0))
    columns = pl.pallas_call(
        functools.partial(_amax_kernel, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct((m // tile_rows, f), jnp.float32),
        grid=(m // tile_rows, halves), in_specs=[tile, tile, tile, scalar_row, scalar_row],
        out_specs=pl.BlockSpec((1, TILE), lambda i, j: (i, j)), interpret=interpret,
        name="swiglu_gradient_amax", compiler_params=params)(
            dh, g8, u8, row(g_scale), row(u_scale))
    amax = reduce_amax(jnp.max(columns), amax_axes)
    q = multiplier(amax, fmt, margin)
    half_tile = pl.BlockSpec((tile_rows, TILE), lambda i, j: (i, j % halves))
    out, out_t = pl.pallas_call(
        functools.partial(_quantize_kernel, dtype=dtype, fmt=fmt, halves=halves),
        out_shape=(jax.ShapeDtypeStruct((m, 2 * f), jnp.uint8),
                   jax.ShapeDtypeStruct((2 * f, m), jnp.uint8)),
        grid=(m // tile_rows, 2 * halves),
        in_specs=[half_tile, half_tile, half_tile, scalar_row, scalar_row, scalar_row],
        out_specs=(tile, pl.BlockSpec((TILE, tile_rows), lambda i, j: (j, i))),
        interpret=interpret, name="swiglu_gradient_quantize", compiler_params=params)(
            dh, g8, u8, row(g_scale), row(u_scale), row(q))
    return (jax.lax.bitcast_convert_type(out, fmt), jax.lax.bitcast_convert_type(out_t, fmt),
            1.0 / q, amax)
