"""Block-scaled FP8 quantization (the DeepSeek-V3 recipe; docs/fp8.md, "Block scaling"), in
plain JAX that XLA fuses with whatever produces the tensor: current scaling, one amax per
1×128 tile (`quantize_1x128`: activations and gradients), per 128×128 block
(`quantize_128x128`: weights) or per row (`quantize_rows`: "Row scaling"), scales in the
layouts `matmul` takes (`op.block_scales`).

A tensor x (rows, K) is quantized along K, the axis its GEMM contracts. The weight gradient
contracts the other axis (the tokens), so it needs x's transposed copy quantized along the
rows: `quantize_1x128(x, transposed=True)`, or `quantize_1x128_both` for both copies, amaxes
taken from x as it lies and only the 1-byte copy transposed. A 128×128 block is the same block of the transposed matrix, so a weight's
transposed copy is its transposed data and scales (`transpose_128x128`), no requantization.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_epilog.float8 import block_kernel
from jax_epilog.float8.recipe import fp8_format
from jax_epilog.float8.scaling import multiplier
from jax_epilog.op import manual_axes
from jax_epilog.op.block_scales import BLOCK, BlockScales
from jax_epilog.op.epilogs import ACTIVATIONS
from jax_epilog.op.reference import block_dequantize, saturating_cast

#: How `quantize_1x128_both` runs where its `kernel` is not given (read when it is traced;
#: the block layers read it once per stack): "pallas" (the default), one Pallas kernel on
#: CUDA (`block_kernel`), the XLA formulation elsewhere; "xla", the XLA formulation;
#: "xla_separate", `quantize_1x128` twice (XLA transposes the 16-bit x first: the previous
#: formulation, kept to measure against). The bytes are the same every way; the kernel
#: quantizes faster than either XLA formulation, and the block-scaled training step runs
#: faster with it (benchmarks/results/block_fp8/block_step.md).
BOTH_COPIES = "pallas"
BOTH_COPIES_CHOICES = ("xla", "pallas", "xla_separate")


def _check(x, name: str = "x"):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating-point array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (rows, K), got shape {x.shape}")


def _check_k(k: int, name: str, axis: str) -> None:
    if k % BLOCK:
        raise ValueError(f"{name}: the quantized axis ({axis}) must be a multiple of {BLOCK}, got "
                         f"{k}; zero-pad it to {-(-k // BLOCK) * BLOCK} first (zeros add nothing "
                         "to the product)")


def _quantize(x, block_amax, expand, dtype: str):
    """(x in FP8, the float32 dequantization scales) from each element's block amax."""
    q = multiplier(block_amax, dtype, 0)
    return saturating_cast(x.astype(jnp.float32) * expand(q), dtype), 1.0 / q


def quantize_1x128(x, dtype="float8_e4m3fn", *, transposed: bool = False):
    """`(x8, BlockScales(values, "1x128"))`: x (rows, K) quantized per 1×128 tile along K,
    each tile's largest |value| mapped to the format's largest finite value (current scaling);
    values (K/128, rows). With `transposed`, xᵀ (K, rows) quantized along rows instead (the
    weight gradient's operand): x8 (K, rows), values (rows/128, K). Zero tiles get scale 1."""
    _check(x)
    dtype = fp8_format("dtype", dtype)
    _check_k(x.shape[0 if transposed else 1], "x",
             "rows, with transposed=True" if transposed else "K, its last axis")
    x8, values = _in_auto_axes(functools.partial(_tiles_1x128, dtype=dtype),
                               x.T if transposed else x)
    return x8, BlockScales(values, "1x128")


def _tiles_1x128(x, dtype: str):
    rows, k = x.shape
    tiles = x.astype(jnp.float32).reshape(rows, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(tiles), axis=2)  # (rows, K/128)
    x8, scale = _quantize(x, amax, lambda q: jnp.repeat(q, BLOCK, axis=1), dtype)
    return x8, scale.T


def _in_auto_axes(quantize, x):
    """`quantize(x)` -> (x8, scale values), under a mesh with Explicit axes run with them made
    Auto (`manual_axes.in_auto_axes`): x8 split as x is, the scales (1/128 of the values at
    most) whole."""
    return manual_axes.in_auto_axes(quantize, (x,), lambda x: (P(*manual_axes.split(x)), P()))


def both_copies_kernel(kernel=None) -> str:
    """`kernel`, or `BOTH_COPIES` where it is None, checked against `BOTH_COPIES_CHOICES`."""
    name, kernel = ("kernel", kernel) if kernel is not None else (
        "jax_epilog.float8.blocks.BOTH_COPIES", BOTH_COPIES)
    if kernel not in BOTH_COPIES_CHOICES:
        raise ValueError(f"{name}: expected one of {', '.join(BOTH_COPIES_CHOICES)}, got "
                         f"{kernel!r}")
    return kernel


def quantize_1x128_both(x, dtype="float8_e4m3fn", *, kernel=None, activation=None,
                        pre_activation=None, column_sums: bool = False):
    """`(quantize_1x128(x), quantize_1x128(x, transposed=True))`, the same bytes: the forward's
    and the weight gradient's copies of an activation (or gradient) x (rows, K), rows a
    multiple of 128. Both copies' amaxes come from x as it lies (the transposed copy's 128×1
    tiles are a column reduction over 128 rows) and only the 1-byte result is transposed, so
    no 16-bit transpose of x is ever made: what XLA would run as separate transpose kernels.
    `kernel`: one of `BOTH_COPIES_CHOICES` (default `BOTH_COPIES`).

    In the same pass (`block_kernel.Prologue`), rounded to x's dtype as a separate fusion
    would write it: `activation` ("relu", "gelu") quantizes act(x), x the pre-activation Z;
    with `pre_activation` Z as well it quantizes x · act'(Z), x = dY (the backward's dZ; GELU
    only: ReLU's backward keeps a 1-bit mask, not Z). `column_sums` adds a third result, the
    quantized tensor's column sums (K,) in float32 before quantization (a bias gradient)."""
    _check(x)
    dtype = fp8_format("dtype", dtype)
    rows, k = x.shape
    _check_k(k, "x", "K, its last axis")
    _check_k(rows, "x", "rows, the transposed copy's tiles")
    kernel = both_copies_kernel(kernel)
    prologue = _prologue(x, activation, pre_activation)
    z = () if pre_activation is None else (pre_activation,)

    def quantized_values(x, *z):  # float32: what both copies quantize
        return prologue(x.astype(jnp.float32), *(a.astype(jnp.float32) for a in z))

    def sums(xf):
        return (jnp.sum(xf, axis=0, dtype=jnp.float32),) if column_sums else ()

    def xla(x, *z):
        xf = quantized_values(x, *z)
        along_k = jnp.max(jnp.abs(xf.reshape(rows, k // BLOCK, BLOCK)), axis=2)  # (rows, K/128)
        along_rows = jnp.max(jnp.abs(xf.reshape(rows // BLOCK, BLOCK, k)), axis=1)  # (rows/128, K)
        x8, scale = _quantize(xf, along_k, lambda q: jnp.repeat(q, BLOCK, axis=1), dtype)
        xt8, t_scale = _quantize(xf, along_rows, lambda q: jnp.repeat(q, BLOCK, axis=0), dtype)
        return (x8, scale.T, xt8.T, t_scale) + sums(xf)

    if kernel == "xla_separate":  # (x itself where there is no prologue: a 16-bit transpose)
        xf = x if prologue.activation is None else quantized_values(x, *z)
        return (quantize_1x128(xf, dtype), quantize_1x128(xf, dtype, transposed=True)) + sums(xf)
    if kernel == "pallas":
        out = jax.lax.platform_dependent(
            x, *z, cuda=functools.partial(block_kernel.quantize_both, dtype=dtype,
                                          prologue=prologue, sums=column_sums), default=xla)
    else:
        out = xla(x, *z)
    x8, scale, xt8, t_scale = out[:4]
    return ((x8, BlockScales(scale, "1x128")), (xt8, BlockScales(t_scale, "1x128"))) + \
        tuple(out[4:])


def _prologue(x, activation, pre_activation) -> block_kernel.Prologue:
    """`quantize_1x128_both`'s prologue for its arguments, checked."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {', '.join(ACTIVATIONS)}, "
                         f"got {activation!r}")
    if pre_activation is None:
        return block_kernel.Prologue(activation, False, jnp.dtype(x.dtype).name)
    if ACTIVATIONS.get(activation, None) is None or \
            ACTIVATIONS[activation].residual != "gelu_aux":
        raise ValueError(f"pre_activation: the derivative from Z runs for activation='gelu' "
                         f"only, got activation={activation!r} (ReLU's backward applies its "
                         "1-bit mask first: pass dZ as x)")
    if getattr(pre_activation, "shape", None) != x.shape:
        raise ValueError(f"pre_activation: expected x's shape {x.shape}, got "
                         f"{getattr(pre_activation, 'shape', type(pre_activation).__name__)}")
    return block_kernel.Prologue(activation, True, jnp.dtype(x.dtype).name)


def quantize_128x128(x, dtype="float8_e4m3fn"):
    """`(x8, BlockScales(values, "128x128"))`: x (rows, K) quantized per 128×128 block (current
    scaling), values (⌈rows/128⌉, K/128); the last row block may be partial."""
    _check(x)
    dtype = fp8_format("dtype", dtype)
    _check_k(x.shape[1], "x", "K, its last axis")
    x8, values = _in_auto_axes(functools.partial(_blocks_128x128, dtype=dtype), x)
    return x8, BlockScales(values, "128x128")


def _blocks_128x128(x, dtype: str):
    rows, k = x.shape
    row_blocks = -(-rows // BLOCK)
    padded = jnp.pad(x.astype(jnp.float32), ((0, row_blocks * BLOCK - rows), (0, 0)))
    blocks = padded.reshape(row_blocks, BLOCK, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(1, 3))  # (rows/128, K/128)

    def expand(q):
        return jnp.repeat(jnp.repeat(q, BLOCK, axis=0), BLOCK, axis=1)[:rows]

    return _quantize(x, amax, expand, dtype)


def quantize_rows(x, dtype="float8_e4m3fn"):
    """`(x8, BlockScales(values, "row"))`: x (rows, K) quantized per row (current scaling),
    values (rows,): per token for an activation, per output channel for a weight stored
    (N, K). Any K. The scaling cuBLASLt calls outer vector (docs/fp8.md, "Row scaling")."""
    _check(x)
    dtype = fp8_format("dtype", dtype)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)  # (rows,)
    x8, scale = _quantize(x, amax, lambda q: q[:, None], dtype)
    return x8, BlockScales(scale, "row")


def transpose_128x128(x8, scales: BlockScales):
    """The transposed copy of a 128×128-quantized x (rows, K): `(x8ᵀ, its BlockScales)`, for
    a GEMM that contracts x's rows (those must then be a multiple of 128)."""
    if not isinstance(scales, BlockScales) or scales.block != "128x128":
        raise TypeError("scales: expected BlockScales of 128x128 blocks (1x128 tiles run along "
                        "one axis: quantize the transposed copy with quantize_1x128(x, "
                        "transposed=True))")
    _check_k(x8.shape[0], "x8", "rows, contracted once transposed")
    return x8.T, BlockScales(scales.values.T, "128x128")


def dequantize(x8, scales: BlockScales):
    """`x8` (rows, K) back to float32: each value times its tile's or block's scale (the
    exact reference dequantization `matmul` computes on other platforms)."""
    return block_dequantize(x8[None], scales.values, scales.block, False)
