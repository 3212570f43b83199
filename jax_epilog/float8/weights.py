"""Weights stored in FP8 for serving (docs/serving.md): `Fp8Weight`, a kernel quantized once,
and `quantize_params`, which turns a Flax parameter tree's large kernels into them.

An `Fp8Weight` is a pytree (`data`, `scale`, `input_scale`), so it goes wherever parameters
go: `jax.jit` arguments, `nnx.State`, Linen's `{"params": ...}`, orbax checkpoints (half the
bytes of bf16 on disk). `data` is the kernel transposed, `(N, K)`: the K-major layout cuBLASLt's
FP8 kernels read on Hopper, so no call transposes it again. The layers that run it are
`jax_epilog.layers.serving`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.float8 import scaling
from jax_epilog.float8.blocks import quantize_rows
from jax_epilog.float8.recipe import fp8_format
from jax_epilog.op.epilogs import FP8_DTYPES

#: `quantize_params`'s default rule: a kernel is stored in FP8 when both its dims are at least
#: this. Smaller GEMMs gain little from half the weight bytes and pay the activation's
#: quantization; a byte-vocabulary head (N 256) or a small model stays 16-bit.
MIN_FEATURES = 512

#: The parameter name the default rule quantizes: Flax's `Dense`, `nnx.Linear` and ours.
KERNEL_NAME = "kernel"

#: How finely a stored weight is scaled: one scale for the kernel ("tensor") or one per
#: output channel ("channel": a column of the (K, N) kernel; docs/serving.md).
GRANULARITIES = ("tensor", "channel")

#: The submodules of a SwiGLU block (`jax_epilog.linen.SwiGLU`, `jax_epilog.nnx.SwiGLU`, and
#: the three-`Dense` blocks whose checkpoints they load): `quantize_params` stores their
#: kernels together or not at all, since the block serves them only together.
SWIGLU_PARTS = ("gate", "up", "down")

#: The format a stored weight's input is quantized to (by the served layers, or inside the
#: few-row kernel): e4m3, the forward operands' format in training too.
INPUT_FORMAT = "float8_e4m3fn"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A `(K, N)` kernel stored in FP8 for inference: `kernel ≈ scale * data.T`.

    Attributes:
      data: `(N, K)` float8_e4m3fn (or e5m2): the kernel transposed, the layout the FP8 GEMM
        reads.
      scale: float32 that dequantizes `data`: a scalar (per-tensor), or `(N,)`, one per
        output channel (a row of `data`, a column of the kernel).
      input_scale: None, or a float32 scalar: the layer's input is quantized with this static
        scale (`x8 = x / input_scale`, saturated), set by `jax_epilog.calibrate`. None: the
        input's own amax each call (current scaling), each token's own before a per-channel
        `scale`.

    No checks here: JAX rebuilds pytrees with placeholders inside its transforms. The layers
    check what they are given (`check_weight`).
    """

    data: Any
    scale: Any
    input_scale: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """The kernel's shape `(K, N)`, as the 16-bit parameter it replaces."""
        n, k = jnp.shape(self.data)
        return k, n

    ndim = 2

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(jnp.shape(x))) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(self))


def quantize_weight(kernel, dtype="float8_e4m3fn", *, name: str = "kernel",
                    granularity: str = "tensor") -> Fp8Weight:
    """`kernel` `(K, N)` as an `Fp8Weight`: a scale from its amax (`granularity` "tensor"),
    or one from each output channel's ("channel"), values rounded to nearest. A non-finite
    value (concrete kernels only: under `jit` it cannot be seen) raises a `ValueError` naming
    `name`: its scale would turn every value into NaN or zero."""
    dtype = fp8_format("dtype", dtype)
    _check_granularity(granularity)
    kernel_dtype = jnp.result_type(kernel)
    if jnp.ndim(kernel) != 2 or not jnp.issubdtype(kernel_dtype, jnp.floating) or \
            kernel_dtype.name in FP8_DTYPES:
        raise ValueError(f"{name}: expected a 16/32-bit float kernel of shape (K, N), got "
                         f"{jnp.result_type(kernel)} of shape {jnp.shape(kernel)}")
    if not isinstance(kernel, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(kernel))):
        raise ValueError(f"{name}: has non-finite values (NaN or Inf); an FP8 weight's scale "
                         f"comes from its largest value, so fix or exclude this parameter")
    if granularity == "channel":
        data, scales = quantize_rows(jnp.asarray(kernel).T, dtype)
        return Fp8Weight(data, scales.values)
    data, scale = scaling.quantize(jnp.asarray(kernel).T, scaling.amax(kernel), dtype, 0)
    return Fp8Weight(data, scale)


def _check_granularity(granularity) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")


def key_names(path) -> tuple[str, ...]:
    """The names along a pytree key path (dict keys, attributes, sequence indices as
    strings), without NNX's trailing `value`."""
    names = []
    for key in path:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                names.append(str(getattr(key, field)))
                break
    return tuple(names[:-1] if names and names[-1] == "value" else names)


def default_rule(path, leaf) -> bool:
    """`quantize_params`'s default: a 2-D float leaf named `kernel` whose dims are both at
    least `MIN_FEATURES`."""
    names = key_names(path)
    return bool(names) and names[-1] == KERNEL_NAME and jnp.ndim(leaf) == 2 and \
        jnp.issubdtype(jnp.result_type(leaf), jnp.floating) and \
        min(jnp.shape(leaf)) >= MIN_FEATURES


def quantize_params(params, *, include: Optional[Callable[[Any, Any], bool]] = None,
                    dtype="float8_e4m3fn", granularity: str = "tensor"):
    """`params` with each large kernel stored in FP8 (an `Fp8Weight`), for inference.

    Args:
      params: a parameter pytree: Linen's `variables["params"]` (or the whole `variables`),
        `nnx.state(model, nnx.Param)` (then `nnx.update(model, quantize_params(state))`), or
        any tree of arrays.
      include: `include(path, leaf) -> bool` chooses the leaves to quantize (`path` is JAX's
        key path; `jax_epilog.float8.weights.key_names(path)` gives its names). Default
        `default_rule`: 2-D leaves named `kernel` with both dims >= `MIN_FEATURES`, so
        embeddings, norms, biases and small layers stay as they are. To keep a large output
        head 16-bit, e.g. `include=lambda p, x: default_rule(p, x) and "head" not in
        key_names(p)`.
      dtype: the stored format, "float8_e4m3fn" (default) or "float8_e5m2".
      granularity: "tensor" (default), one scale per kernel, or "channel", one per output
        channel (a kernel column): a channel of small weights then keeps its precision
        beside a channel of large ones (docs/serving.md, "Per-channel scales").

    A SwiGLU block's `gate`, `up` and `down` kernels (`SWIGLU_PARTS`) are stored together,
    where the rule picks all three, or none stays stored: the block serves them together.

    Returns:
      The same structure; chosen leaves are `Fp8Weight`s, the rest unchanged. Only
      `jax_epilog`'s layers (`dense`, `mlp`, `swiglu`, `jax_epilog.linen`, `jax_epilog.nnx`)
      run them.
      A non-finite kernel raises a `ValueError` naming its path.
    """
    rule = default_rule if include is None else include
    if not callable(rule):
        raise TypeError(f"include: expected a function (path, leaf) -> bool, got {include!r}")
    dtype = fp8_format("dtype", dtype)
    _check_granularity(granularity)

    chosen = _together(params, rule)

    def visit(path, leaf):
        if isinstance(leaf, Fp8Weight) or not chosen[key_names(path)]:
            return leaf
        return quantize_weight(leaf, dtype, name="/".join(key_names(path)) or "params",
                               granularity=granularity)

    return jax.tree_util.tree_map_with_path(
        visit, params, is_leaf=lambda x: isinstance(x, Fp8Weight))


def _together(params, rule) -> dict[tuple[str, ...], bool]:
    """`rule`'s choice for each leaf of `params` (by its names), a SwiGLU block's three
    kernels (`SWIGLU_PARTS`, the same leaf name under each) stored only if each is chosen."""
    leaves = jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: isinstance(x, Fp8Weight))
    chosen = {key_names(path): isinstance(leaf, Fp8Weight) or bool(rule(path, leaf))
              for path, leaf in leaves}  # an Fp8Weight stays as it is (`visit`)
    for names in chosen:
        if len(names) >= 2 and names[-2] == SWIGLU_PARTS[0]:
            block = [names[:-2] + (part, names[-1]) for part in SWIGLU_PARTS]
            if all(part in chosen for part in block):
                together = all(chosen[part] for part in block)
                chosen.update((part, together) for part in block)
    return chosen


def check_weight(name: str, weight: Fp8Weight, in_features: int, source: str = "x") -> None:
    """An `Fp8Weight` given to a layer whose input (`source`, for the error) has
    `in_features`: its data FP8 of shape (N, in_features), its scale a float32 scalar or
    `(N,)`, its input scale a float32 scalar; concrete scales must be finite and positive."""
    data = weight.data
    if jnp.ndim(data) != 2 or jnp.result_type(data).name not in FP8_DTYPES:
        raise ValueError(f"{name}: an Fp8Weight holds FP8 data of shape (N, K), got "
                         f"{jnp.result_type(data)} of shape {jnp.shape(data)}; make it with "
                         f"jax_epilog.quantize_params")
    if jnp.shape(data)[1] != in_features:
        raise ValueError(f"{name}: the stored FP8 kernel is (K, N) = {weight.shape}, but {source} "
                         f"has {in_features} features")
    for field, shapes in (("scale", ((), jnp.shape(data)[:1])), ("input_scale", ((),))):
        value = getattr(weight, field)
        if value is None:
            continue
        if jnp.shape(value) not in shapes or jnp.result_type(value) != jnp.float32:
            want = "a float32 scalar" + (f" or float32 of shape {shapes[1]} (one per output "
                                         "channel)" if len(shapes) > 1 else "")
            raise ValueError(f"{name}.{field}: expected {want}, got "
                             f"{jnp.result_type(value)} of shape {jnp.shape(value)}")
        if not isinstance(value, jax.core.Tracer):
            values = np.asarray(value, np.float64)
            if not (np.all(np.isfinite(values)) and np.all(values > 0)):
                bad = values[~(np.isfinite(values) & (values > 0))].flat[0]
                raise ValueError(f"{name}.{field}: expected a finite positive scale, got "
                                 f"{float(bad)}")
