"""The one reference implementation of the epilog semantics, in plain JAX.

It is what every non-CUDA platform runs (the primitive's default lowering), what the CUDA
lowering falls back to for the few problems cuBLASLt has no kernel for, and what the tests
compare the GPU against. It works on the kernel's own normalised operands (rank 3, batch first;
see `ffi/README.md`) and returns the kernel's outputs in the kernel's order, bit masks packed
byte for byte as cuBLASLt packs them.

Numerics follow cuBLASLt: the product is accumulated in float32, the epilog runs in float32 on
the accumulator, and only the stored results are rounded to the operand dtype. Special values behave as cuBLASLt's
epilogs were measured to on the H200 (`scripts/probe_special_values.py`): ReLU keeps NaN, its
mask bit is set for +0, -0 and NaN, and GELU's derivative overflows to NaN for huge |z|.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .epilogs import Epilog, gelu_aux_columns, relu_mask_bytes

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def gelu(z):
    """The tanh approximation of GELU, as cuBLASLt's GELU epilogs compute it."""
    return jax.nn.gelu(z, approximate=True)


def gelu_derivative(z):
    """d/dz of the tanh-approximated GELU (what DGELU multiplies the product by).

    Written as cuBLASLt evaluates it: for |z| past ~1e12 (z**3 overflows float32) and for
    ±Inf the result is NaN, as measured on the H200 (tests/test_nonfinite.py).
    """
    u = _SQRT_2_OVER_PI * (z + _GELU_CUBIC * z * z * z)
    t = jnp.tanh(u)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * z * z)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


def relu(z):
    """ReLU as cuBLASLt computes it (measured on the H200): NaN stays NaN, -0 becomes +0."""
    return jnp.where((z > 0) | jnp.isnan(z), z, jnp.zeros_like(z))


def relu_mask(z):
    """The mask bit cuBLASLt writes (measured on the H200): set unless z < 0, so +0, -0 and
    NaN are set. The gradient passes where the bit is set."""
    return ~(z < 0)


def pack_relu_mask(positive):
    """Pack a boolean (..., M, N) array into cuBLASLt's ReLU bit mask, uint8 (..., M, Nb).

    Element (i, j) is bit j % 8 (least significant first) of byte [i, j // 8]; each row is
    padded with zero bits to a multiple of 128 bits.
    """
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


def _product(a, b, transpose_a: bool, transpose_b: bool, allow_tf32: bool):
    """P = op(a) @ op(b) accumulated in float32; b of batch 1 is shared by every batch."""
    a_contract = 1 if transpose_a else 2
    b_contract = 2 if transpose_b else 1
    precision = jax.lax.Precision.DEFAULT if allow_tf32 else jax.lax.Precision.HIGHEST
    if b.shape[0] == 1 and a.shape[0] != 1:
        dims = (((a_contract,), (b_contract - 1,)), ((), ()))
        return jax.lax.dot_general(a, b[0], dims, precision=precision,
                                   preferred_element_type=jnp.float32)
    dims = (((a_contract,), (b_contract,)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=jnp.float32)


def apply_epilog(p, *inputs, epilog: int, dtype) -> list:
    """The epilog's outputs (y[, aux][, DRELU/DGELU bias gradient]) given the float32 product.

    `p` is `(batch, M, N)` float32; BGRADA/BGRADB's sums (of the operands, not of `p`) are the
    caller's. Shared with the sharded path, which finishes a product summed across devices.
    """
    epilog = Epilog(epilog)
    n = p.shape[-1]
    named = dict(zip(epilog.input_names, inputs))
    z = p + named["bias"].astype(jnp.float32)[:, None, :] if epilog.has_bias else p

    if epilog.activation == "relu":
        y = relu(z)
    elif epilog.activation == "gelu":
        y = gelu(z)
    elif epilog.aux_input == "relu_aux":
        y = jnp.where(unpack_relu_mask(named["relu_aux"], n), p, jnp.zeros_like(p))
    elif epilog.aux_input == "gelu_aux":
        pre_activation = named["gelu_aux"][..., :n].astype(jnp.float32)
        y = p * gelu_derivative(pre_activation)
    else:
        y = z
    outputs = [y.astype(dtype)]

    if epilog.aux_output == "relu_aux":
        outputs.append(pack_relu_mask(relu_mask(z)))
    elif epilog.aux_output == "gelu_aux":
        pad = [(0, 0), (0, 0), (0, gelu_aux_columns(n) - n)]
        outputs.append(jnp.pad(z.astype(dtype), pad))

    if epilog in (Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD):
        outputs.append(jnp.sum(y, axis=1).astype(dtype))
    return outputs


def epilog_matmul(a, b, *inputs, epilog: int, transpose_a: bool, transpose_b: bool,
                  allow_tf32: bool = False):
    """The kernel's outputs (y[, aux][, bias_grad]) for normalised rank-3 operands.

    `inputs` are the epilog's inputs in `Epilog.input_names` order: bias `(batch|1, N)`,
    then `relu_aux` / `gelu_aux` `(batch, M, ·)`.
    """
    epilog = Epilog(epilog)
    dtype = a.dtype
    p = _product(a, b, transpose_a, transpose_b, allow_tf32)
    outputs = apply_epilog(p, *inputs, epilog=epilog, dtype=dtype)
    if epilog == Epilog.BGRADA:
        outputs.append(jnp.sum(a.astype(jnp.float32), axis=1 if transpose_a else 2).astype(dtype))
    elif epilog == Epilog.BGRADB:
        b_sum = jnp.sum(b.astype(jnp.float32), axis=2 if transpose_b else 1).astype(dtype)
        outputs.append(jnp.broadcast_to(b_sum, (a.shape[0], b_sum.shape[1])))
    return tuple(outputs)
