"""Zero padding of K and N to 16-byte multiples on the CUDA path.

cuBLASLt's fastest kernels need every leading dimension (and so K and N of a row-major
problem) to be a multiple of 16 bytes: 8 elements of float16/bfloat16, 4 of float32. XLA pads
its own GEMMs the same way. The CUDA lowering pads an unaligned K (zero columns of a, zero rows
of b: they add nothing to any sum) and N (zero columns of b and bias, sliced off the results).
The masks and GELU pre-activations keep their shapes: their rows already have room for the
padded columns (16·⌈N/128⌉ bytes, 8·⌈N/8⌉ columns), and what lands there is the part the API
leaves unspecified. M is never padded (it is a leading dimension only of a transposed `a`).

`JAX_EPILOG_PAD_UNALIGNED=0` turns padding off (for measuring what it buys).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from .epilogs import Epilog
from .primitive import problem_of

PAD_ENV = "JAX_EPILOG_PAD_UNALIGNED"


def enabled() -> bool:
    return os.environ.get(PAD_ENV, "1") != "0"


def aligned(size: int, dtype) -> int:
    """`size` rounded up to a multiple of 16 bytes of `dtype`."""
    multiple = max(1, 16 // np.dtype(dtype).itemsize)
    return -(-size // multiple) * multiple


def needed(avals_in: Sequence, transpose_a: bool, transpose_b: bool) -> bool:
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    return enabled() and (p.k != aligned(p.k, a.dtype) or p.n != aligned(p.n, a.dtype))


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def padded(bind: Callable, epilog: int, transpose_a: bool, transpose_b: bool) -> Callable:
    """`bind` (the primitive on normalised operands) called on K and N padded to alignment,
    with the results cut back to the caller's shapes."""
    epilog = Epilog(epilog)

    def call(a, b, *inputs):
        p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
        k, n = aligned(p.k, a.dtype), aligned(p.n, a.dtype)
        a = _pad_axis(a, 1 if transpose_a else 2, k)
        b = _pad_axis(b, 2 if transpose_b else 1, k)
        b = _pad_axis(b, 1 if transpose_b else 2, n)
        inputs = [_pad_axis(x, 1, n) if name == "bias" else x
                  for name, x in zip(epilog.input_names, inputs)]
        y, *rest = bind(a, b, *inputs)
        # Outputs after y: the aux (shape kept), then a bias gradient over N (cut) or M (kept).
        cut = [r[..., :p.n] if r.ndim == 2 and epilog != Epilog.BGRADA else r for r in rest]
        return [y[..., :p.n], *cut]

    return call
