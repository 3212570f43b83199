"""The two primitives (the outer/inner pattern of JAX's cuDNN attention and TransformerEngine).

- `epilog_matmul_p`, the OUTER primitive, is what a user's jaxpr contains: abstract evaluation,
  the one batching rule, the readable error under differentiation, and a lowering that hands the
  call to the SPMD partitioner (`sharding.partitioned`), which places one local call per device.
- `kernel_p`, the INNER primitive, is one device's call; it appears only inside that lowering.
  It lowers to the cuBLASLt custom call on CUDA and to the reference elsewhere (`lowering.py`).

Both work on the kernel's normalised operands (rank 3, batch first; `ffi/README.md`):
`a (batch, M, K)` [or `(batch, K, M)` transposed], `b (batch|1, K, N)` [or `(batch|1, N, K)`],
then the epilog's inputs. The public `jax_epilog.matmul` reshapes user arrays into this form.
Shapes and dtypes of every input and output come from `epilogs.TABLE`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import dispatch as _jax_dispatch
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .epilogs import ARRAYS, Epilog, dim_sizes

BACKENDS = ("auto", "cublaslt", "xla")


class Params(NamedTuple):
    """The static parameters of a call (hashable: a custom_vjp non-differentiable argument)."""

    epilog: int
    transpose_a: bool
    transpose_b: bool
    allow_tf32: bool
    backend: str = "auto"  # "cublaslt", "xla", or "auto": per problem (dispatch.py)


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


def array_shape(name: str, p: Problem, bias_batch: int = 1) -> tuple[int, ...]:
    sizes = dim_sizes(p.batch, p.m, p.n, bias_batch)
    return tuple(sizes[d] for d in ARRAYS[name].dims)


def array_dtype(name: str, dtype):
    return jnp.dtype(ARRAYS[name].dtype or dtype)


def _abstract_eval(a, b, *inputs, epilog, transpose_a, transpose_b, allow_tf32, backend):
    del allow_tf32, backend
    epilog = Epilog(epilog)
    # `matmul` has already given readable errors; these guard direct binds.
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"epilog_matmul: expects rank-3 operands, got {a.shape} and {b.shape}")
    if a.dtype != b.dtype:
        raise TypeError(f"epilog_matmul: a and b dtypes differ ({a.dtype} vs {b.dtype})")
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    b_k = b.shape[2] if transpose_b else b.shape[1]
    if b_k != p.k or b.shape[0] not in (1, p.batch):
        raise ValueError(f"epilog_matmul: b {b.shape} does not fit a {a.shape}")
    if len(inputs) != len(epilog.input_names):
        raise ValueError(f"epilog_matmul: {epilog.name} takes {epilog.input_names}, "
                         f"got {len(inputs)} inputs")
    bias_batch = 1
    for name, x in zip(epilog.input_names, inputs):
        bias_batch = x.shape[0] if name == "bias" else bias_batch
        expected = array_shape(name, p, bias_batch)
        if tuple(x.shape) != expected or bias_batch not in (1, p.batch):
            raise ValueError(f"epilog_matmul: {name} has shape {x.shape}, expected {expected}")
    return [ShapedArray((p.batch, p.m, p.n), a.dtype)] + [
        ShapedArray(array_shape(name, p), array_dtype(name, a.dtype))
        for name in epilog.output_names]


epilog_matmul_p = Primitive("epilog_matmul")
kernel_p = Primitive("epilog_matmul_kernel")
for _p in (epilog_matmul_p, kernel_p):
    _p.multiple_results = True
    _p.def_abstract_eval(_abstract_eval)


@functools.cache
def _compiled(**params):
    return jax.jit(functools.partial(epilog_matmul_p.bind, **params))


def _impl(*args, **params):
    """Eager calls run the op jitted alone, as JAX runs its own primitives."""
    return _compiled(**params)(*args)


epilog_matmul_p.def_impl(_impl)


def _lower_outer(ctx, *args, **params):
    from . import sharding  # sharding binds kernel_p, defined above
    fn = functools.partial(sharding.partitioned, Params(**params))
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(epilog_matmul_p, _lower_outer)
# That lowering runs the partitioner's callback, which needs the devices, as JAX declares for
# `custom_partitioning_p` itself (JAX's cuDNN attention and TransformerEngine do the same).
_jax_dispatch.prim_requires_devices_during_lowering.add(epilog_matmul_p)


# --- batching: a vmapped axis is folded into the batch axis ---------------------------------
# (V, batch, ...) -> (V * batch, ...): one strided-batched GEMM. Operands that may be shared
# (b, bias: batch 1, stride 0) stay shared when they are not mapped; anything else that is not
# mapped is broadcast along V.

_SHAREABLE = ("b", "bias")


def _fold_batch_axis(x, bdim, name: str, size: int, batch: int):
    if bdim is None:
        if name in _SHAREABLE and x.shape[0] == 1:
            return x
        x = jnp.broadcast_to(x[None], (size, *x.shape))
    else:
        x = jnp.moveaxis(x, bdim, 0)
    if x.shape[1] != batch:  # a shared operand of a mapped call: give every batch its copy
        x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
    return x.reshape(size * batch, *x.shape[2:])


def _batch_rule(args, dims, **params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    names = ("a", "b", *Epilog(params["epilog"]).input_names)
    a, a_dim = args[0], dims[0]
    batch = a.shape[0] if a_dim is None else a.shape[1 if a_dim == 0 else 0]
    folded = [_fold_batch_axis(x, d, name, size, batch) for x, d, name in zip(args, dims, names)]
    outs = epilog_matmul_p.bind(*folded, **params)
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
    raise TypeError("epilog_matmul is differentiated through jax_epilog.matmul's custom_vjp; "
                    "bind it through jax_epilog.matmul.")


ad.primitive_jvps[epilog_matmul_p] = _no_autodiff
