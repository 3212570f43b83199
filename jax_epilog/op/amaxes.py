"""`amaxes`: the amaxes (max |x|, float32) of several arrays as one vector, partitioned so that
a sharded program reduces them all in ONE all-reduce.

Under `jax.jit` with sharded arrays, a `jnp.max` of each array makes XLA's partitioner insert an
all-reduce per array and per mesh axis that splits it (a tensor split over "data" and "model"
got two); XLA combines a few of them, as it chooses. This primitive's lowering goes through
`custom_partitioning`: each device takes the amax of its own block of every array, then one
`pmax` of that vector over every mesh axis that splits any of them, so the FP8 layers' amaxes
that are independent of each other (every kernel's, the stack input's) cost one collective.
A primitive, not a bare `custom_partitioning`, so that it has a batching rule (`vmap`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src import dispatch as _jax_dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_epilog.op import manual_axes

amaxes_p = Primitive("epilog_amaxes")


def amax(x):
    """max |x| in float32 (0 for an empty x)."""
    return jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)


def amaxes(*arrays, one_pass: bool = False):
    """float32 `(len(arrays),)`: `amax` of each array, one collective where they are sharded.
    `one_pass`: the arrays of one shape in one variadic reduction, so that XLA reads them in
    one pass (made of separate reductions, SwiGLU's h, g and u took two passes as XLA compiled
    them, and their casts two more). Not the default: a variadic reduction keeps XLA from
    fusing its operands' producers into other fusions (the GPT example's step moved more bytes
    with it everywhere)."""
    return amaxes_p.bind(*arrays, one_pass=one_pass)


def _local(*arrays, one_pass: bool = False):
    if not one_pass:
        return jnp.stack([amax(a) for a in arrays])
    found = [None] * len(arrays)
    by_shape: dict = {}
    for i, a in enumerate(arrays):
        by_shape.setdefault(jnp.shape(a), []).append(i)
    for shape, members in by_shape.items():
        if len(members) == 1 or not math.prod(shape):
            for i in members:
                found[i] = amax(arrays[i])
            continue
        magnitudes = [jnp.abs(arrays[i]).astype(jnp.float32) for i in members]
        zeros = [jnp.float32(0)] * len(members)
        reduced = jax.lax.reduce(magnitudes, zeros, lambda a, b: [jnp.maximum(x, y) for x, y
                                                                   in zip(a, b)],
                                 tuple(range(len(shape))))
        for i, r in zip(members, reduced):
            found[i] = r
    return jnp.stack(found)


@functools.cache
def _partitioned(ranks: tuple[int, ...], one_pass: bool):
    op = custom_partitioning(lambda *arrays: _local(*arrays, one_pass=one_pass))
    terms = [" ".join(f"a{i}d{d}" for d in range(rank)) for i, rank in enumerate(ranks)]
    # every operand dimension a reduction; the vector is replicated
    op.def_partition(partition=functools.partial(_partition, one_pass=one_pass),
                     sharding_rule=f"{', '.join(terms)} -> n",
                     reduction_factors=tuple(t for term in terms for t in term.split()),
                     need_replication_factors=("n",))
    return op


def _partition(mesh, arg_shapes, result_shape, one_pass: bool):
    del result_shape
    shardings = tuple(a.sharding for a in arg_shapes)
    axes = []  # the mesh axes that split any operand, each once, in the mesh's order
    for sharding in shardings:
        if not hasattr(sharding, "spec") and not sharding.is_fully_replicated:
            axes.extend(mesh.axis_names)  # no spec to read: every axis (a max is idempotent)
        for entry in getattr(sharding, "spec", ()):
            for name in (entry,) if isinstance(entry, str) else (entry or ()):
                axes.append(name)
    axes = tuple(a for a in mesh.axis_names if a in axes)

    def local(*arrays):
        vector = _local(*arrays, one_pass=one_pass)
        return jax.lax.pmax(vector, axes) if axes else vector

    return mesh, manual_axes.per_device(mesh, local), NamedSharding(mesh, P()), shardings


def _lower(ctx, *arrays, one_pass: bool):
    op = _partitioned(tuple(len(aval.shape) for aval in ctx.avals_in), one_pass)
    return mlir.lower_fun(lambda *a: op(*a), multiple_results=False)(ctx, *arrays)


def _batch(arrays, dims, one_pass: bool):
    """Under `vmap`: each batch element's amaxes, `(batch, len(arrays))`, as plain reductions
    (`one_pass` not kept)."""
    del one_pass
    size = next(a.shape[d] for a, d in zip(arrays, dims) if d is not None)
    moved = [jnp.broadcast_to(a[None], (size, *a.shape)) if d is None
             else jnp.moveaxis(a, d, 0) for a, d in zip(arrays, dims)]
    per_element = [jnp.max(jnp.abs(a).reshape(size, -1), axis=1, initial=0).astype(jnp.float32)
                   for a in moved]
    return jnp.stack(per_element, axis=1), 0


amaxes_p.def_abstract_eval(
    lambda *avals, one_pass: jax.core.ShapedArray((len(avals),), jnp.float32))
amaxes_p.def_impl(_local)
mlir.register_lowering(amaxes_p, _lower)
# The partitioner's callback needs the devices, as for the GEMM (`primitive.py`).
_jax_dispatch.prim_requires_devices_during_lowering.add(amaxes_p)
batching.primitive_batchers[amaxes_p] = _batch
