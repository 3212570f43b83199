"""The one reference implementation of the epilog semantics, in plain JAX.

It is what every non-CUDA platform runs, what the CUDA lowering runs when XLA's own GEMM is the
faster or the only way (`backend="xla"`, no cuBLASLt kernel for the problem, no library), and
what the tests compare the GPU against. It works on the kernel's normalised operands (rank 3,
batch first; `ffi/README.md`) and returns the kernel's outputs in the kernel's order, bit masks
packed byte for byte as cuBLASLt packs them. What each epilog computes comes from
`epilogs.TABLE`.

Numerics follow cuBLASLt: the product is accumulated in float32, the epilog runs in float32 on
the accumulator, and only the stored results are rounded to the operand dtype. With
`exact=False` (XLA's way, for speed on CUDA) a 16-bit product is rounded to the operand dtype
first, as `act(x @ w + b)` under `jax.jit` computes it, so XLA runs its own GEMM (and fuses
the bias and ReLU into it where it can); results then differ from the exact ones by at most a
rounding of the product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .activations import (gelu, gelu_derivative, pack_relu_mask, relu, relu_mask,  # noqa: F401
                          unpack_relu_mask)
from .epilogs import ACTIVATIONS, ARRAYS, Epilog


def _product(a, b, transpose_a: bool, transpose_b: bool, allow_tf32: bool, dtype):
    """P = op(a) @ op(b) accumulated in float32, stored as `dtype`; b of batch 1 is shared."""
    a_contract = 1 if transpose_a else 2
    b_contract = 2 if transpose_b else 1
    precision = jax.lax.Precision.DEFAULT if allow_tf32 else jax.lax.Precision.HIGHEST
    if b.shape[0] == 1 and a.shape[0] != 1:
        dims = (((a_contract,), (b_contract - 1,)), ((), ()))
        b = b[0]
    else:
        dims = (((a_contract,), (b_contract,)), ((0,), (0,)))
    p = jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=dtype)
    return p.astype(jnp.float32)


def apply_epilog(p, *inputs, epilog: int, dtype) -> list:
    """The epilog's outputs (y, then its aux and bias-gradient outputs) given the float32
    product `p` `(batch, M, N)`. Sums over K of an operand (BGRADA/BGRADB) are the caller's.
    Shared with the sharded path, which finishes a product summed across devices."""
    epilog = Epilog(epilog)
    n = p.shape[-1]
    named = dict(zip(epilog.input_names, inputs))
    z = p + named["bias"].astype(jnp.float32)[:, None, :] if epilog.has_bias else p
    if epilog.activation:
        y = ACTIVATIONS[epilog.activation].fn(z)
    elif epilog.derivative:
        y = ACTIVATIONS[epilog.derivative].derivative(p, named[epilog.aux_input], n)
    else:
        y = z
    outputs = [y.astype(dtype)]
    for name in epilog.output_names:
        if not ARRAYS[name].sums:
            outputs.append(ACTIVATIONS[epilog.activation].keep(z, dtype))
        elif ARRAYS[name].sums == "y":
            outputs.append(jnp.sum(y, axis=1).astype(dtype))
        else:
            outputs.append(None)  # the caller's
    return outputs


def epilog_matmul(a, b, *inputs, epilog: int, transpose_a: bool, transpose_b: bool,
                  allow_tf32: bool = False, exact: bool = True):
    """The kernel's outputs (y[, aux][, bias gradient]) for normalised rank-3 operands.

    `inputs` are the epilog's inputs in `Epilog.input_names` order: bias `(batch|1, N)`,
    then `relu_aux` / `gelu_aux` `(batch, M, ·)`.
    """
    epilog = Epilog(epilog)
    dtype = a.dtype
    p = _product(a, b, transpose_a, transpose_b, allow_tf32, jnp.float32 if exact else dtype)
    outputs = apply_epilog(p, *inputs, epilog=epilog, dtype=dtype)
    operand_sums = {"a": (a, 1 if transpose_a else 2), "b": (b, 2 if transpose_b else 1)}
    for i, name in enumerate(epilog.output_names, start=1):
        if ARRAYS[name].sums in operand_sums:
            x, axis = operand_sums[ARRAYS[name].sums]
            total = jnp.sum(x.astype(jnp.float32), axis=axis).astype(dtype)
            outputs[i] = jnp.broadcast_to(total, (a.shape[0], total.shape[1]))
    return tuple(outputs)
