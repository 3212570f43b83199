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

FP8 operands (SPEC §5): the exact reference widens them to float32 (exactly) and accumulates in
float32; XLA's way is XLA's direct FP8 `dot_general`, which XLA rewrites to its own cuBLASLt FP8
GEMM (a dequantize-then-bf16 dot would not be). Then `finish` applies the scales, the epilog,
the FP8 result's scale and saturating cast, and the amax. Block-scaled FP8 operands
(`block_scales`) are dequantized exactly first (`block_dequantize`: every FP8 value times its
tile's or block's float32 scale, one float32 rounding), then multiplied in float32 at HIGHEST
precision, in both ways: XLA has no block-scaled GEMM of its own to rewrite to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_epilog.op import block_scales
from jax_epilog.op.epilogs import ACTIVATIONS, ARRAYS, Epilog, array_dtype, is_fp8, scale_names


def product(a, b, transpose_a: bool, transpose_b: bool, reduced_precision: bool, dtype):
    """P = op(a) @ op(b) accumulated in float32, stored as `dtype`; b of batch 1 is shared.
    `reduced_precision`: precision DEFAULT, which lets XLA use TF32 for float32 operands and
    fast accumulation for FP8 ones (else HIGHEST)."""
    a_contract = 1 if transpose_a else 2
    b_contract = 2 if transpose_b else 1
    precision = jax.lax.Precision.DEFAULT if reduced_precision else jax.lax.Precision.HIGHEST
    if b.shape[0] == 1:  # as `x @ w` with a 2-D w: no batch dimension in the dot
        dims = (((a_contract,), (b_contract - 1,)), ((), ()))
        b = b[0]
    else:
        dims = (((a_contract,), (b_contract,)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=dtype)


def block_dequantize(x, values, block: str, transposed: bool):
    """op(x) of a block-scaled FP8 operand `x` (rank 3, batch 1: (1, rows, K), or (1, K, rows)
    `transposed`) as float32 (rows, K): each value times its tile's or block's scale."""
    x = x[0].T if transposed else x[0]
    rows, k = x.shape
    return x.astype(jnp.float32) * block_scales.expand(jnp.asarray(values, jnp.float32), block,
                                                       rows, k)


def _block_product(a, b, scales, blocks, transpose_a: bool, transpose_b: bool):
    """P (1, M, N) float32 of block-scaled operands: exact dequantization, a float32 product."""
    a_rows = block_dequantize(a, scales[0], blocks[0], transpose_a)  # (M, K)
    b_rows = block_dequantize(b, scales[1], blocks[1], not transpose_b)  # (N, K)
    p = jax.lax.dot_general(a_rows, b_rows, (((1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    return p[None]


def saturating_cast(x, dtype):
    """x (float32) rounded to nearest to the FP8 `dtype`, finite values past its largest finite
    value (and ±Inf) saturated to it, NaN kept NaN: cuBLASLt's FP8 output (SPEC §5)."""
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -largest, largest).astype(dtype)  # clip keeps NaN


def _epilog(p, inputs, epilog: Epilog, aux_dtype, exact: bool):
    """(R, the epilog's other outputs stored as `aux_dtype`) for the product `p`: float32, or
    in XLA's way (not `exact`) the operands' 16-bit dtype and the activation as a user writes
    it, so that the epilog is the plain expression XLA fuses into its own GEMM."""
    n = p.shape[-1]
    named = dict(zip(epilog.input_names, inputs))
    z = p + named["bias"].astype(p.dtype)[:, None, :] if epilog.has_bias else p
    if epilog.activation:
        activation = ACTIVATIONS[epilog.activation]
        y = (activation.fn if exact else activation.plain)(z)
    elif epilog.derivative:
        y = ACTIVATIONS[epilog.derivative].derivative(p, named[epilog.aux_input], n)
    else:
        y = z
    outputs = []
    for name in epilog.output_names:
        if not ARRAYS[name].sums:
            outputs.append(ACTIVATIONS[epilog.activation].keep(z, aux_dtype))
        elif ARRAYS[name].sums == "y":
            outputs.append(jnp.sum(y, axis=1, dtype=jnp.float32).astype(aux_dtype))
        else:
            outputs.append(None)  # the caller's
    return y, outputs


def finish(p, a, b, *args, epilog: int, transpose_a: bool, transpose_b: bool,
           result_dtype=None, result_amax: bool = False, has_c: bool = False,
           exact: bool = True, block_scaling=None) -> tuple:
    """A call's outputs from its float32 product `p` `(batch, M, N)`, before any scale.

    `args` are the call's operands after a and b (the epilog's inputs, then the FP8 scales).
    With FP8 operands P = (sa · sb) · p; the epilog gives R; y is R rounded to a 16/32-bit
    result, or sd · R rounded and saturated to an FP8 one; `result_amax` is max |R| (SPEC §5).
    With a C matrix (`has_c`: the last three operands are c, alpha, beta; SPEC §6) the epilog
    runs on alpha · P + beta · C, computed in `p`'s dtype (float32 when exact).
    With `block_scaling` the scales are already in `p` (`_block_product`).
    Shared by the reference, the sharded path (after a psum over K) and vmap with per-example
    scales."""
    epilog = Epilog(epilog)
    out = jnp.dtype(result_dtype or a.dtype)
    n_inputs = len(epilog.input_names)
    inputs = args[:n_inputs]
    n_scales = len(scale_names(a.dtype, out))
    scales = dict(zip(scale_names(a.dtype, out), (jnp.asarray(s, jnp.float32)
                                                  for s in args[n_inputs:n_inputs + n_scales])))
    aux = array_dtype("bias", out)  # the floating aux dtype
    if block_scaling:
        scales = {}
    elif scales:
        p = p * (scales["scale_a"] * scales["scale_b"])  # cuBLASLt's alpha · sa · sb
    if has_c:  # R = epilog(alpha · P + beta · C): C added before the bias (SPEC §6)
        c, alpha, beta = args[n_inputs + n_scales:n_inputs + n_scales + 3]
        p = (jnp.asarray(alpha, jnp.float32).astype(p.dtype) * p
             + jnp.asarray(beta, jnp.float32).astype(p.dtype) * c.astype(p.dtype))
    r, outputs = _epilog(p, inputs, epilog, aux, exact)
    if is_fp8(out):
        y = saturating_cast(r * scales["scale_d"], out)
    else:
        y = r.astype(out)
    sa = scales.get("scale_a", 1.0)
    sb = scales.get("scale_b", 1.0)
    operand_sums = {"a": (a, 1 if transpose_a else 2, sa), "b": (b, 2 if transpose_b else 1, sb)}
    for i, name in enumerate(epilog.output_names):
        if ARRAYS[name].sums in operand_sums:
            x, axis, scale = operand_sums[ARRAYS[name].sums]
            total = (jnp.sum(x.astype(jnp.float32), axis=axis) * scale).astype(aux)
            outputs[i] = jnp.broadcast_to(total, (a.shape[0], total.shape[1]))
    if result_amax:
        outputs.append(jnp.max(jnp.abs(r)) if r.size else jnp.zeros((), jnp.float32))
    return (y, *outputs)


def epilog_matmul(a, b, *args, epilog: int, transpose_a: bool, transpose_b: bool,
                  allow_tf32: bool = False, exact: bool = True, result_dtype=None,
                  result_amax: bool = False, has_c: bool = False,
                  fast_accumulation: bool = False, block_scaling=None, fp8_dot: bool = False):
    """The kernel's outputs (y[, aux][, bias gradient][, amax]) for normalised rank-3 operands.

    `args` are the epilog's inputs in `Epilog.input_names` order: bias `(batch|1, N)`,
    then `relu_aux` / `gelu_aux` `(batch, M, ·)`; then, with FP8 operands, the scales
    (`epilogs.scale_names`); then, with `has_c`, c `(batch, M, N)`, alpha and beta (SPEC §6).
    `fast_accumulation` (FP8, XLA's way and `fp8_dot`): XLA's FP8 dot at DEFAULT precision,
    which XLA runs with cuBLASLt's fast accumulation, rather than HIGHEST.
    `block_scaling` (a's and b's tiles): the scales are block-scale arrays (`block_scales`).
    `fp8_dot` (CUDA's fallback where cuBLASLt has no kernel): the FP8 product by XLA's FP8
    dot to float32 (exact products summed in float32, fast accumulation where the call asks
    for it, as cuBLASLt sums them), row scales applied to it after, rather than widened or
    dequantized operands (a float32 GEMM, many times slower than XLA's bf16 GEMM of the same
    problem)."""
    out = jnp.dtype(result_dtype or a.dtype)
    n_inputs = len(Epilog(epilog).input_names)
    if tuple(block_scaling or ()) == ("row", "row") and fp8_dot:  # row scales after the dot
        sa, sb = (jnp.asarray(s, jnp.float32) for s in args[n_inputs:n_inputs + 2])
        p = (product(a, b, transpose_a, transpose_b, fast_accumulation, jnp.float32)
             * sa[None, :, None] * sb[None, None, :])
    elif block_scaling:
        p = _block_product(a, b, args[n_inputs:n_inputs + 2], block_scaling, transpose_a,
                           transpose_b)
    elif is_fp8(a.dtype):
        if exact and fp8_dot:
            p = product(a, b, transpose_a, transpose_b, fast_accumulation, jnp.float32)
        elif exact:  # FP8 values widen exactly; the products and their sum are float32
            p = product(a.astype(jnp.float32), b.astype(jnp.float32), transpose_a,
                         transpose_b, False, jnp.float32)
        else:  # XLA's direct FP8 dot, which XLA rewrites to its cuBLASLt FP8 GEMM
            p = product(a, b, transpose_a, transpose_b, fast_accumulation,
                         jnp.float32 if is_fp8(out) else out).astype(jnp.float32)
    else:  # XLA's way keeps the product in the operands' dtype, as `x @ w + b` does, and for
        # 16-bit operands its default precision (the same float32 accumulation: HIGHEST only
        # changes what XLA may fuse around the dot)
        reduced = allow_tf32 or (not exact and a.dtype != jnp.float32)
        p = product(a, b, transpose_a, transpose_b, reduced, jnp.float32 if exact else a.dtype)
    return finish(p, a, b, *args, epilog=epilog, transpose_a=transpose_a,
                  transpose_b=transpose_b, result_dtype=out, result_amax=result_amax,
                  has_c=has_c, exact=exact, block_scaling=block_scaling)
