"""The weight-only GEMM for few rows (decoding) as one Pallas kernel (Triton on CUDA):
`act(x @ (scale · data)ᵀ + bias)` for x (M, K) 16-bit and a stored weight's FP8 data (N, K),
K-major. Over a few rows the GEMM is bound by reading the weight, so the kernel streams it:

- the grid is (row tiles, N / block_n, split_k); each program reads a `block_n`-row stripe of
  the weight over one K chunk, `block_k` columns a step (Triton pipelines the loads over
  `num_stages`), converts each tile to x's dtype in registers and accumulates `x · wᵀ` in
  float32 with Triton's dot (which takes at least 16 rows: x's rows are read in tiles of 16,
  32 or 64, the rows past M masked, so x is never padded);
- with one K chunk the scale, bias and activation are applied in the kernel and the result
  written in x's dtype: one kernel per layer. With `split_k` chunks (enough programs for the
  SMs where N is small and K large) the float32 partial sums `(split_k, M, N)` come out and
  their sum, scale, bias and activation are one XLA fusion after it;
- shapes need not divide into the blocks: Pallas masks loads and stores past the arrays' ends,
  and a K chunk that runs past K zeroes both tiles' columns beyond it;
- `Config(mma=False)`, for at most `FMA_MAX_ROWS` rows: no dot, so no 16-row tile; each
  weight tile is converted to float32, multiplied by x's rows and summed along K by
  elementwise FMAs (a GEMV), one tree sum per program at the end.

`serving.weight_only(..., kernel="pallas")` runs it on CUDA GPUs that convert FP8 in Triton
(compute capability 8.9 or newer); every other platform computes the same product with XLA.
`interpret=True` runs the kernel's own code anywhere (the CPU tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.op.epilogs import ACTIVATIONS

#: Triton's dot takes at least 16 rows; x's rows are read in tiles of 16, 32 or 64.
MIN_ROWS = 16
MAX_ROW_TILE = 64
#: The most rows `Config(mma=False)` takes: each row keeps a float32 (block_n, block_k) sum.
FMA_MAX_ROWS = 4
INPUT_DTYPES = ("bfloat16", "float16")
WEIGHT_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: The H200's SMs: `config_for` splits K until the grid has at least this many programs.
SMS = 132
#: The shared memory `config_for` gives the pipeline's buffers (an H100/H200 SM has 228 KiB):
#: each stage holds one FP8 weight tile and one 16-bit x tile.
SHARED_MEMORY = 200 * 1024


class Config(NamedTuple):
    """The kernel's tiling: `block_n` weight rows (output columns) per program, `block_k`
    columns per loop step (both powers of two, at least 16), `split_k` programs along K
    (1: the epilogue in the kernel), Triton's warps and pipeline stages; `mma`: Triton's dot
    (False: elementwise FMAs, at most `FMA_MAX_ROWS` rows)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    mma: bool = True

    @property
    def name(self) -> str:
        return (f"n{self.block_n} k{self.block_k} split{self.split_k} warps{self.num_warps} "
                f"stages{self.num_stages}{'' if self.mma else ' fma'}")


def config_for(rows: int, k: int, n: int) -> Config:
    """The tiling by rule (not yet tuned on a GPU; `benchmarks/serving_bench.py --parts gemv`
    sweeps others): 64-row stripes of 256-column steps, wider stripes for more rows (each
    program rereads x's chunk), K split until the grid fills the SMs, in chunks of at least
    1024 columns, and as many stages (up to 4) as `SHARED_MEMORY` holds."""
    block_n, block_k, tile = 64 if rows <= 16 else 128, 256, row_tile(rows)
    programs = _cdiv(rows, tile) * _cdiv(n, block_n)
    split = 1
    while programs * split < SMS and k // (2 * split) >= 1024:
        split *= 2
    stages = max(2, min(4, SHARED_MEMORY // (block_k * (block_n + 2 * tile))))
    return Config(block_n=block_n, block_k=block_k, split_k=split, num_warps=4,
                  num_stages=stages)


def row_tile(rows: int, mma: bool = True) -> int:
    """The rows of x one program reads: a power of two from `MIN_ROWS` (without the dot:
    from 1) to `MAX_ROW_TILE`."""
    return min(MAX_ROW_TILE, max(MIN_ROWS if mma else 1, 1 << max(0, rows - 1).bit_length()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check(x, data, scale, bias, config: Optional[Config]) -> None:
    """Errors that name the argument, for what the kernel cannot take."""
    if jnp.ndim(x) != 2 or jnp.result_type(x).name not in INPUT_DTYPES or x.shape[0] < 1:
        raise ValueError(f"x: expected a (rows, K) array of {' or '.join(INPUT_DTYPES)}, rows "
                         f">= 1, got {jnp.result_type(x)} of shape {jnp.shape(x)}")
    if jnp.ndim(data) != 2 or jnp.result_type(data).name not in WEIGHT_DTYPES:
        raise ValueError(f"data: expected an (N, K) array of {' or '.join(WEIGHT_DTYPES)} (an "
                         f"Fp8Weight's data), got {jnp.result_type(data)} of shape "
                         f"{jnp.shape(data)}")
    if data.shape[1] != x.shape[1]:
        raise ValueError(f"data: the weight's K (its second axis) is {data.shape[1]}, but x has "
                         f"{x.shape[1]} columns")
    if jnp.shape(scale) != () or jnp.result_type(scale) != jnp.float32:
        raise ValueError(f"scale: expected a float32 scalar, got {jnp.result_type(scale)} of "
                         f"shape {jnp.shape(scale)}")
    if bias is not None and jnp.shape(bias) != (data.shape[0],):
        raise ValueError(f"bias: expected shape ({data.shape[0]},) (the weight's N), got "
                         f"{jnp.shape(bias)}")
    if config is not None:
        sizes = (config.block_n, config.block_k)
        if any(s < 16 or s & (s - 1) for s in sizes) or config.split_k < 1:
            raise ValueError(f"config: block_n and block_k must be powers of two >= 16 and "
                             f"split_k >= 1, got {config}")
        if not config.mma and x.shape[0] > FMA_MAX_ROWS:
            raise ValueError(f"config: mma=False takes at most {FMA_MAX_ROWS} rows, x has "
                             f"{x.shape[0]}; use the dot (mma=True)")


def _kernel(x_ref, w_ref, scale_ref, *refs, block_k: int, steps: int, k: int,
            masked: bool, activation: Optional[str], fused: bool, mma: bool):
    from jax.experimental import pallas as pl  # only where the kernel runs

    bias_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    rows, block_n = x_ref.shape[0], w_ref.shape[0]
    chunk_start = pl.program_id(2) * steps * block_k

    def step(i, total):
        start = pl.multiple_of(i * block_k, block_k)
        # the last chunk runs past K: what lies beyond is not read as zeros
        column = chunk_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

        def tile(ref, index, dtype):
            t = ref[index, pl.ds(start, block_k)].astype(dtype)
            return jnp.where(column < k, t, jnp.zeros_like(t)) if masked else t

        if mma:
            x = tile(x_ref, slice(None), x_ref.dtype)
            return total + jax.lax.dot_general(x, tile(w_ref, slice(None), x.dtype),
                                               (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32)
        w = tile(w_ref, slice(None), jnp.float32)  # per row, a (block_n, block_k) sum
        return tuple(t + w * tile(x_ref, pl.ds(r, 1), jnp.float32)
                     for r, t in enumerate(total))

    if mma:
        total = jax.lax.fori_loop(0, steps, step, jnp.zeros((rows, block_n), jnp.float32))
    else:
        sums = jax.lax.fori_loop(0, steps, step, tuple(
            jnp.zeros((block_n, block_k), jnp.float32) for _ in range(rows)))
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, block_n), 0)
        total = sum(jnp.where(row == r, jnp.sum(t, axis=1)[None, :], 0.0)
                    for r, t in enumerate(sums))
    out_ref[...] = scaled_epilogue(total, scale_ref[...], None if bias_ref is None else
                                   bias_ref[...], activation, out_ref.dtype) if fused else total


def scaled_epilogue(z, scale, bias, activation: Optional[str], dtype):
    """`act(z · scale + bias)` in float32, in `dtype`: the weight-only and XLA FP8 ways'
    epilog, in the kernel (on tiles) or in an XLA fusion after the GEMM."""
    z = z.astype(jnp.float32) * scale
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    return z.astype(dtype)


def _compiler_params(config: Config):
    from jax.experimental.pallas import triton as plgpu
    # `CompilerParams` in the jax versions this package supports; older ones named it
    # `TritonCompilerParams`.
    params = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return params(num_warps=config.num_warps, num_stages=config.num_stages)


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret"))
def dense(x, data, scale, bias=None, *, activation: Optional[str] = None,
          config: Optional[Config] = None, interpret: bool = False):
    """`act(x @ (scale · data)ᵀ + bias)` in x's dtype, the product in float32.

    Args:
      x: (M, K) bfloat16 or float16, any M (meant for a few dozen at most).
      data: (N, K) float8_e4m3fn or float8_e5m2, K-major (an `Fp8Weight`'s data).
      scale: the weight's float32 scalar dequantization scale.
      bias: (N,) or None.
      activation: None or an `ACTIVATIONS` key ("relu", "gelu": tanh GELU).
      config: the tiling; None: `config_for` the shape.
      interpret: run the kernel's code with Pallas's interpreter (any platform).
    """
    check(x, data, scale, bias, config)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None or one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}")
    from jax.experimental import pallas as pl  # only where the kernel runs

    (rows, k), n = x.shape, data.shape[0]
    config = config or config_for(rows, k, n)
    tile = row_tile(rows, config.mma)
    steps = _cdiv(_cdiv(k, config.block_k), config.split_k)
    chunk = steps * config.block_k
    split = _cdiv(k, chunk)  # no chunk starts past K (its loads would not be masked)
    fused = split == 1
    grid = (_cdiv(rows, tile), _cdiv(n, config.block_n), split)
    in_specs = [pl.BlockSpec((tile, chunk), lambda i, j, s: (i, s)),
                pl.BlockSpec((config.block_n, chunk), lambda i, j, s: (j, s)),
                pl.BlockSpec((1, 1), lambda i, j, s: (0, 0))]
    args = [x, data, scale.reshape(1, 1)]
    if fused and bias is not None:
        in_specs.append(pl.BlockSpec((1, config.block_n), lambda i, j, s: (0, j)))
        args.append(bias.reshape(1, n))
    if fused:
        out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
        out_spec = pl.BlockSpec((tile, config.block_n), lambda i, j, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split, rows, n), jnp.float32)
        out_spec = pl.BlockSpec((None, tile, config.block_n), lambda i, j, s: (s, i, j))
    kernel = functools.partial(_kernel, block_k=config.block_k, steps=steps, k=k,
                               masked=split * chunk != k, activation=activation, fused=fused,
                               mma=config.mma)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
        interpret=interpret, name="jax_epilog_weight_only",
        compiler_params=None if interpret else _compiler_params(config))(*args)
    return out if fused else scaled_epilogue(out.sum(0), scale, bias, activation, x.dtype)


def runs_here() -> bool:
    """Whether the default backend's GPU converts FP8 in Triton: CUDA, compute capability
    8.9 or newer."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 8.9
    except ValueError:
        return False
