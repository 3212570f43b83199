"""Varying manual axes, for calls inside `jax.shard_map` (with its default `check_vma=True`).

Inside `shard_map` a value that differs between devices carries, in its type, the mesh axes it
varies over. The kernel's abstract evaluation does not track them, so the two custom VJPs
(`matmul`'s and the layers') cast every operand to the axes any operand varies over before
entering (JAX differentiates that cast into the psum that the gradient of a replicated input
needs, as for its own ops), and the kernel's outputs to the axes of its operands. Outside
`shard_map` every set is empty and nothing is done.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax


def _varying(x) -> frozenset:
    manual_axis_type = getattr(jax.typeof(x), "mat", None)
    return getattr(manual_axis_type, "varying", frozenset())


def varying_axes(values: Iterable[Any]) -> tuple:
    """The manual axes any of `values` (None skipped) varies over, in a fixed order."""
    axes = frozenset().union(*(_varying(x) for x in values if x is not None))
    return tuple(sorted(axes, key=str))


def vary(x, axes: tuple):
    """`x`, marked as varying over `axes` too (a no-op where it already does, or x is None)."""
    if x is None or not axes:
        return x
    missing = tuple(a for a in axes if a not in _varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def result_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """`jax.ShapeDtypeStruct(shape, dtype)` varying over the manual axes `like` varies over:
    a Pallas call's `out_shape` inside `shard_map` (`check_vma=True` refuses one without
    them). `like`: an operand already `vary`'d to the axes of every operand."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=getattr(jax.typeof(like), "mat", None))
