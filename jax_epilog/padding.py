"""Zero padding of K and N to 16-byte multiples on the CUDA path.

cuBLASLt's fastest kernels need every leading dimension (and so K and N of a row-major
problem) to be a multiple of 16 bytes: 8 elements of float16/bfloat16, 4 of float32. XLA pads
its own GEMMs the same way. The CUDA lowering pads an unaligned K (zero columns of a, zero rows
of b: they add nothing to any sum) and N (zero columns of b and bias, cut off the results).
The masks and GELU pre-activations keep their shapes: their rows already have room for the
padded columns (16·⌈N/128⌉ bytes, 8·⌈N/8⌉ columns), and what lands there is the part the API
leaves unspecified. M is never padded (it is a leading dimension only of a transposed `a`).
Which arrays have an N axis to pad or cut comes from `epilogs.ARRAYS`.

JAX_EPILOG_PAD_UNALIGNED=0 turns padding off (for measuring what it buys).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from . import config
from .epilogs import ARRAYS, Epilog
from .primitive import Params, problem_of


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


def _n_axis(name: str):
    dims = ARRAYS[name].dims
    return dims.index("n") if "n" in dims else None


def padded(bind: Callable, params: Params) -> Callable:
    """`bind` (a primitive on normalised operands) called on K and N padded to alignment, with
    the results cut back to the caller's shapes."""
    epilog = Epilog(params.epilog)
    ta, tb = params.transpose_a, params.transpose_b

    def call(a, b, *inputs):
        p = problem_of(a.shape, b.shape, ta, tb)
        k, n = aligned(p.k, a.dtype), aligned(p.n, a.dtype)
        a = _pad_axis(a, 1 if ta else 2, k)
        b = _pad_axis(_pad_axis(b, 2 if tb else 1, k), 1 if tb else 2, n)
        inputs = [x if _n_axis(name) is None else _pad_axis(x, _n_axis(name), n)
                  for name, x in zip(epilog.input_names, inputs)]
        y, *rest = bind(a, b, *inputs)
        cut = [x if _n_axis(name) is None else x[..., :p.n]
               for name, x in zip(epilog.output_names, rest)]
        return [y[..., :p.n], *cut]

    return call
