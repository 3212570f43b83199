"""Block-scaled FP8 operands (the DeepSeek-V3 recipe; docs/fp8.md, "Block scaling"): one
float32 dequantization scale per 1×128 tile or per 128×128 block of an FP8 operand, where
per-tensor FP8 has one per tensor; or one per row (per token of a, per output channel of b:
docs/fp8.md, "Row scaling"). cuBLASLt runs them on Hopper since 12.9
(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / _BLK128x128_32F / _OUTER_VEC_32F).

Tiles always run along the contraction K, so the scales are defined on the operand as the
product reads it, op(x) of shape (rows, K) (rows: M for a, N for b), whatever its transpose:

- ``"1x128"``: `values` (K/128, rows); ``values[j, i]`` scales ``op(x)[i, 128j:128j+128]``;
- ``"128x128"``: `values` (⌈rows/128⌉, K/128); ``values[i, j]`` scales the block
  ``op(x)[128i:128i+128, 128j:128j+128]`` (the last row block may be partial);
- ``"row"``: `values` (rows,); ``values[i]`` scales the whole row ``op(x)[i, :]``. Both
  operands then have row scales (cuBLASLt's outer vector scaling), and the scale of y[i, j]
  is ``a_values[i] * b_values[j]``.

These are cuBLASLt's own layouts without its padding: `kernel_values` pads the inner
dimension of tiles and blocks to a multiple of 4 (16 bytes) right before the custom call.
With tiles or blocks K must be a multiple of 128 (refused otherwise: zero-pad K before
quantizing); with row scales any K; rows may be any size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

#: A tile's length along K, and a block's edge.
BLOCK = 128
#: The tile shapes, as `BlockScales.block` names them.
BLOCKS = ("1x128", "128x128", "row")
#: The epilogs block-scaled calls run (cuBLASLt on Hopper: docs/fp8.md's support matrix).
SUPPORTED_EPILOGS = ("DEFAULT", "BIAS")
#: The epilogs calls with row scales take: the forward ones. An epilog that reads an aux
#: input or sums an operand (the backward ones) would need those in the operands' scales.
ROW_EPILOGS = ("DEFAULT", "BIAS", "RELU", "RELU_BIAS", "GELU", "GELU_BIAS", "RELU_AUX",
               "RELU_AUX_BIAS", "GELU_AUX", "GELU_AUX_BIAS")


@dataclasses.dataclass(frozen=True)
class BlockScales:
    """An FP8 operand's block scales for `matmul(..., quantization_scales={"a": BlockScales,
    "b": BlockScales})`: `values` float32 in the layout of `block` (module docstring), and
    `block`, ``"1x128"``, ``"128x128"`` or ``"row"``. The operand stands for its values times
    the scale of the tile, block or row each value is in. A pytree whose one leaf is `values` (`block` is
    static), so it passes through `jax.jit` and `lax.scan` as an array does."""

    values: Any
    block: str = "1x128"


jax.tree_util.register_pytree_node(
    BlockScales, lambda s: ((s.values,), s.block),
    lambda block, leaves: BlockScales(leaves[0], block))


def scale_shape(block: str, rows: int, k: int) -> tuple[int, int]:
    """The shape of `BlockScales.values` for an operand op(x) of shape (rows, k)."""
    if block == "row":
        return (rows,)
    if block == "1x128":
        return (k // BLOCK, rows)
    return (-(-rows // BLOCK), k // BLOCK)


def is_block_scales(x) -> bool:
    return isinstance(x, BlockScales)


def check_call(blocks: tuple[str, str], k: int, *, epilog, has_c: bool, result_dtype,
               result_amax: bool, fast_accumulation: bool, batched: bool) -> None:
    """Refuses what the block-scaled kernels do not run, naming the argument: two 128x128
    operands, row scales on one operand only, a K that is not a multiple of 128 (tiles and
    blocks), the epilogs and the options they do not take."""
    for key, block in zip("ab", blocks):
        if block not in BLOCKS:
            raise ValueError(f"quantization_scales[{key!r}].block: expected one of {BLOCKS}, "
                             f"got {block!r}")
    rows = "row" in blocks
    if rows and blocks != ("row", "row"):  # cuBLASLt scales the rows of both or of neither
        plain = "b" if blocks[0] == "row" else "a"
        raise ValueError(f"quantization_scales[{plain!r}]: with row scales for the other "
                         "operand this one needs row scales too; a per-tensor scale s becomes "
                         "BlockScales(jnp.full((rows,), s, jnp.float32), 'row')")
    if blocks == ("128x128", "128x128"):
        raise ValueError("quantization_scales: a and b both have 128x128 block scales, which "
                         "cuBLASLt does not multiply; give the activation-like operand 1x128 "
                         "tiles (jax_epilog.quantize_1x128)")
    if k % BLOCK and not rows:
        raise ValueError(f"a: block-scaled operands need K a multiple of {BLOCK}, got K={k}; "
                         f"zero-pad K (columns of a and rows of b) to {-(-k // BLOCK) * BLOCK} "
                         "before quantizing (zeros add nothing to the product)")
    kind, epilogs = ("calls with row scales", ROW_EPILOGS) if rows else \
        ("block-scaled calls", SUPPORTED_EPILOGS)
    if epilog.name not in epilogs:
        raise ValueError(f"epilog: {kind} run {', '.join(epilogs)}, got {epilog.name}"
                         + ("" if rows else "; apply the activation in the fusion that "
                            "quantizes the next operand"))
    refused = [("c", has_c), ("result_amax", result_amax),
               ("fast_accumulation", fast_accumulation and not rows),
               ("preferred_element_type", jnp.dtype(result_dtype).name.startswith("float8")),
               ("a", batched)]
    for name, present in refused:
        if present:
            what = {"preferred_element_type": "an FP8 result",
                    "a": "leading (batch) dimensions: pass 2-D a and b"}.get(name, name)
            raise ValueError(f"{name}: {kind} take no {what}; they run 2-D a and b to a "
                             "16/32-bit y")


def check_values(key: str, scales: BlockScales, rows: int, k: int):
    """`scales.values` as a float32 array of the shape its block asks for."""
    label = f"quantization_scales[{key!r}]"
    values = scales.values
    dtype = getattr(values, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.float32:
        raise TypeError(f"{label}.values: expected a float32 array, got "
                        f"{jnp.dtype(dtype).name if dtype is not None else type(values).__name__}")
    want = scale_shape(scales.block, rows, k)
    if tuple(values.shape) != want:
        rows_name = "M" if key == "a" else "N"
        raise ValueError(f"{label}.values: expected shape {want} for {scales.block} scales of "
                         f"op({key}) ({rows_name}={rows}, K={k}), got {tuple(values.shape)} "
                         f"(layout: docs/fp8.md, "
                         f"{'Row scaling' if scales.block == 'row' else 'Block scaling'!r})")
    return jnp.asarray(values)


#: The CUDA lowering pads the rows of a 1x128-scaled a to a multiple of this (lowering.py).
TILE_ROWS_MULTIPLE = 16


def kernel_rows(blocks: tuple[str, str], m: int) -> int:
    """The rows M the kernel runs for a call of M rows: padded to `TILE_ROWS_MULTIPLE` where
    a has 1x128 scales."""
    if blocks[0] != "1x128":
        return m
    return -(-m // TILE_ROWS_MULTIPLE) * TILE_ROWS_MULTIPLE


def kernel_values(values, block: str):
    """`values` in cuBLASLt's layout: row scales as one row (the custom call's scale operands
    are 2-D), tiles' and blocks' inner dimension padded to a multiple of 4."""
    if block == "row":
        return values.reshape(1, -1)
    inner = values.shape[1]
    padded = -(-inner // 4) * 4
    if padded == inner:
        return values
    return jnp.pad(values, ((0, 0), (0, padded - inner)), constant_values=1.0)


#: What the custom call's scale attributes carry for row scales (for tiles and blocks: their
#: rows, 1 or 128).
ROW_SCALES = -1


def block_rows(block: str) -> int:
    """The rows of one tile, or `ROW_SCALES`: what the custom call's scale attributes carry."""
    return {"1x128": 1, "128x128": BLOCK, "row": ROW_SCALES}[block]


def expand(values, block: str, rows: int, k: int):
    """`values` broadcast to one scale per element of op(x) (rows, k), float32."""
    if block == "row":
        return jnp.broadcast_to(values[:, None], (rows, k))
    if block == "1x128":
        per_row = values.T  # (rows, k/128)
        return jnp.repeat(per_row, BLOCK, axis=1)
    full = jnp.repeat(jnp.repeat(values, BLOCK, axis=0), BLOCK, axis=1)
    return full[:rows, :k]


__all__ = ["BLOCK", "BLOCKS", "BlockScales", "ROW_EPILOGS", "ROW_SCALES", "SUPPORTED_EPILOGS", "block_rows", "check_call",
           "check_values", "expand", "is_block_scales", "kernel_values", "scale_shape"]
