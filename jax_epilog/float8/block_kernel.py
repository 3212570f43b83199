"""`quantize_1x128_both` as one Pallas kernel (Triton on CUDA): each program reads one
128×128 tile of x (rows, K) once and writes both 1-byte tiles (x8's, and xᵀ8's transposed)
and both rows of scales: the row amaxes give x8's 1×128 tiles along K, the column amaxes xᵀ8's
tiles along the rows. The math is `blocks`' (`multiplier`, `saturating_cast`), so the bytes are
the XLA formulation's. `blocks.BOTH_COPIES` chooses it ("pallas"); it runs on CUDA only, and
every other platform runs the XLA formulation (the tests run it with `interpret=True`).

A `Prologue` computes the quantized tensor from what the kernel reads, in the same pass: an
activation of the pre-activation (the next layer's input), or dY times the activation's
derivative (the backward's dZ), each rounded to the 16-bit dtype as the separate XLA fusion
would have written it. The kernel can also write each tile's column sums (the bias gradient's
partial sums), so nothing else reads dZ.

The 1-byte tiles are stored as uint8 and bitcast outside: Triton miscompiled transposed FP8
stores with ptxas 12.9 (triton-lang/triton#11111); a transposed uint8 tile is stored right.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.scaling import multiplier
from jax_epilog.op import manual_axes
from jax_epilog.op.block_scales import BLOCK
from jax_epilog.op.epilogs import ACTIVATIONS
from jax_epilog.op.reference import saturating_cast

#: Warps per program, by what the kernel computes (`benchmarks/pallas_tuning.py` times 4, 8
#: and 16 on large bf16 inputs): x itself ran fastest at 4, a prologue's activation or
#: derivative at 8 (more arithmetic per byte hides behind more warps).
NUM_WARPS_PLAIN = 4
NUM_WARPS_PROLOGUE = 8


class Prologue(NamedTuple):
    """What is quantized, from the arrays read: x itself (`activation` None), `act(x)` (x the
    pre-activation Z), or with `derivative` x · act'(z) (x = dY, z = Z, the backward's dZ);
    rounded to `dtype` (the compute dtype) as XLA's separate fusion would write it."""

    activation: Optional[str] = None
    derivative: bool = False
    dtype: str = "float32"

    @property
    def inputs(self) -> int:
        return 2 if self.derivative else 1

    @property
    def num_warps(self) -> int:
        """The measured best warps per program for this prologue."""
        return NUM_WARPS_PLAIN if self.activation is None else NUM_WARPS_PROLOGUE

    def __call__(self, x, z=None):
        """The float32 values to quantize, from float32 x (and z)."""
        if self.activation is None:
            return x
        act = ACTIVATIONS[self.activation]
        v = act.derivative(x, z, z.shape[-1]) if self.derivative else act.fn(x)
        return v.astype(self.dtype).astype(jnp.float32)


def compiler_params(num_warps: int, num_stages: int = 1):
    """Pallas' Triton compiler parameters: `num_warps` per program, `num_stages` tiles in
    flight (1 for a kernel with no loop to pipeline, as this module's)."""
    from jax.experimental.pallas import triton as plgpu
    # `CompilerParams` in the jax versions this package supports; older ones named it
    # `TritonCompilerParams`.
    params = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=num_stages)


def _kernel(*refs, dtype: str, prologue: Prologue, sums: bool):
    inputs, (x8_ref, xt8_ref, scale_ref, t_scale_ref, *sum_ref) = (
        refs[:prologue.inputs], refs[prologue.inputs:])
    x = prologue(*(ref[...].astype(jnp.float32) for ref in inputs))
    magnitude = jnp.abs(x)
    q = multiplier(jnp.max(magnitude, axis=1), dtype, 0)  # per row: its 1×128 tile along K
    qt = multiplier(jnp.max(magnitude, axis=0), dtype, 0)  # per column: its 128×1 tile

    def as_bytes(v):
        return jax.lax.bitcast_convert_type(saturating_cast(v, dtype), jnp.uint8)

    x8_ref[...] = as_bytes(x * q[:, None])
    xt8_ref[...] = as_bytes(x * qt[None, :]).T
    scale_ref[...] = (1.0 / q)[None, :]
    t_scale_ref[...] = (1.0 / qt)[None, :]
    if sums:
        sum_ref[0][...] = jnp.sum(x, axis=0)[None, :]


@functools.partial(jax.jit, static_argnames=("dtype", "prologue", "sums", "interpret",
                                             "num_warps"))
def quantize_both(x, *z, dtype: str, prologue: Prologue = Prologue(), sums: bool = False,
                  interpret: bool = False, num_warps: Optional[int] = None):
    """(x8 (rows, K), its scale values (K/128, rows), xᵀ8 (K, rows), its values (rows/128,
    K)) of `prologue(x, *z)` for x (rows, K) (and z, the same shape), both a multiple of 128
    (`blocks.quantize_1x128_both` checks); with `sums`, then its column sums (K,) in float32.
    `num_warps`: per program (default `prologue.num_warps`)."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x.shape
    axes = manual_axes.varying_axes((x, *z))  # inside shard_map: what the outputs vary over
    x, *z = (manual_axes.vary(a, axes) for a in (x, *z))
    struct = functools.partial(manual_axes.result_struct, like=x)
    tile = pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j))
    row_of_tiles = pl.BlockSpec((1, BLOCK), lambda i, j: (i, j))
    out_shape = [struct((rows, k), jnp.uint8), struct((k, rows), jnp.uint8),
                 struct((k // BLOCK, rows), jnp.float32), struct((rows // BLOCK, k), jnp.float32)]
    out_specs = [tile, pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
                 pl.BlockSpec((1, BLOCK), lambda i, j: (j, i)), row_of_tiles]
    if sums:  # one row of column sums per row of tiles, added up below
        out_shape.append(struct((rows // BLOCK, k), jnp.float32))
        out_specs.append(row_of_tiles)
    params = None if interpret else compiler_params(num_warps or prologue.num_warps)
    x8, xt8, scale, t_scale, *partial_sums = pl.pallas_call(
        functools.partial(_kernel, dtype=dtype, prologue=prologue, sums=sums),
        out_shape=tuple(out_shape), grid=(rows // BLOCK, k // BLOCK),
        in_specs=[tile] * prologue.inputs, out_specs=tuple(out_specs),
        interpret=interpret, name="quantize_1x128_both",
        compiler_params=params)(x, *z)
    out = (jax.lax.bitcast_convert_type(x8, dtype), scale,
           jax.lax.bitcast_convert_type(xt8, dtype), t_scale)
    return out + (jnp.sum(partial_sums[0], axis=0),) if sums else out
