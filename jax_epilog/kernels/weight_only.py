"""The weight-only GEMM for few rows (decoding), our own kernel in Pallas on Triton.

`h (M, K) @ (scale · data)ᵀ` with `data` the stored e4m3 weight `(N, K)` and h 16-bit,
for M up to a few dozen rows. Such a GEMM is bound by reading the weight: FP8 halves the
bytes, so it can run up to twice as fast as the bf16 one. XLA's own fusion of the convert
into its dot reads the FP8 weight at about half the bandwidth it reads a bf16 one (0.87-1.12x
bf16 on the H200, docs/serving.md), so the win needs a kernel that streams the weight:

- the grid is `(N / block_n, split_k)`; each program reads a `block_n`-row stripe of the
  weight over `K / split_k` columns, `block_k` at a time (Triton pipelines the loads over
  `num_stages`), converts it to the input's dtype and accumulates `x · wᵀ` in float32;
- the rows are padded to `MIN_ROWS` (the smallest tile Triton's dot takes); their bytes are
  nothing beside the weight's;
- the `split_k` partial sums come out in float32 `(split_k, rows, N)`; their sum, the scale,
  bias and activation are one XLA fusion after it (`weight_only` in `layers.serving`).

`runs_here` says where it runs (a CUDA GPU of compute capability 8.9 or newer, shapes that
divide into the config's blocks); elsewhere the serving layer computes the same product with
XLA. `interpret=True` runs the kernel's own code on any platform, which the CPU tests use.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

#: Triton's dot takes at least 16 rows; fewer are padded.
MIN_ROWS = 16


class Config(NamedTuple):
    """The kernel's tiling: `block_n` weight rows (output columns) per program, `block_k`
    columns per loop step, `split_k` programs along K, and Triton's warps and stages."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    #: Compute `w · xᵀ` (the weight as the dot's left operand, converted in registers, which
    #: Triton's dot takes from registers) instead of `x · wᵀ`.
    swap: bool = False


DEFAULT = Config()


def padded_rows(rows: int) -> int:
    """The rows the kernel runs: a power of two, at least `MIN_ROWS`."""
    return max(MIN_ROWS, 1 << max(0, rows - 1).bit_length())


def fits(k: int, n: int, config: Config = DEFAULT) -> bool:
    """Whether a `(N, K)` weight divides into `config`'s blocks."""
    return n % config.block_n == 0 and k % (config.split_k * config.block_k) == 0


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int, swap: bool):
    def step(i, total):
        start = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(start, block_k)]
        w = w_ref[:, pl.ds(start, block_k)].astype(x.dtype)
        left, right = (w, x) if swap else (x, w)
        return total + jax.lax.dot_general(left, right, (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)

    out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def partial_products(x, data, *, config: Config = DEFAULT, interpret: bool = False):
    """Float32 partial sums of `x (M, K) @ data (N, K)ᵀ` (data converted to x's dtype),
    `(split_k, padded rows, N)`, or of its transpose, `(split_k, N, padded rows)`, with
    `config.swap`; `product` sums them."""
    rows, k = x.shape
    n = data.shape[0]
    if not fits(k, n, config):
        raise ValueError(f"weight_only kernel: a ({n}, {k}) weight does not divide into "
                         f"{config}; use `fits` first")
    m = padded_rows(rows)
    x = jnp.pad(x, ((0, m - rows), (0, 0)))
    chunk = k // config.split_k
    kernel = functools.partial(_kernel, block_k=config.block_k, steps=chunk // config.block_k,
                               swap=config.swap)
    if config.swap:  # partial sums of yᵀ: (split_k, N, padded rows)
        out_shape, out_block = (config.split_k, n, m), (None, config.block_n, m)
        out_index = lambda j, s: (s, j, 0)
    else:
        out_shape, out_block = (config.split_k, m, n), (None, m, config.block_n)
        out_index = lambda j, s: (s, 0, j)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(n // config.block_n, config.split_k),
        in_specs=[pl.BlockSpec((m, chunk), lambda j, s: (0, s)),
                  pl.BlockSpec((config.block_n, chunk), lambda j, s: (j, s))],
        out_specs=pl.BlockSpec(out_block, out_index),
        compiler_params=_compiler_params(config),
        interpret=interpret,
        name="jax_epilog_weight_only",
    )(x, data)


def _compiler_params(config: Config):
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def product(x, data, *, config: Config = DEFAULT, interpret: bool = False):
    """`x @ data.T` in float32, `(M, N)`."""
    total = partial_products(x, data, config=config, interpret=interpret).sum(0)
    return (total.T if config.swap else total)[:x.shape[0]]


def runs_here(k: int, n: int, config: Config = DEFAULT) -> bool:
    """Whether the kernel runs for a `(N, K)` weight on the default backend: a CUDA GPU that
    converts e4m3 in Triton (compute capability 8.9 or newer) and a shape that fits."""
    if not fits(k, n, config) or jax.default_backend() != "gpu":
        return False
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", "0")
    try:
        return float(capability) >= 8.9
    except ValueError:
        return False
