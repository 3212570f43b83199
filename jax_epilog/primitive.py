"""`epilog_matmul_p`: the logical primitive (what the op means, not how it runs).

The primitive works on the kernel's normalised operands (rank 3, batch first; `ffi/README.md`):
`a (batch, M, K)` [or `(batch, K, M)` transposed], `b (batch|1, K, N)` [or `(batch|1, N, K)`],
then the epilog's inputs. The public `jax_epilog.matmul` reshapes user arrays into this form, so
the rules here stay small: abstract evaluation (shapes and dtypes of every output), and a
batching rule that folds a vmapped axis into the batch axis the kernel already has. Lowerings
live in `lowering.py`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from .epilogs import Epilog, gelu_aux_columns, relu_mask_bytes

epilog_matmul_p = Primitive("epilog_matmul")
epilog_matmul_p.multiple_results = True


class Problem(NamedTuple):
    """The sizes of one normalised call."""

    batch: int
    m: int
    n: int
    k: int


def problem_of(a_shape, b_shape, transpose_a: bool, transpose_b: bool) -> Problem:
    batch = a_shape[0]
    m, k = (a_shape[2], a_shape[1]) if transpose_a else (a_shape[1], a_shape[2])
    n = b_shape[1] if transpose_b else b_shape[2]
    return Problem(batch, m, n, k)


def input_shape(name: str, p: Problem, bias_batch: int = 1) -> tuple[int, ...]:
    if name == "bias":
        return (bias_batch, p.n)
    if name == "relu_aux":
        return (p.batch, p.m, relu_mask_bytes(p.n))
    return (p.batch, p.m, gelu_aux_columns(p.n))


def output_avals(epilog: Epilog, p: Problem, dtype, b_batch: int) -> list[ShapedArray]:
    """Shapes and dtypes of the kernel's outputs, in the kernel's order."""
    avals = [ShapedArray((p.batch, p.m, p.n), dtype)]
    if epilog.aux_output == "relu_aux":
        avals.append(ShapedArray(input_shape("relu_aux", p), jnp.uint8))
    elif epilog.aux_output == "gelu_aux":
        avals.append(ShapedArray(input_shape("gelu_aux", p), dtype))
    if epilog in (Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD):
        avals.append(ShapedArray((p.batch, p.n), dtype))
    elif epilog == Epilog.BGRADA:
        avals.append(ShapedArray((p.batch, p.m), dtype))
    elif epilog == Epilog.BGRADB:  # one row per batch, also for a shared b (rows then equal)
        avals.append(ShapedArray((p.batch, p.n), dtype))
    return avals


def _abstract_eval(a, b, *inputs, epilog, transpose_a, transpose_b, allow_tf32):
    del allow_tf32
    epilog = Epilog(epilog)
    # The public wrapper has already given readable errors; these guard direct binds.
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"epilog_matmul_p expects rank-3 operands, got {a.shape} and {b.shape}")
    if a.dtype != b.dtype:
        raise TypeError(f"epilog_matmul_p: a and b dtypes differ ({a.dtype} vs {b.dtype})")
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    b_k = b.shape[2] if transpose_b else b.shape[1]
    if b_k != p.k or b.shape[0] not in (1, p.batch):
        raise ValueError(f"epilog_matmul_p: b {b.shape} does not fit a {a.shape}")
    if len(inputs) != len(epilog.input_names):
        raise ValueError(f"epilog_matmul_p: {epilog.name} takes {epilog.input_names}, "
                         f"got {len(inputs)} inputs")
    for name, x in zip(epilog.input_names, inputs):
        bias_batch = x.shape[0] if name == "bias" else 1
        if tuple(x.shape) != input_shape(name, p, bias_batch) or (
                name == "bias" and bias_batch not in (1, p.batch)):
            raise ValueError(f"epilog_matmul_p: {name} has shape {x.shape}, expected "
                             f"{input_shape(name, p, bias_batch)}")
    return output_avals(epilog, p, a.dtype, b.shape[0])


epilog_matmul_p.def_abstract_eval(_abstract_eval)


@functools.cache
def _compiled(**params):
    return jax.jit(functools.partial(epilog_matmul_p.bind, **params))


def _impl(*args, **params):
    """Eager calls run the op jitted alone, as JAX runs its own primitives."""
    return _compiled(**params)(*args)


epilog_matmul_p.def_impl(_impl)


# --- batching -----------------------------------------------------------------------------
# A vmapped axis is folded into the batch axis: (V, batch, ...) -> (V * batch, ...), one
# strided-batched GEMM. Operands that may be shared (b, bias: batch 1, stride 0) stay shared
# when they are not mapped; anything else that is not mapped is broadcast along V.

_SHAREABLE = ("b", "bias")


def fold_batch_axis(x, bdim, name: str, size: int, batch: int):
    if bdim is None:
        if name in _SHAREABLE and x.shape[0] == 1:
            return x
        x = jnp.broadcast_to(x[None], (size, *x.shape))
    else:
        x = jnp.moveaxis(x, bdim, 0)
    if x.shape[1] != batch:  # a shared operand of a mapped call: give every batch its copy
        x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
    return x.reshape(size * batch, *x.shape[2:])


def _batch_rule(args, dims, *, epilog, transpose_a, transpose_b, allow_tf32):
    epilog_e = Epilog(epilog)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    names = ("a", "b", *epilog_e.input_names)
    a_dim = dims[0]
    batch = args[0].shape[1 if a_dim == 0 else 0] if a_dim is not None \
        else args[0].shape[0]
    folded = [fold_batch_axis(x, d, name, size, batch) for x, d, name in zip(args, dims, names)]
    outs = epilog_matmul_p.bind(*folded, epilog=epilog, transpose_a=transpose_a,
                                transpose_b=transpose_b, allow_tf32=allow_tf32)
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)


batching.primitive_batchers[epilog_matmul_p] = _batch_rule


def _no_autodiff(primals, tangents, *, epilog, **params):
    del primals, tangents, params
    epilog = Epilog(epilog)
    if epilog.is_backward:
        raise TypeError(
            f"jax_epilog.matmul with epilog={epilog.name} is itself a gradient computation and "
            "cannot be differentiated; differentiate the forward computation instead "
            "(jax_epilog.dense / jax_epilog.mlp, or matmul with a forward epilog).")
    raise TypeError("epilog_matmul_p is differentiated through jax_epilog.matmul's custom_vjp; "
                    "bind it through jax_epilog.matmul.")


ad.primitive_jvps[epilog_matmul_p] = _no_autodiff
