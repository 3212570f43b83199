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

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_epilog.op.epilogs import ARRAYS, dim_sizes
from jax_epilog.op.call import Params, names_of, problem_of
from jax_epilog.runtime import settings


def aligned(size: int, dtype) -> int:
    """`size` rounded up to a multiple of 16 bytes of `dtype`."""
    multiple = max(1, 16 // np.dtype(dtype).itemsize)
    return -(-size // multiple) * multiple


def padded_sizes(avals_in: Sequence, params: Params) -> Optional[tuple[int, int]]:
    """(K, N) rounded up to 16 bytes where either is unaligned and padding is on, else None."""
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b)
    k, n = aligned(p.k, a.dtype), aligned(p.n, a.dtype)
    return (k, n) if (k, n) != (p.k, p.n) and settings.pad_unaligned() else None


def padded_avals(avals_in: Sequence, params: Params, sizes: tuple[int, int]) -> list:
    """The avals of the operands `padded` gives the kernel."""
    return [ShapedArray(x.shape, x.dtype)
            for x in jax.eval_shape(_pad_operands(params, sizes), *avals_in)]


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


def _pad_operands(params: Params, sizes: tuple[int, int]) -> Callable:
    ta, tb = params.transpose_a, params.transpose_b
    k, n = sizes

    def pad(a, b, *inputs):
        operand_names, _ = names_of(params, a.dtype)
        p = problem_of(a.shape, b.shape, ta, tb)
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
        if params.block_scaling and params.block_scaling[1] in ("1x128", "row"):
            # a scale per row of b, on the scales' last axis: the padded rows' are 1
            i = operand_names.index("scale_b") - 2
            widths = [(0, 0)] * (inputs[i].ndim - 1) + [(0, n - p.n)]
            inputs[i] = jnp.pad(inputs[i], widths, constant_values=1.0)
        return [a, b, *inputs]

    return pad


def padded(kernel: Callable, params: Params, sizes: tuple[int, int]) -> Callable:
    """`kernel` (a call on normalised operands) on K and N zero-padded to `sizes`
    (`padded_sizes`), with the results cut back to the caller's shapes."""
    pad = _pad_operands(params, sizes)

    def call(a, b, *inputs):
        _, result_names = names_of(params, a.dtype)
        n = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b).n
        y, *rest = kernel(*pad(a, b, *inputs))
        cut = [_resize_n_axes(x, name, n, cut=True) for name, x in zip(result_names[1:], rest)]
        return [y[..., :n], *cut]

    return call
