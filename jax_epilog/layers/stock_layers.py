"""Flax's own dense layers as served FP8 GEMMs (docs/stock_models.md, "Serving"): which stock
layers can be served, how each one's kernel becomes the `(K, N)` of an `Fp8Weight`, and the
served forward that replaces the layer's computation.

The layers: `nnx.Linear`, `nnx.LinearGeneral`, `nnx.Einsum`, `linen.Dense`,
`linen.DenseGeneral`, `linen.Einsum` (subclasses too, unless they override `__call__`). Each
contracts some input dims with some kernel dims and keeps the rest, so it is one GEMM over
`(rows, K) @ (K, N)`: K the contracted dims, N the kernel's kept dims in the output's order,
rows the input's kept dims. The kernel is stored so once (`stored_kernel`); each call
reshapes (and, for an einsum whose input or output order needs it, transposes) the input and
the result around one `jax_epilog.dense` call, which runs the way the serving planner chooses
with the layer's bias in the GEMM's epilog (`served_forward`).

What cannot be served (`why_not`): kernels with batch dims (`batch_axis`, `batch_dims`, an
einsum letter in input, kernel and output: one weight per batch index), einsums that reduce
over a dim of one operand alone or repeat a letter, an einsum whose string is given only at
call time, custom `dot_general`/`einsum_op`/`promote_dtype` functions (what they compute is
unknown), and compute dtypes other than float16, bfloat16 and float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from jax_epilog.float8.weights import Fp8Weight, quantize_weight
from jax_epilog.layers.functional import dense
from jax_epilog.op.arguments import SUPPORTED_DTYPES
from jax_epilog.op.epilogs import FP8_DTYPES

#: The stock classes by kind: "dense" contracts the input's last dim with the kernel's first,
#: "general" the input's `axis` dims with the kernel's leading dims, "einsum" by its string.
STOCK_CLASSES = (
    ("dense", (nnx.Linear, linen.Dense)),
    ("general", (nnx.LinearGeneral, linen.DenseGeneral)),
    ("einsum", (nnx.Einsum, linen.Einsum)),
)

#: Where a layer's `dot_general`, `dot_general_cls` or `einsum_op` may come from and still be
#: a plain product of its operands: JAX's own, Flax's FP8 ops (the layer trained in FP8) and
#: this package's (the training interception).
PRODUCT_MODULES = ("jax.", "jax._src.", "flax.linen.fp8_ops", "flax.nnx.nn.fp8", "jax_epilog.")


class Unsupported(ValueError):
    """A stock layer the served route cannot take, and why."""


def stock_kind(module) -> Optional[str]:
    """"dense", "general" or "einsum" for a stock layer (or a subclass that keeps its
    `__call__`), else None."""
    unserved = stock_class(type(module))
    for kind, classes in STOCK_CLASSES:
        for cls in classes:
            if issubclass(unserved, cls):
                return kind if unserved.__call__ is cls.__call__ else None
    return None


def stock_class(cls: type) -> type:
    """`cls`, or the class a served or trained subclass of this package's stands for."""
    while True:
        own = getattr(cls, "_jax_epilog_unserved", None) or \
            getattr(cls, "_jax_epilog_untrained", None)
        if own is None or own is cls:
            return cls
        cls = own


def overridden_call(module) -> Optional[str]:
    """Why a subclass of a stock layer that overrides `__call__` is not served (what its call
    computes is not known), or None for any other module."""
    cls = stock_class(type(module))
    for _, classes in STOCK_CLASSES:
        for stock in classes:
            if issubclass(cls, stock) and cls.__call__ is not stock.__call__:
                return (f"its class {cls.__qualname__} overrides {stock.__qualname__}.__call__, "
                        "whose computation is then not known")
    return None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a layer's kernel is the GEMM's `(K, N)`: `contracting` its dims summed over (in the
    order the input's are laid out), `kept` its dims in the output's order."""

    kernel_shape: tuple[int, ...]
    contracting: tuple[int, ...]
    kept: tuple[int, ...]

    @property
    def k(self) -> int:
        return math.prod(self.kernel_shape[d] for d in self.contracting)

    @property
    def n(self) -> int:
        return math.prod(self.kernel_shape[d] for d in self.kept)


@dataclasses.dataclass(frozen=True)
class Einsum:
    """An einsum's operand and result letters, `...` in the input expanded for `ndim` dims."""

    lhs: str
    rhs: str
    out: str

    @classmethod
    def parse(cls, spec: str, ndim: Optional[int] = None) -> "Einsum":
        spec = spec.replace(" ", "")
        if "->" not in spec or spec.count(",") != 1:
            raise Unsupported(f"einsum {spec!r}: expected 'input,kernel->output'")
        operands, out = spec.split("->")
        lhs, rhs = operands.split(",")
        if "..." in rhs:
            raise Unsupported(f"einsum {spec!r}: an ellipsis in the kernel's operand")
        if "..." in lhs:
            if ndim is None:  # the kernel's roles do not depend on the input's extra dims
                lhs, out = lhs.replace("...", ""), out.replace("...", "")
            else:
                free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
                extra = "".join(free[:ndim - (len(lhs) - 3)])
                lhs, out = lhs.replace("...", extra), out.replace("...", extra)
        for name, letters in (("input", lhs), ("kernel", rhs), ("output", out)):
            if len(set(letters)) != len(letters) or not letters.isalpha():
                raise Unsupported(f"einsum {spec!r}: the {name}'s letters repeat or are not "
                                  "letters")
        batch = "".join(sorted(set(rhs) & set(lhs) & set(out)))
        if batch:
            raise Unsupported(f"einsum {spec!r}: batch dims ({batch}, in input, kernel and "
                              "output): one weight per batch index")
        lone = (set(lhs) - set(rhs) - set(out)) | (set(rhs) - set(lhs) - set(out))
        if lone or not set(out) <= set(lhs) | set(rhs):
            raise Unsupported(f"einsum {spec!r}: a dim summed over one operand alone, or an "
                              "output dim from neither operand")
        return cls(lhs, rhs, out)


def einsum_string(module, call_string: Optional[str] = None) -> str:
    """The layer's einsum string: the one it was built with. One given at call time must be
    the same (the kernel was stored for the built one's contraction)."""
    built = getattr(module, "einsum_str", None)
    if built is None:
        raise Unsupported("its einsum string is given only at call time; the kernel's "
                          "contraction must be known when it is stored")
    if call_string is not None and call_string.replace(" ", "") != built.replace(" ", ""):
        raise Unsupported(f"called with einsum {call_string!r}, but its kernel is stored "
                          f"for {built!r}")
    return built


def layout(module, kind: str, kernel_shape) -> Layout:
    """The kernel's `Layout` for a layer of `kind`, from the module's attributes."""
    shape = tuple(int(d) for d in kernel_shape)
    if kind == "dense":
        return Layout(shape, (0,), (1,))
    if kind == "general":
        batch = getattr(module, "batch_axis", None) or getattr(module, "batch_dims", ())
        if batch:
            raise Unsupported(f"batch dims ({tuple(batch)}): one weight per batch index")
        axis = module.axis if isinstance(module.axis, (tuple, list)) else (module.axis,)
        return Layout(shape, tuple(range(len(axis))), tuple(range(len(axis), len(shape))))
    spec = Einsum.parse(einsum_string(module))
    if len(spec.rhs) != len(shape):
        raise Unsupported(f"einsum {module.einsum_str!r} names {len(spec.rhs)} kernel dims, "
                          f"the kernel has {len(shape)}")
    return Layout(shape, tuple(spec.rhs.index(c) for c in spec.rhs if c in spec.lhs),
                  tuple(spec.rhs.index(c) for c in spec.out if c in spec.rhs))


def _is_product(fn, default) -> bool:
    if fn is None or fn is default:
        return True
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return module.startswith(PRODUCT_MODULES)


def layer_ndim(module, kind: str) -> int:
    """The kernel's dims as the layer reads them, from its attributes. A kernel with more is
    stacked by a lifted transform (`nnx.vmap`/`nnx.scan`, `linen.scan`/`linen.vmap` over
    layers), which hands each call one slice."""
    if kind == "dense":
        return 2
    if kind == "general":
        features = module.out_features if isinstance(module, nnx.Module) else module.features
        batch = getattr(module, "batch_axis", None) or getattr(module, "batch_dims", ())
        return len(np.atleast_1d(module.axis)) + len(np.atleast_1d(features)) + len(batch)
    return len(module.kernel_shape if isinstance(module, nnx.Module) else module.shape)


def stacked_dims(module, kind: str, kernel) -> int:
    """How many leading dims of `kernel` stack layers (`layer_ndim`)."""
    lead = jnp.ndim(kernel) - layer_ndim(module, kind)
    if lead < 0:
        raise Unsupported(f"its kernel {jnp.shape(kernel)} has fewer dims than the layer "
                          f"reads ({layer_ndim(module, kind)})")
    return lead


def gemm_layout(module, kind: str, kernel) -> Layout:
    """`layout` of one layer's slice of `kernel` (the whole kernel where none is stacked)."""
    return layout(module, kind, jnp.shape(kernel)[stacked_dims(module, kind, kernel):])


def why_not(module, kind: str, kernel) -> Optional[str]:
    """Why the stock layer `module` (of `kind`, its kernel `kernel`) cannot be served in FP8,
    or None where it can."""
    dtype = jnp.result_type(kernel)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.name in FP8_DTYPES or \
            dtype.itemsize > 4:
        return f"its kernel is {dtype.name}; a 16- or 32-bit float kernel is stored in FP8"
    for name in ("dot_general", "dot_general_cls", "einsum_op"):
        fn = getattr(module, name, None)
        if not _is_product(fn, jax.lax.dot_general if name == "dot_general" else jnp.einsum):
            return f"it has a custom {name} ({fn!r}), whose computation is not known"
    promote = getattr(module, "promote_dtype", None)
    if promote is not None and getattr(promote, "__module__", "").split(".")[0] != "flax":
        return f"it has a custom promote_dtype ({promote!r})"
    compute = getattr(module, "dtype", None) or getattr(module, "param_dtype", jnp.float32)
    if jnp.dtype(compute) not in SUPPORTED_DTYPES:
        return (f"it computes in {jnp.dtype(compute).name}; served GEMMs compute in float16, "
                "bfloat16 or float32")
    try:
        lay = gemm_layout(module, kind, kernel)
    except Unsupported as error:
        return str(error)
    if not lay.k or not lay.n or not jnp.size(kernel):
        return f"its kernel {jnp.shape(kernel)} has an empty dim"
    if not isinstance(kernel, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(kernel))):
        return "its kernel has non-finite values (NaN or Inf)"
    return None


def stored_kernel(module, kind: str, kernel, *, name: str, dtype="float8_e4m3fn",
                  granularity: str = "tensor") -> Fp8Weight:
    """`kernel` as the `Fp8Weight` the served forward reads: its contracted dims then its kept
    dims (`layout`), flattened to `(K, N)` and quantized (`quantize_weight`). A stacked
    kernel (`layer_ndim`) is stored slice by slice: its `Fp8Weight`'s leaves keep the leading
    dims, so the lifted transform hands each call one layer's weight and scale."""
    lay = gemm_layout(module, kind, kernel)

    def store(one):
        matrix = jnp.transpose(one, lay.contracting + lay.kept).reshape(lay.k, lay.n)
        return quantize_weight(matrix, dtype, name=name, granularity=granularity)

    for _ in range(stacked_dims(module, kind, kernel)):
        store = jax.vmap(store)
    return store(jnp.asarray(kernel))


def compute_dtype(module, inputs, bias):
    """The layer's computation dtype: its `dtype`, else what Flax's `promote_dtype` gives for
    the input, the bias and (the kernel being FP8 now) the module's `param_dtype`."""
    if getattr(module, "dtype", None) is not None:
        return jnp.dtype(module.dtype)
    return jnp.result_type(inputs, getattr(module, "param_dtype", jnp.float32),
                           *(() if bias is None else (bias,)))


def served_forward(module, kind: str, inputs, weight: Fp8Weight, bias, *, path: str,
                   einsum_str: Optional[str] = None):
    """What the stock layer computes, `inputs` by its stored weight plus its bias, as one
    served FP8 GEMM with the bias in its epilog (`jax_epilog.dense`). Errors name `path`."""
    try:
        return _served(module, kind, jnp.asarray(inputs), weight, bias, einsum_str)
    except (Unsupported, TypeError, ValueError) as error:
        if type(error) not in (Unsupported, TypeError, ValueError):
            raise  # another library's error: as it is
        raise type(error)(f"{path}: {error}") from error


class Geometry(NamedTuple):
    """One call of a stock layer as the GEMM `(rows, K) @ (K, N)`: the input's permutation
    that puts its kept dims first and its contracted dims last (in the kernel's order), K,
    the kept dims' sizes, the kernel's kept dims (N's, in the output's order), and the
    permutation of the GEMM's reshaped result into the layer's output order (None: none)."""

    rows_perm: tuple
    k: int
    kept_shape: tuple
    kernel_kept: tuple
    out_perm: Optional[tuple]

    @property
    def n(self) -> int:
        return math.prod(self.kernel_kept)

    def rows(self, inputs):
        """`inputs` as the GEMM's `(rows, K)`."""
        return jnp.transpose(inputs, self.rows_perm).reshape(-1, self.k)

    def output(self, y):
        """The GEMM's `(rows, N)` result in the layer's output shape."""
        y = y.reshape(self.kept_shape + self.kernel_kept)
        return y if self.out_perm is None else jnp.transpose(y, self.out_perm)


def geometry(module, kind: str, shape, einsum_str: Optional[str] = None) -> Geometry:
    """The `Geometry` of the stock layer `module` (of `kind`) called on an input of `shape`
    (its einsum string given at call time: `einsum_str`)."""
    ndim = len(shape)
    out_perm = None
    if kind in ("dense", "general"):
        axis = (-1,) if kind == "dense" else module.axis
        axis = axis if isinstance(axis, (tuple, list)) else (axis,)
        in_order = tuple(a % ndim for a in axis)
        kept = tuple(d for d in range(ndim) if d not in in_order)
        features = module.out_features if isinstance(module, nnx.Module) else module.features
        kernel_kept = tuple(int(f) for f in np.atleast_1d(features))
    else:
        spec = Einsum.parse(einsum_string(module, einsum_str), ndim)
        if len(spec.lhs) != ndim:
            raise Unsupported(f"einsum {module.einsum_str!r} expects a {len(spec.lhs)}-dim "
                              f"input, got shape {tuple(shape)}")
        in_order = tuple(spec.lhs.index(c) for c in spec.rhs if c in spec.lhs)
        lhs_kept = [c for c in spec.out if c in spec.lhs]
        rhs_kept = [c for c in spec.out if c in spec.rhs]
        kept = tuple(spec.lhs.index(c) for c in lhs_kept)
        kernel_shape = module.kernel_shape if isinstance(module, nnx.Module) else module.shape
        kernel_kept = tuple(int(kernel_shape[spec.rhs.index(c)]) for c in rhs_kept)
        produced = lhs_kept + rhs_kept
        out_perm = tuple(produced.index(c) for c in spec.out)
        out_perm = None if out_perm == tuple(range(len(out_perm))) else out_perm
    return Geometry(kept + in_order, math.prod(shape[d] for d in in_order),
                    tuple(shape[d] for d in kept), kernel_kept, out_perm)


def _served(module, kind: str, inputs, weight: Fp8Weight, bias, einsum_str):
    geo = geometry(module, kind, inputs.shape, einsum_str)
    if (geo.k, geo.n) != weight.shape:
        raise ValueError(f"the stored FP8 kernel is (K, N) = {weight.shape}, but the input "
                         f"{inputs.shape} and the layer give ({geo.k}, {geo.n})")
    dtype = compute_dtype(module, inputs, bias)
    flat_bias = None if bias is None else jnp.reshape(jnp.asarray(bias), (-1,))
    y = geo.output(dense(geo.rows(inputs), weight, flat_bias, dtype=dtype))
    preferred = getattr(module, "preferred_element_type", None)
    return y if preferred is None else y.astype(preferred)


def kernel_value(variable) -> Any:
    """An NNX `Variable`'s or a Linen param's value (unboxed)."""
    if hasattr(variable, "get_value"):
        return variable.get_value()
    return linen.unbox(variable)
