"""Zero padding of K and N to 16-byte multiples on the CUDA path.

cuBLASLt's fastest kernels need every leading dimension (and so K and N of a row-major
problem) to be a multiple of 16 bytes: 8 elements of float16/bfloat16, 4 of float32, 16 of
FP8 (whose kernels require it; the padded columns give R = 0, so an amax is unchanged). XLA pads
its own GEMMs the same way. The CUDA lowering pads an unaligned K (zero columns of a, zero rows
of b: they add nothing to any sum) and N (zero columns of b and bias, cut off the results).
The masks and GELU pre-activations are padded (and cut) to the rows the padded N needs (the
same 16·⌈N/128⌉ bytes and, for 16/32-bit types, 8·⌈N/8⌉ columns; FP8's 16-column N may need
8 more GELU columns); what lands past N is the part the API leaves unspecified. M is never padded (it is a leading dimension only of a transposed `a`).
Which arrays have an N axis to pad or cut comes from `epilogs.ARRAYS`.

JAX_EPILOG_PAD_UNALIGNED=0 turns padding off (for measuring what it buys).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import config
from .epilogs import ARRAYS, dim_sizes
from .call import Params, names_of, problem_of


def aligned(size: int, dtype) -> int:
    """`size` rounded up to a multiple of 16 bytes of `dtype`."""
    multiple = max(1, 16 // np.dtype(dtype).itemsize)
    return -(-size // multiple) * multiple


def needed(avals_in: Sequence, transpose_a: bool, transpose_b: bool) -> bool:
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    return config.pad_unaligned() and (p.k != aligned(p.k, a.dtype) or
                                       p.n != aligned(p.n, a.dtype))


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


_N_DIMS = ("n", "mask_bytes", "gelu_cols")  # the axes whose length follows N


def _resize_n_axes(x, name: str, n: int, cut: bool):
    """`x` (the array `name`) with every axis that follows N padded (or `cut`) to N = n."""
    sizes = dim_sizes(1, 1, n)
    for axis, dim in enumerate(ARRAYS[name].dims):
        if dim in _N_DIMS and x.shape[axis] != sizes[dim]:
            x = jax.lax.slice_in_dim(x, 0, sizes[dim], axis=axis) if cut \
                else _pad_axis(x, axis, sizes[dim])
    return x


def padded(bind: Callable, params: Params) -> Callable:
    """`bind` (a primitive on normalised operands) called on K and N padded to alignment, with
    the results cut back to the caller's shapes."""
    ta, tb = params.transpose_a, params.transpose_b

    def call(a, b, *inputs):
        operand_names, result_names = names_of(params, a.dtype)
        p = problem_of(a.shape, b.shape, ta, tb)
        k, n = aligned(p.k, a.dtype), aligned(p.n, a.dtype)
        a = _pad_axis(a, 1 if ta else 2, k)
        b = _pad_axis(_pad_axis(b, 2 if tb else 1, k), 1 if tb else 2, n)
        if params.result_amax and "gelu_aux" in operand_names:
            # Its columns past N are the caller's (unspecified) and meet the padded product's
            # zeros there: zero them, so that 0 * gelu'(garbage) cannot reach the amax.
            i = operand_names.index("gelu_aux") - 2
            inputs = list(inputs)
            inputs[i] = inputs[i].at[..., p.n:].set(0)
        inputs = [_resize_n_axes(x, name, n, cut=False)
                  for name, x in zip(operand_names[2:], inputs)]
        y, *rest = bind(a, b, *inputs)
        cut = [_resize_n_axes(x, name, p.n, cut=True) for name, x in zip(result_names[1:], rest)]
        return [y[..., :p.n], *cut]

    return call
