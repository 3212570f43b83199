"""One call of the op as the two primitives see it: its static parameters (`Params`), its
sizes (`Problem`), the names of its operands and results, and the two primitives themselves,
declared here; each primitive's rules are in one module (the outer `epilog_matmul_p`'s in
`primitive.py`, the inner `kernel_p`'s in `lowering.py`), which bind them from here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from jax_epilog.op.epilogs import ARRAYS, Epilog, dim_sizes, is_fp8, operand_names, result_names


class _Fields(NamedTuple):
    epilog: Epilog
    transpose_a: bool
    transpose_b: bool
    allow_tf32: bool
    backend: str = "auto"  # "cublaslt", "xla", or "auto": per problem (planning/decisions.py)
    result_dtype: Optional[str] = None  # y's dtype name; None: the operands' dtype
    result_amax: bool = False  # FP8 calls: also return max |R| (SPEC §5)
    has_c: bool = False  # operands c, alpha, beta follow (SPEC §6): R = epilog(αP + βC)
    # FP8 calls only: cuBLASLt's FP8 fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM) on
    # the kernel; the reference ignores it (it computes the exact float32 formula).
    fast_accumulation: bool = False
    # Block-scaled FP8 calls only (`block_scales`): a's and b's tiles, e.g. ("1x128",
    # "128x128"); their scales are then arrays of those tiles. None: per-tensor scalars.
    block_scaling: Optional[tuple[str, str]] = None


class Params(_Fields):
    """The static parameters of a call (hashable: a custom_vjp non-differentiable argument).
    The epilog is an `Epilog` from the public call to the FFI boundary, where it becomes the
    custom call's attribute (`runtime.targets`).

    The scales of an FP8 call are operands, not parameters: traced values work under `jit`.
    """

    __slots__ = ()

    def __new__(cls, epilog, *args, **kwargs):
        return super().__new__(cls, Epilog(epilog), *args, **kwargs)


def result_dtype_of(params, operand_dtype) -> np.dtype:
    """y's dtype for `params` (a `Params` or its dict) and operands of `operand_dtype`."""
    name = params["result_dtype"] if isinstance(params, dict) else params.result_dtype
    return jnp.dtype(name or operand_dtype)


def names_of(params, operand_dtype) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(operand names, result names) of a call, in the kernel's order (`epilogs.ARRAYS` keys
    and "a", "b", "y")."""
    get = params.get if isinstance(params, dict) else functools.partial(getattr, params)
    epilog = Epilog(get("epilog"))
    return (operand_names(epilog, operand_dtype, result_dtype_of(params, operand_dtype),
                          bool(get("has_c", False))),
            result_names(epilog, bool(get("result_amax", False))))


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


#: The outer primitive, what a user's jaxpr holds, and the inner one, one device's call
#: (`primitive.py` and `lowering.py`, each with every rule of its primitive).
epilog_matmul_p = Primitive("epilog_matmul")
kernel_p = Primitive("epilog_matmul_kernel")


def plain_product(primitive, params: Params, a, b):
    """`primitive` (either of the two) computing only the plain product P = a @ b of a call, as
    float32 for FP8 operands (unit scales: the caller applies the real ones), else in the
    operands' dtype."""
    plain = params._replace(epilog=Epilog.DEFAULT, result_amax=False, has_c=False,
                            block_scaling=None, result_dtype="float32" if is_fp8(a.dtype) else None)
    ones = [jnp.ones((), jnp.float32)] * (2 if is_fp8(a.dtype) else 0)
    return primitive.bind(a, b, *ones, **plain._asdict())[0]
