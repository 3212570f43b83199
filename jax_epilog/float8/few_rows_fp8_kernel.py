"""The served FP8 GEMM of a few rows as one Pallas kernel (Triton on CUDA):
`act(x_scale · w_scale · (x8 @ W8ᵀ) + bias)` for an e4m3 input x8 of at most `MAX_ROWS` rows
and a weight stored in FP8 as `(N, K)` (`Fp8Weight.data`, K-major).

Decoding reads every weight once for a few rows, so the GEMM is bound by reading the weight.
Each program computes `block_n` output channels as the product `W8[channels] @ x8ᵀ`: the
weight's channels are the MMA's long side and the few rows its short side, so Hopper's FP8
tensor-core instructions take both operands as they lie (K-major, 1 byte) and nothing is
converted. Then the scales (x's one or one per row, the weight's one or one per channel), the
bias and the activation in float32, and one store in the result dtype. Where N has too few
blocks of channels to fill the GPU, K is split too (`Tiling.split_k`): each program stores its
part's scaled float32 sum, and one XLA fusion adds the parts and applies bias and activation.

x comes quantized (e4m3 and its scale), or 16-bit, and then the kernel quantizes it as
`serving.quantize_input` defines it, with correctly rounded divisions, tile by tile as it
reads it: with a given static scale
(`x / scale`, saturated), or from x's amax (`input_scaling`: "tensor", one amax over x;
"row", one per row), which it takes from the rows' amaxes (`row_amax`, one XLA reduction
over the few rows: a first pass over x in every program would wait on each load in turn).
A served layer is then two kernels (one with a static scale) where XLA's quantization made
it five as XLA compiled it: two reductions, the scale and the cast before the GEMM.

The arithmetic is the "xla_fp8" way's (`serving.xla_fp8`, what every other platform runs):
exact FP8 products summed in float32, then `act(z · x_scale · w_scale + bias)` in float32;
XLA's FP8 dot rounds the product to the result dtype before that epilogue, this kernel only
after it. It runs where `fits` says so (at most `MAX_ROWS` rows, a 16-bit result, K and N
multiples of `MIN_BLOCK`); the tests run it with `interpret=True`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.weights import INPUT_FORMAT
from jax_epilog.op import manual_axes
from jax_epilog.op.epilogs import ACTIVATIONS

#: The most rows the kernel takes: each program keeps all of them in its accumulator.
MAX_ROWS = 64
#: The smallest block along K and N (FP8 MMAs are 32 deep); K and N must be multiples of it.
MIN_BLOCK = 32
#: The fewest rows a program computes (Triton's dot needs 16 along every side).
MIN_ROWS = 16
#: The largest finite value of the format a 16-bit x is quantized to (`weights.INPUT_FORMAT`).
INPUT_LARGEST = float(jnp.finfo(INPUT_FORMAT).max)


class Tiling(NamedTuple):
    """How the kernel is cut: `block_n` output channels per program, `block_k` of K per loop
    step, `num_warps` per program, `num_stages` tiles in flight (Triton's pipelining), and
    `split_k` programs along K per block of channels (each sums its share of K; their float32
    partial sums are added, and bias and activation applied, by one XLA fusion after)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


#: The tiling `benchmarks/few_rows_tuning.py` found fastest over 1 and 16 rows of a large layer
#: (as fast as 64 channels with 3 stages at 16 rows, faster at 1; docs/serving.md). Narrower
#: programs where N has few channels (`default_tiling`).
BLOCK_N = 128
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 5
#: Programs `default_tiling` keeps at least (narrower blocks where N is small): about one per
#: SM of a Hopper GPU.
MIN_PROGRAMS = 100
#: Shared memory a program may have on Hopper, and what `default_tiling` gives the
#: pipeline's tiles at most, with room for the epilogue's transpose. (5 stages of 128 x 256
#: weight and 64 x 256 e4m3 input tiles, 240 KiB, failed to launch.)
SHARED_MEMORY = 227 * 1024
STAGE_BYTES = 180 * 1024
#: The fewest blocks of K a program of a split K sums (its pipeline fills over a few).
MIN_SPLIT_STEPS = 8


def fits(rows: int, k: int, n: int, dtype) -> bool:
    """Whether the kernel computes `x8 (rows, K) @ W8 (N, K)ᵀ` with a `dtype` result: 1 to
    `MAX_ROWS` rows, a 16-bit result, K and N multiples of `MIN_BLOCK`."""
    return (1 <= rows <= MAX_ROWS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and k % MIN_BLOCK == 0 and n % MIN_BLOCK == 0)


def _largest_divisor(limit: int, size: int) -> int:
    """The largest power of two <= `limit` (and >= `MIN_BLOCK`) that divides `size`."""
    block = limit
    while block > MIN_BLOCK and size % block:
        block //= 2
    return block


def padded_rows(rows: int) -> int:
    """The rows a program computes: a power of two from `MIN_ROWS` to `MAX_ROWS`."""
    return max(MIN_ROWS, 1 << (rows - 1).bit_length())


def stage_bytes(rows: int, block_n: int, block_k: int, x_itemsize: int) -> int:
    """The bytes of one pipeline stage's tiles: the weight's `block_n` x `block_k` (e4m3) and
    the input's `padded_rows` x `block_k` (`x_itemsize` bytes each: 1 for e4m3, 2 for a
    16-bit x the kernel quantizes)."""
    return (block_n + x_itemsize * padded_rows(rows)) * block_k


def default_tiling(rows: int, k: int, n: int, x_itemsize: int = 1) -> Tiling:
    """The measured tiling fitted to the shape: blocks that divide K and N; while there are
    fewer than `MIN_PROGRAMS` programs, K split in two (each part at least `MIN_SPLIT_STEPS`
    blocks long), then `block_n` halved (not below `MIN_BLOCK`); no more stages than fit
    `STAGE_BYTES`."""
    block_n = _largest_divisor(BLOCK_N, n)
    block_k = _largest_divisor(BLOCK_K, k)
    split_k = 1
    while (n // block_n * split_k < MIN_PROGRAMS and k % (2 * split_k * block_k) == 0
           and k // (2 * split_k * block_k) >= MIN_SPLIT_STEPS):
        split_k *= 2
    while block_n > MIN_BLOCK and n // block_n * split_k < MIN_PROGRAMS:
        block_n //= 2
    stages = min(NUM_STAGES, STAGE_BYTES // stage_bytes(rows, block_n, block_k, x_itemsize))
    return Tiling(block_n, block_k, NUM_WARPS, max(2, stages), split_k)


#: `few_rows_fp8_gemm`'s `input_scaling`: where a 16-bit x takes its scale from its amax.
INPUT_SCALINGS = ("tensor", "row")


def _ieee_divide(a, b):
    """a / b in float32 rounded to nearest (IEEE's division): Triton's `/` is `div.full.f32`
    (within 2 ulp), which would move a scale, and so an FP8 value, a step. (XLA's own
    division on the GPU is not always correctly rounded either: `serving.quantize_input` in
    XLA put some row scales an ulp off, so this kernel and the "xla_fp8" way can differ by an
    e4m3 step in a few values.)"""
    from jax.experimental.pallas import triton as pltriton
    a, b = jnp.broadcast_arrays(a, b)
    return pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _numpy_divide(a, b):
    """a / b in float32 rounded to nearest, for the interpreter: XLA on the CPU divides
    vectorised loops approximately (2.90625 / 0.008649553 gave 336.0 where the float32
    quotient is 336.00003, and so 320 in e4m3 where the GPU's kernel gives 352)."""
    import numpy as np

    def divide(a, b):
        with np.errstate(all="ignore"):
            return np.divide(a, b, dtype=np.float32)

    a, b = jnp.broadcast_arrays(a, b)
    return jax.pure_callback(divide, jax.ShapeDtypeStruct(a.shape, jnp.float32), a, b)


def _multiplier(x_amax, divide):
    """`scaling.multiplier(x_amax, INPUT_FORMAT, 0)` for an amax >= 0 (or NaN) in Triton's
    terms (comparisons, no isfinite): `largest / amax`, 1 where that or the amax is 0, not
    finite or NaN."""
    q = divide(jnp.full(x_amax.shape, INPUT_LARGEST, jnp.float32), x_amax)
    ok = (x_amax > 0) & (x_amax < jnp.inf) & (q < jnp.inf)
    return jnp.where(ok, q, 1.0)


def _saturate(v):
    """v clipped to the largest e4m3 values, NaN kept NaN as `saturating_cast` keeps it
    (Triton's min and max return the other operand for NaN: a NaN input would become 448)."""
    return jnp.where(v == v, jnp.clip(v, -INPUT_LARGEST, INPUT_LARGEST), v)


def _kernel(x_ref, x_scale_ref, w_ref, w_scale_ref, *refs, block_m: int, block_n: int,
            block_k: int, k_steps: int, partial: bool, activation: Optional[str],
            per_row: bool, per_channel: bool, has_bias: bool, quantize: Optional[str], divide):
    """`quantize`: None (x is e4m3), "static" (x 16-bit, x_scale_ref its scale) or an
    `INPUT_SCALINGS` (x 16-bit, x_scale_ref its rows' amaxes); `divide`: float32 division
    rounded to nearest. Program (j, s) sums K's blocks s · `k_steps` ... (s + 1) · `k_steps` - 1
    for channel block j; `partial`: it stores that scaled sum in float32 at columns
    s · N + (j's channels), and bias and activation come after (`_finish`)."""
    from jax.experimental import pallas as pl
    bias_ref, out_ref = (refs[0], refs[1]) if has_bias else (None, refs[0])
    rows = x_ref.shape[0]
    n = w_ref.shape[0]
    channels = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    first_step = pl.program_id(1) * k_steps
    row = jnp.minimum(jnp.arange(block_m), rows - 1)  # past x's rows, its last again

    if quantize in INPUT_SCALINGS:
        x_amax = x_scale_ref[row]  # the rows' amaxes
        # NaN as +inf (both give multiplier 1): Triton's max drops NaN, XLA's keeps it
        x_amax = jnp.where(x_amax == x_amax, x_amax, jnp.inf)
        if quantize == "tensor":
            x_amax = jnp.broadcast_to(jnp.max(x_amax), (block_m,))
        q = _multiplier(x_amax, divide)
        x_scale = divide(jnp.ones((block_m,), jnp.float32), q)
        q = q[:, None]  # (block_m, 1)
        cast = lambda x: x.astype(jnp.float32) * q  # noqa: E731
    elif quantize == "static":
        static = x_scale_ref[...]
        x_scale = jnp.broadcast_to(static, (block_m,))
        cast = lambda x: divide(x.astype(jnp.float32), static)  # noqa: E731
    else:
        x_scale = x_scale_ref[row] if per_row else x_scale_ref[...]
        cast = None

    def step(i, acc):
        ks = pl.ds(pl.multiple_of((first_step + i) * block_k, block_k), block_k)
        x8 = x_ref[row, ks]
        if cast is not None:  # saturate, then round to e4m3 (`saturating_cast`)
            x8 = _saturate(cast(x8)).astype(INPUT_FORMAT)
        return acc + jax.lax.dot_general(w_ref[channels, ks], x8, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    zt = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((block_n, block_m), jnp.float32))
    w_scale = w_scale_ref[channels] if per_channel else w_scale_ref[...]
    z = zt.T * x_scale[:, None] * w_scale[None, :]  # (the scales are factors of every part)
    if partial:
        start = pl.program_id(1) * n + pl.program_id(0) * block_n
        out_ref[row, pl.ds(pl.multiple_of(start, block_n), block_n)] = z
        return
    if bias_ref is not None:
        z = z + bias_ref[channels].astype(jnp.float32)[None, :]
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    out_ref[row, channels] = z.astype(out_ref.dtype)


def row_amax(x):
    """max |x| of each row of x `(rows, K)`, float32 `(rows,)`: what `few_rows_fp8_gemm`
    quantizes a 16-bit x from (`input_scaling`)."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)


@functools.partial(jax.jit, static_argnames=("activation", "dtype", "input_scaling", "tiling",
                                             "interpret"))
def few_rows_fp8_gemm(x, x_scale, data, w_scale, bias=None, *, row_amax=None,
                      activation: Optional[str] = None, dtype=jnp.bfloat16,
                      input_scaling: Optional[str] = None, tiling: Optional[Tiling] = None,
                      interpret: bool = False):
    """`act(x_scale · w_scale · (x8 @ dataᵀ) + bias)` in `dtype`, data `(N, K)` e4m3,
    `w_scale` `()` or `(N,)`, bias `(N,)` or None, and x `(rows, K)` one of:

    - e4m3 (x8 itself), `x_scale` float32 `()` or `(rows,)` its dequantization scale;
    - 16-bit with `x_scale` a float32 `()` static scale: x8 = x / x_scale, saturated;
    - 16-bit with `input_scaling` "tensor" or "row", `x_scale` None and `row_amax` the rows'
      amaxes (`row_amax(x)`): x8 = x · q saturated, q = `scaling.multiplier` of x's amax (of
      each row's, for "row"), x_scale = 1 / q.

    `fits` must hold for (rows, K, N, dtype). `tiling`: as given (its blocks must divide K and
    N), else `default_tiling`."""
    from jax.experimental import pallas as pl  # only where the kernel is chosen

    rows, k = x.shape
    n = data.shape[0]
    cut = tiling or default_tiling(rows, k, n, jnp.dtype(x.dtype).itemsize)
    if n % cut.block_n or k % (cut.block_k * cut.split_k):
        raise ValueError(f"tiling: {cut} does not divide K {k} (by block_k x split_k) and "
                         f"N {n} (by block_n)")
    quantize = _quantize_mode(x, x_scale, row_amax, input_scaling)
    if quantize in INPUT_SCALINGS:
        x_scale = row_amax  # the kernel's second operand: the rows' amaxes
    per_row, per_channel = jnp.ndim(x_scale) == 1, jnp.ndim(w_scale) == 1
    flat = lambda s, vector: jnp.reshape(s.astype(jnp.float32), (-1,) if vector else (1,))  # noqa: E731
    operands = [x, flat(x_scale, per_row), data, flat(w_scale, per_channel)]
    if bias is not None:
        operands.append(bias)
    axes = manual_axes.varying_axes(operands)  # inside shard_map: what the result varies over
    operands = [manual_axes.vary(a, axes) for a in operands]
    params = None
    if not interpret:
        from jax_epilog.float8.block_kernel import compiler_params
        params = compiler_params(cut.num_warps, cut.num_stages)
    partial = cut.split_k > 1
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=padded_rows(rows), block_n=cut.block_n,
                          block_k=cut.block_k, k_steps=k // (cut.block_k * cut.split_k),
                          partial=partial, activation=activation, per_row=per_row,
                          per_channel=per_channel, has_bias=bias is not None and not partial,
                          quantize=quantize,
                          divide=_numpy_divide if interpret else _ieee_divide),
        out_shape=manual_axes.result_struct(
            (rows, cut.split_k * n) if partial else (rows, n),
            jnp.float32 if partial else dtype, operands[0]),
        grid=(n // cut.block_n, cut.split_k),
        interpret=interpret, name="few_rows_fp8_gemm", compiler_params=params)(
            *(operands[:4] if partial else operands))
    return _finish(out, cut.split_k, bias, activation, dtype) if partial else out


def _finish(parts, split_k: int, bias, activation: Optional[str], dtype):
    """The kernel's epilogue after a split K, in one XLA fusion: the `split_k` float32 partial
    sums `(rows, split_k · N)` added, then bias and activation in float32, then `dtype`."""
    rows, width = parts.shape
    z = jnp.sum(parts.reshape(rows, split_k, width // split_k), axis=1)
    if bias is not None:
        z = z + bias.astype(jnp.float32)[None, :]
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    return z.astype(dtype)


def _quantize_mode(x, x_scale, amaxes, input_scaling: Optional[str]) -> Optional[str]:
    """`_kernel`'s `quantize` for these arguments, or a ValueError naming the one at fault."""
    rows = x.shape[0]
    if jnp.dtype(x.dtype) == INPUT_FORMAT:
        if input_scaling is not None or amaxes is not None or x_scale is None:
            raise ValueError("x_scale: an e4m3 x comes with its float32 dequantization scale "
                             "(input_scaling and row_amax quantize a 16-bit x)")
        return None
    if jnp.dtype(x.dtype) not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x: expected e4m3 or a 16-bit float, got {jnp.dtype(x.dtype)}")
    if input_scaling is None:
        if x_scale is None or jnp.ndim(x_scale) != 0 or amaxes is not None:
            raise ValueError("x_scale: a 16-bit x is quantized with one static float32 scale, "
                             f"or from its rows' amaxes (input_scaling={INPUT_SCALINGS}, "
                             "row_amax)")
        return "static"
    if input_scaling not in INPUT_SCALINGS or x_scale is not None:
        raise ValueError(f"input_scaling: expected one of {INPUT_SCALINGS} with x_scale None, "
                         f"got {input_scaling!r}")
    if amaxes is None or jnp.shape(amaxes) != (rows,):
        raise ValueError(f"row_amax: expected x's rows' amaxes, shape ({rows},), got "
                         f"{None if amaxes is None else jnp.shape(amaxes)}")
    return input_scaling
