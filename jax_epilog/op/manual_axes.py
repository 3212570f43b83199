"""Manual mesh axes: the varying axes of calls inside `jax.shard_map` (with its default
`check_vma=True`), and the per-device functions of the `custom_partitioning` primitives.

Inside `shard_map` a value that differs between devices carries, in its type, the mesh axes it
varies over. The kernel's abstract evaluation does not track them, so the two custom VJPs
(`matmul`'s and the layers') cast every operand to the axes any operand varies over before
entering (JAX differentiates that cast into the psum that the gradient of a replicated input
needs, as for its own ops), and the kernel's outputs to the axes of its operands. Outside
`shard_map` every set is empty and nothing is done.

XLA's partitioner traces a `custom_partitioning` op's per-device function with every mesh axis
manual (`per_device`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

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


def explicitly_sharded(values: Iterable[Any]) -> bool:
    """Whether the type of any of `values` says it is split over a mesh axis: an Explicit
    axis (`jax.make_mesh`'s default, under `jax.set_mesh` or with explicitly sharded
    arguments). With Auto axes types carry no split, and the partitioner decides alone."""
    return any(entry is not None for x in values if x is not None
               for entry in getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()))


def split(x) -> tuple:
    """The mesh axes x's type splits each dimension over (None: whole; all None outside an
    Explicit mesh)."""
    spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
    return spec + (None,) * (x.ndim - len(spec))


def in_auto_axes(fn: Callable, args: tuple, out_specs: Callable):
    """`fn(*args)`, run with the mesh's Explicit axes made Auto (`jax.sharding.auto_axes`)
    where an argument's type is split over one, its results split as `out_specs(*args)` says
    (`PartitionSpec`s, a tree like the results'): for code written for Auto axes (reshapes of
    split dimensions, Pallas calls) that JAX would refuse to type under Explicit ones. XLA's
    partitioner then splits it as it does under Auto axes."""
    if not explicitly_sharded(jax.tree.leaves(args)):
        return fn(*args)
    return jax.sharding.auto_axes(fn, out_sharding=out_specs(*args))(*args)


def rows_in_auto_axes(fn: Callable, rows, *args):
    """`in_auto_axes` of `fn(rows, *args)`, whose (rows, N) result is split as `rows`' rows."""
    return in_auto_axes(fn, (rows, *args),
                        lambda rows, *_: jax.sharding.PartitionSpec(split(rows)[0], None))


def per_device(mesh, local: Callable) -> Callable:
    """`local`, a `custom_partitioning` op's per-device function, traced with every axis of
    `mesh` manual, as the partitioner's callback runs it. Under `jax.set_mesh` of a mesh with
    Explicit axes (`jax.make_mesh`'s default) the ambient abstract mesh would otherwise make
    the ops inside annotate shardings that no partitioner is left to remove (the compile then
    failed: "No registered implementation for untyped custom call to Sharding")."""
    manual = mesh.abstract_mesh.update_axis_types(
        {name: jax.sharding.AxisType.Manual for name in mesh.axis_names})

    @functools.wraps(local)
    def traced(*args):
        with jax.sharding.use_abstract_mesh(manual):
            return local(*args)

    return traced
