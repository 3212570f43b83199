"""The served weight-only GEMM of a few rows as one Pallas kernel (Triton on CUDA):
`act(x @ (scale · W8)ᵀ + bias)` for a 16-bit x of at most `MAX_ROWS` rows and a weight stored
in FP8 as `(N, K)` (`Fp8Weight.data`, K-major).

Decoding a token reads every weight once for a few rows, so the GEMM is bound by reading the
weight, and FP8 halves those bytes. XLA runs the same computation as several kernels (the
input padded, the GEMM with the weight's convert fused into its operand read, often split
over K with a reduction after it, then scale, bias and activation); at 20-30 µs a layer their
launches and the reductions' passes are a sizeable share. Here each program owns `block_n`
output channels over every row: it streams its `(block_n, K)` slice of the FP8 weight once,
converts each tile to x's dtype in registers, accumulates in float32, and applies the scale
(one, or one per output channel), the bias and the activation before its one store.

The arithmetic is `serving.weight_only`'s (the XLA formulation every other platform runs):
the same 16-bit products summed in float32, then `act(z · scale + bias)` in float32, rounded
to x's dtype; only the order of the sum differs. It runs where `fits` says so (16-bit x, K and
N multiples of 16); the tests run it with `interpret=True`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.op.epilogs import ACTIVATIONS

#: The most rows the kernel takes: each program keeps all of them in its accumulator.
MAX_ROWS = 64
#: Triton's dot needs 16 along every side; K and N must be multiples of it.
MIN_BLOCK = 16


class Tiling(NamedTuple):
    """How the kernel is cut: `block_n` output channels per program, `block_k` of K per loop
    step, `num_warps` per program, `num_stages` tiles in flight (Triton's pipelining)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: The default tiling, before `default_tiling` fits it to the shape
#: (`benchmarks/weight_only_tuning.py` times the alternatives).
TILING = Tiling(block_n=32, block_k=256, num_warps=4, num_stages=4)
#: Programs `default_tiling` aims for at least, so that every SM streams (132 on the H200).
MIN_PROGRAMS = 256


def fits(rows: int, k: int, n: int, dtype) -> bool:
    """Whether the kernel runs `x (rows, K) @ W8 (N, K)ᵀ` with x of `dtype`: 1 to `MAX_ROWS`
    rows, a 16-bit x (float32 would change the product's precision from XLA's), K and N
    multiples of `MIN_BLOCK`."""
    return (1 <= rows <= MAX_ROWS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and k % MIN_BLOCK == 0 and n % MIN_BLOCK == 0)


def _largest_divisor(limit: int, size: int) -> int:
    """The largest power of two <= `limit` (and >= `MIN_BLOCK`) that divides `size`."""
    block = limit
    while block > MIN_BLOCK and size % block:
        block //= 2
    return block


def default_tiling(k: int, n: int) -> Tiling:
    """`TILING` fitted to K and N: blocks that divide them, `block_n` halved (not below
    `MIN_BLOCK`) until there are `MIN_PROGRAMS` programs."""
    block_n = _largest_divisor(TILING.block_n, n)
    while block_n > MIN_BLOCK and n // block_n < MIN_PROGRAMS:
        block_n //= 2
    return TILING._replace(block_n=block_n, block_k=_largest_divisor(TILING.block_k, k))


def padded_rows(rows: int) -> int:
    """The rows a program computes: a power of two from `MIN_BLOCK` to `MAX_ROWS`."""
    return max(MIN_BLOCK, 1 << (rows - 1).bit_length())


def _kernel(x_ref, *refs, block_m: int, block_n: int, block_k: int,
            activation: Optional[str], per_channel: tuple[bool, ...],
            offsets: tuple[int, ...], has_bias: bool):
    """One program: `block_n` output channels over every row. `refs`: (data, scale) for each
    weight (one, or SwiGLU's gate and up, whose channels start at `offsets` in their data
    and scales), the bias if `has_bias`, the output."""
    from jax.experimental import pallas as pl
    weights = [refs[2 * i:2 * i + 2] for i in range(len(per_channel))]
    bias_ref = refs[2 * len(weights)] if has_bias else None
    out_ref = refs[-1]
    rows, k = x_ref.shape
    first = pl.program_id(0) * block_n
    channels = pl.ds(pl.multiple_of(first, block_n), block_n)
    weight_channels = [pl.ds(pl.multiple_of(first + offset, block_n), block_n)
                       for offset in offsets]
    # Rows past x's repeat its last (no padded copy of x), so they store its last row's
    # result again, the same values at the same place.
    row = jnp.minimum(jnp.arange(block_m), rows - 1)

    def step(i, sums):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[row, ks]
        return tuple(acc + jax.lax.dot_general(x, w_ref[at, ks].astype(x.dtype),
                                               (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32)
                     for acc, (w_ref, _), at in zip(sums, weights, weight_channels))

    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in weights)
    sums = jax.lax.fori_loop(0, k // block_k, step, zeros)
    z = [acc * (scale_ref[at] if channel else scale_ref[...])[None, :]
         for acc, (_, scale_ref), channel, at in zip(sums, weights, per_channel,
                                                     weight_channels)]
    if len(z) == 2:  # SwiGLU's h from g and u, each rounded as its own GEMM writes it
        g, u = (v.astype(out_ref.dtype).astype(jnp.float32) for v in z)
        out_ref[row, channels] = (jax.nn.silu(g) * u).astype(out_ref.dtype)
        return
    z = z[0]
    if bias_ref is not None:
        z = z + bias_ref[channels].astype(jnp.float32)[None, :]
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    out_ref[row, channels] = z.astype(out_ref.dtype)


def _call(x, weights, n: int, bias, activation: Optional[str], tiling: Optional[Tiling],
          interpret: bool, name: str):
    """The kernel's `n` output channels over x `(rows, K)` and `weights` [(data, scale,
    offset)], one or two: the channels' rows of data `(·, K)` (and of a per-channel scale)
    start at `offset`."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x.shape
    cut = tiling or default_tiling(k, n)
    if n % cut.block_n or k % cut.block_k:
        raise ValueError(f"tiling: {cut} does not divide K {k} and N {n}")
    per_channel = tuple(jnp.ndim(scale) == 1 for _, scale, _ in weights)
    operands = [x]
    for (data, scale, _), channel in zip(weights, per_channel):
        operands += [data, jnp.reshape(scale.astype(jnp.float32), (-1,) if channel else (1,))]
    if bias is not None:
        operands.append(bias)
    params = None
    if not interpret:
        from jax_epilog.float8.block_kernel import compiler_params
        params = compiler_params(cut.num_warps, cut.num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, block_m=padded_rows(rows), block_n=cut.block_n,
                          block_k=cut.block_k, activation=activation, per_channel=per_channel,
                          offsets=tuple(offset for _, _, offset in weights),
                          has_bias=bias is not None),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype), grid=(n // cut.block_n,),
        interpret=interpret, name=name, compiler_params=params)(*operands)


@functools.partial(jax.jit, static_argnames=("activation", "tiling", "interpret"))
def weight_only_gemm(x, data, scale, bias=None, *, activation: Optional[str] = None,
                     tiling: Optional[Tiling] = None, interpret: bool = False):
    """`act(x @ (scale · data)ᵀ + bias)` in x's dtype: x `(rows, K)` 16-bit, `data` `(N, K)`
    FP8, `scale` float32 `()` or `(N,)`, `bias` `(N,)` or None; `fits` must hold. `tiling`:
    as given (its blocks must divide K and N), else `default_tiling`."""
    return _call(x, [(data, scale, 0)], data.shape[0], bias, activation, tiling, interpret,
                 "weight_only_gemm")


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def weight_only_swiglu(x, gate_up: tuple, *, tiling: Optional[Tiling] = None,
                       interpret: bool = False):
    """SwiGLU's hidden `silu(g) · u` in x's dtype, g = x @ (gate_scale · gate)ᵀ and u
    likewise, each rounded to x's dtype first as its own `weight_only_gemm` would write it:
    both products and h in one kernel, which reads x once for both and writes neither g nor
    u. `gate_up`: ((gate `(F, K)`, its scale), (up, its scale)), or ((data `(2F, K)`, its
    scale `()` or `(2F,)`),): gate's channels the first F rows, up's the last."""
    if len(gate_up) == 2:
        (gate, gate_scale), (up, up_scale) = gate_up
        weights, n = [(gate, gate_scale, 0), (up, up_scale, 0)], gate.shape[0]
    else:
        [(data, scale)] = gate_up
        n = data.shape[0] // 2
        weights = [(data, scale, 0), (data, scale, n)]
    return _call(x, weights, n, None, None, tiling, interpret, "weight_only_swiglu")
