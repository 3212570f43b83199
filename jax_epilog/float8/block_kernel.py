"""`quantize_1x128_both` as one Pallas kernel (Triton on CUDA): each program reads one
128×128 tile of x (rows, K) once and writes both 1-byte tiles (x8's, and xᵀ8's transposed)
and both rows of scales: the row amaxes give x8's 1×128 tiles along K, the column amaxes xᵀ8's
tiles along the rows. The math is `blocks`' (`multiplier`, `saturating_cast`), so the bytes are
the XLA formulation's. `blocks.BOTH_COPIES` chooses it ("pallas"); it runs on CUDA only, and
every other platform runs the XLA formulation (the tests run it with `interpret=True`).

The 1-byte tiles are stored as uint8 and bitcast outside: Triton miscompiled transposed FP8
stores with ptxas 12.9 (triton-lang/triton#11111); a transposed uint8 tile is stored right.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_epilog.float8.scaling import multiplier
from jax_epilog.op.block_scales import BLOCK
from jax_epilog.op.reference import saturating_cast

#: Warps per program: a 128×128 float32 tile is 64 values a thread at 8 warps (128 at 4,
#: Triton's default, where the two quantized tiles would spill registers). Not tuned yet.
NUM_WARPS = 8


def _compiler_params():
    from jax.experimental.pallas import triton as plgpu
    # `CompilerParams` in the jax versions this package supports; older ones named it
    # `TritonCompilerParams`.
    params = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return params(num_warps=NUM_WARPS, num_stages=1)


def _kernel(x_ref, x8_ref, xt8_ref, scale_ref, t_scale_ref, *, dtype: str):
    x = x_ref[...].astype(jnp.float32)
    magnitude = jnp.abs(x)
    q = multiplier(jnp.max(magnitude, axis=1), dtype, 0)  # per row: its 1×128 tile along K
    qt = multiplier(jnp.max(magnitude, axis=0), dtype, 0)  # per column: its 128×1 tile

    def as_bytes(v):
        return jax.lax.bitcast_convert_type(saturating_cast(v, dtype), jnp.uint8)

    x8_ref[...] = as_bytes(x * q[:, None])
    xt8_ref[...] = as_bytes(x * qt[None, :]).T
    scale_ref[...] = (1.0 / q)[None, :]
    t_scale_ref[...] = (1.0 / qt)[None, :]


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def quantize_both(x, dtype: str, interpret: bool = False):
    """(x8 (rows, K), its scale values (K/128, rows), xᵀ8 (K, rows), its values (rows/128,
    K)) for x (rows, K), both a multiple of 128 (`blocks.quantize_1x128_both` checks)."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x.shape
    tile = pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j))
    out_shape = (jax.ShapeDtypeStruct((rows, k), jnp.uint8),
                 jax.ShapeDtypeStruct((k, rows), jnp.uint8),
                 jax.ShapeDtypeStruct((k // BLOCK, rows), jnp.float32),
                 jax.ShapeDtypeStruct((rows // BLOCK, k), jnp.float32))
    out_specs = (tile, pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
                 pl.BlockSpec((1, BLOCK), lambda i, j: (j, i)),
                 pl.BlockSpec((1, BLOCK), lambda i, j: (i, j)))
    x8, xt8, scale, t_scale = pl.pallas_call(
        functools.partial(_kernel, dtype=dtype), out_shape=out_shape,
        grid=(rows // BLOCK, k // BLOCK), in_specs=[tile], out_specs=out_specs,
        interpret=interpret, name="quantize_1x128_both",
        compiler_params=None if interpret else _compiler_params())(x)
    return (jax.lax.bitcast_convert_type(x8, dtype), scale,
            jax.lax.bitcast_convert_type(xt8, dtype), t_scale)
