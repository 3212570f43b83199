"""`flat_barrier`: the FP8 layers' optimization barrier, each array crossing it flattened,
partitioned like the GEMM so that it keeps every operand's sharding.

A 1-D array has one layout, so XLA's layout assignment cannot move a transpose across the
barrier (`layers/fp8_step.py` says why that matters). Flattening a global array split along a
minor dimension would need the whole array (under `jax.jit` the partitioner gathered the FP8
activations for it), so the barrier is a primitive whose lowering goes through
`custom_partitioning` with a Shardy rule that keeps each operand's sharding: each device
flattens its own block. A primitive, not a bare `custom_partitioning`, so that it has a
batching rule (`vmap` of an FP8 layer's gradient).
"""

from __future__ import annotations

import functools

import jax
from jax._src import dispatch as _jax_dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_epilog.op import manual_axes

flat_barrier_p = Primitive("epilog_flat_barrier")
flat_barrier_p.multiple_results = True


def flat_barrier(*arrays):
    """`jax.lax.optimization_barrier` over `arrays` (None passes), each crossing it flattened
    on every device (per shard, so a sharded h8 or dZ8 stays sharded).

    A 1-D array has one layout, so XLA cannot carry a layout across the barrier: without the
    flattening, layout assignment moved the FP8 weight gradient's transposes (h8ᵀ, dZ8ᵀ) into
    the producers, storing h8 and dZ8 column-major, then transposed the forward's h8 back and
    computed the ReLU derivative on a transposed 16-bit data gradient, several times the time
    of the one-byte transposes it saves (docs/fp8.md, "Layouts")."""
    present = [a for a in arrays if a is not None]
    if not present:
        return arrays
    crossed = iter(flat_barrier_p.bind(*present))
    return tuple(None if a is None else next(crossed) for a in arrays)


def _local_barrier(*arrays):
    flat = jax.lax.optimization_barrier(tuple(a.reshape(-1) for a in arrays))
    return tuple(f.reshape(a.shape) for f, a in zip(flat, arrays))


def _global_barrier(*arrays):
    """The whole arrays' barrier (what one device runs, and the partitioner traces): flattened,
    unless a type says an array is split over Explicit mesh axes, which JAX then refuses to
    flatten (each device's block is flattened by `_local_barrier` after partitioning)."""
    if manual_axes.explicitly_sharded(arrays):
        return jax.lax.optimization_barrier(arrays)
    return _local_barrier(*arrays)


@functools.cache
def _partitioned(ranks: tuple[int, ...]):
    op = custom_partitioning(_global_barrier)
    terms = [" ".join(f"a{i}d{d}" for d in range(rank)) for i, rank in enumerate(ranks)]
    rule = f"{', '.join(terms)} -> {', '.join(terms)}"
    op.def_partition(partition=_partition, sharding_rule=rule)
    return op


def _partition(mesh, arg_shapes, result_shape):
    del result_shape
    shardings = tuple(a.sharding for a in arg_shapes)
    return mesh, manual_axes.per_device(mesh, _local_barrier), shardings, shardings


def _lower(ctx, *arrays):
    op = _partitioned(tuple(len(aval.shape) for aval in ctx.avals_in))
    return mlir.lower_fun(lambda *a: op(*a), multiple_results=True)(ctx, *arrays)


def _batch(arrays, dims):
    return flat_barrier_p.bind(*arrays), dims  # elementwise: each keeps its batch axis


flat_barrier_p.def_abstract_eval(lambda *avals: avals)
flat_barrier_p.def_impl(lambda *arrays: _global_barrier(*arrays))
mlir.register_lowering(flat_barrier_p, _lower)
# The partitioner's callback needs the devices, as for the GEMM (`primitive.py`).
_jax_dispatch.prim_requires_devices_during_lowering.add(flat_barrier_p)
batching.primitive_batchers[flat_barrier_p] = _batch
