"""The activations of cuBLASLt's epilogs, as cuBLASLt computes them, and the ReLU bit mask.

Special values behave as cuBLASLt's epilogs were found to on the GPU
(`scripts/probe_special_values.py`): ReLU keeps NaN and turns -0 into +0, its mask bit is set
for +0, -0 and NaN, and GELU's derivative overflows to NaN for huge |z|.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def relu_mask_bytes(n: int) -> int:
    """Bytes per row of a ReLU bit mask: cuBLASLt's leading dimension is N rounded up to 128 bits."""
    return 16 * -(-n // 128)


def gelu_aux_columns(n: int) -> int:
    """Columns per row of the GELU pre-activation buffer: N rounded up to 8 elements."""
    return 8 * -(-n // 8)


def relu(z):
    """ReLU as cuBLASLt computes it: NaN stays NaN, -0 becomes +0."""
    return jnp.where((z > 0) | jnp.isnan(z), z, jnp.zeros_like(z))


def relu_mask(z):
    """The mask bit cuBLASLt writes: set unless z < 0 (so +0, -0 and NaN are set). The
    gradient passes where the bit is set."""
    return ~(z < 0)


def gelu(z):
    """The tanh approximation of GELU (`jax.nn.gelu`'s default), as cuBLASLt's GELU epilogs
    compute it."""
    return jax.nn.gelu(z, approximate=True)


def gelu_derivative(z):
    """d/dz of the tanh-approximated GELU (what DGELU multiplies the product by).

    Written as cuBLASLt evaluates it: for |z| past ~1e12 (z**3 overflows float32) and for
    ±Inf the result is NaN, as cuBLASLt's is (tests/op/test_nonfinite.py).
    """
    u = _SQRT_2_OVER_PI * (z + _GELU_CUBIC * z * z * z)
    t = jnp.tanh(u)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * z * z)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


def pack_relu_mask(positive):
    """Pack a boolean (..., M, N) array into cuBLASLt's ReLU bit mask, uint8 (..., M, Nb).

    Element (i, j) is bit j % 8 (least significant first) of byte [i, j // 8]; each row is
    padded with zero bits to a multiple of 128 bits (`relu_mask_bytes`). This is the layout
    cuBLASLt and nvmath-python use, so masks move between them unchanged.
    """
    positive = jnp.asarray(positive, dtype=bool)
    n = positive.shape[-1]
    nb = relu_mask_bytes(n)
    pad = [(0, 0)] * (positive.ndim - 1) + [(0, nb * 8 - n)]
    bits = jnp.pad(positive, pad).reshape(*positive.shape[:-1], nb, 8).astype(jnp.uint8)
    weights = jnp.asarray(1 << np.arange(8), dtype=jnp.uint8)
    return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint8)


def unpack_relu_mask(mask, n: int):
    """The boolean (..., M, n) array a packed ReLU mask stands for (bits past n ignored)."""
    shifts = jnp.arange(8, dtype=jnp.uint8)
    bits = (mask[..., None] >> shifts) & jnp.uint8(1)
    return bits.reshape(*mask.shape[:-1], mask.shape[-1] * 8)[..., :n].astype(bool)


# What the forward keeps for the backward, and how the backward applies the derivative with it.
# `keep(z, dtype)` and `apply(dy, residual, n)` work on float32 values.

def keep_relu(z, dtype):
    del dtype
    return pack_relu_mask(relu_mask(z))


def apply_relu(dy, mask, n: int):
    return jnp.where(unpack_relu_mask(mask, n), dy, jnp.zeros_like(dy))


def keep_gelu(z, dtype):
    n = z.shape[-1]
    pad = [(0, 0)] * (z.ndim - 1) + [(0, gelu_aux_columns(n) - n)]
    return jnp.pad(z.astype(dtype), pad)


def apply_gelu(dy, pre_activation, n: int):
    return dy * gelu_derivative(pre_activation[..., :n].astype(jnp.float32))
