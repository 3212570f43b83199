"""FP8 training in the layers (SPEC §5): the `Fp8` config and the FP8 stack's custom VJP.

`dense(..., fp8=...)` and `mlp(..., fp8=...)` run each chosen layer's three GEMMs with FP8
operands, per-tensor scaling: *current* scaling, a tensor's scale from its own amax in the
same step, or delayed scaling (below), which takes the scales of the layer inputs and of the
tensors a GEMM writes from amax histories, the state `fp8_state=`. `Fp8()`'s
`scaling="auto"` is delayed scaling where the layers are given a state (the Flax modules
always are) and current scaling where not (`Fp8.resolved`, asked by `plan.plan_stack`).
One `jax.custom_vjp` covers the whole stack, as `layers._stack` does:

- Forward, layer i: the input h and the kernel W are quantized to the forward format (e4m3),
  `q = largest / 2**margin / amax`, a saturating cast of `q·x`. The amax is one XLA reduction
  of the tensor in the compute dtype, in the same jitted expression as the cast, so XLA fuses
  it with what already reads the tensor (`quantize_scaled`). Then ONE `matmul` with FP8
  operands, the bias/ReLU/GELU epilog, the dequantization scales `1/q` and the result in the
  compute dtype. No GEMM is asked for `result_amax`: cuBLASLt gives the amax only with an FP8
  result (measured on the H200, cuBLASLt 13.1; docs/fp8.md has the table), and the layers'
  results are 16/32-bit.
- Residuals: h in FP8 (`(M, K)`; the weight gradient's K-major h8ᵀ is made in the
  backward) and its scale, W
  in FP8 and its scale, the 1-bit ReLU mask (the GELU pre-activation); never a 16/32-bit copy
  of an FP8 layer's input, which is where FP8 saves memory. Under `backward="auto"` a ReLU
  layer followed by an FP8 layer keeps no mask: the next layer's `h8 > 0` is its derivative
  (`plan.relu_from_next_input`).
- Backward: dZ is quantized to the gradient format (e5m2), its amax one XLA reduction fused
  with the cast (and, for the last layer, with its bias gradient: a sum of dZ, FP8 GEMMs have
  no BGRADB). dW = h8ᵀ dZ8 (e4m3 × e5m2) and dZ_{i-1} = dZ8 W8ᵀ with DRELU_BGRAD /
  DGELU_BGRAD for the previous layer (e5m2 × e4m3), which also gives its bias gradient, both
  with results in the compute dtype. Under `backward="auto"` that GEMM runs XLA's way
  (`plan.fp8_gemm_backend`: measured faster on the H200 than cuBLASLt's FP8 DRELU_BGRAD), or,
  for a ReLU whose derivative comes from h8 (`plan.relu_from_next_input`), is a plain FP8 GEMM
  followed by XLA fusions.
- Compute dtype float32: cuBLASLt 13.1 has no FP8 kernel with a float32 result for any epilog
  but DEFAULT and DRELU (no bias, no BGRAD). Those layers keep FP8, and under "auto" their
  other GEMMs run XLA's way (XLA's FP8 GEMM to float32, the epilog as fusions;
  `plan.fp8_gemm_backend`) instead of the reference fallback. The default, bf16 compute, runs
  every GEMM as a kernel.

Which layers run FP8: `Fp8(layers="all")` every one; `"auto"` (what `fp8=True` means) on a
CUDA GPU whose decision tables hold a measured training step of the stack in FP8
(`python -m jax_epilog.tune --fp8`), every layer where that beat bf16 and none where it did not;
elsewhere only the layers whose GEMM is large enough for FP8 to pay for its quantization passes
(`plan.fp8_pays`, from the shapes alone). `plan.quantized_layers` decides. The other layers
are the bf16 (compute dtype) layers of `layers.py`, inside the same custom VJP.

On a CPU the FP8 `matmul` runs the exact reference (FP8 values widened to float32, float32
sums), so the layer computes exactly the quantized math; against the unquantized layer it
differs by FP8 rounding (about 2**-4 relative per e4m3 value, 2**-3 per e5m2 one). On Hopper
the FP8 GEMMs accumulate with less than float32 precision (~2e-4 of the largest value at
K≈96 on random data; integer-valued data is exact), and since every scale comes from the
amax of the previous layer's result, such a difference can move later FP8 roundings by a
quantum: compare GPU and CPU per GEMM or on data whose quantization is exact.

Every choice above (which layers, where each FP8 tensor comes from, each GEMM's epilog and
backend) is made by `plan.plan_stack`; this module carries the plan out
(`jax_epilog.explain` prints it).

Delayed scaling (`Fp8(scaling="delayed")`, the state `fp8_state=`, one `Fp8History` of amax
histories per layer, whose gradient is its next value): a scale known before the GEMM lets
the GEMM write the FP8 tensor and its amax itself (cuBLASLt's FP8 result with `result_amax`),
so the 16-bit tensor, its amax pass and its cast pass never exist. That is done where cuBLASLt
has the kernel and the math allows it: a forward GEMM followed by an FP8 layer writes that
layer's e4m3 input (`plan.writes_fp8_result`), and the data-gradient GEMM below an FP8 ReLU layer
writes its e5m2 gradient, ReLU's derivative then applied to the FP8 bits
(`plan.writes_fp8_gradient`). Every FP8 layer's input takes its scale from its history too;
the other tensors keep current scaling, their amaxes recorded in the state all the same.

Delayed scaling calibrates itself, tensor by tensor (`delayed_amax`): while a history is cold
(largest value 0, as in a fresh `init_state`, or not finite), the amax its scale comes from is
this step's instead. A tensor XLA quantizes takes its own (`quantize_delayed`: a `where`,
not a conditional, which on a GPU would make the host wait); one a GEMM writes takes a bound
on the GEMM's result from amaxes already known (`result_bound`), rounded up to a power of
two. The program is the delayed one either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import layer_gemms, manual_axes
from .epilogs import FP8_DTYPES, Epilog
from .layer_gemms import LAYER_INPUT_NAME, layer_forward
from .matmul import activation_gradient, data_gradient, matmul, weight_gradient
from .plan import (FLOAT32_KERNEL_EPILOGS, FP8_ALIGNMENT, FP8_MIN_FLOPS,  # noqa: F401
                   FP8_RESULT_EPILOGS, Layer, StackPlan, fp8_pays, quantized_layers,
                   weight_grad_gives_bias_grad)
from .reference import saturating_cast

LAYER_CHOICES = ("auto", "all")
#: The layers' GEMMs, as `Fp8(fast_accumulation=)` names them.
FAST_ACCUMULATION_GEMMS = ("forward", "data gradient", "weight gradient")
SCALING_CHOICES = ("auto", "current", "delayed")


@dataclasses.dataclass(frozen=True)
class Fp8:
    """How the layers train in FP8 (`dense(..., fp8=Fp8(...))`; `fp8=True` is `Fp8()`).

    Attributes:
      forward: the format of the activations and weights (the forward GEMM's two operands):
        "float8_e4m3fn" (or `jnp.float8_e4m3fn`). e5m2 is refused: the forward GEMM would be
        e5m2 × e5m2, which cuBLASLt lacks.
      gradient: the format of the gradients dZ: "float8_e5m2" (default, the wider range
        gradients need) or "float8_e4m3fn".
      margin: a non-negative int; scales are `largest / 2**margin / amax` (TransformerEngine's
        margin), leaving headroom of `2**margin` below the format's largest value.
      layers: "auto" (the stack's measured entry, else FP8 where `fp8_pays` says the
        layer's GEMM is large enough; `plan.quantized_layers`) or "all" (every layer).
      fast_accumulation: which FP8 GEMMs use cuBLASLt's fast accumulation (sums not promoted
        to float32 every few steps: faster, less accurate; `matmul(fast_accumulation=)`).
        The layers run three kinds of GEMM, named as in `FAST_ACCUMULATION_GEMMS`:
        "forward", "data gradient" (dZ Wᵀ, a sum over the layer's width) and "weight
        gradient" (hᵀ dZ, a sum over the batch's rows). Give a tuple of those names, or
        "forward" (the forward GEMMs only, TransformerEngine's recipe), False (none: float32
        accumulation throughout) or True (every GEMM, what XLA does for an FP8
        `dot_general` at DEFAULT precision). A tuple naming one or all of them is stored as
        "forward" / True, so each choice has one spelling.
        The default, ("forward", "data gradient"), keeps float32 accumulation only in the
        weight gradient, whose sum runs over every row of the batch: on the H200 it was the
        fastest choice, with M1's gradient error that of "forward" and up to 0.008 more on
        smaller stacks (the measurements: docs/fp8.md, "Measured on the H200").
      scaling: "auto" (default): "delayed" where the layers are given a state (`fp8_state=`;
        the Flax modules `jax_epilog.nnx` and `jax_epilog.linen` always keep one, so
        `fp8=True` there is delayed scaling), "current" where they are not (the functional
        `dense`/`mlp` without `fp8_state=`). Decided once per traced stack (`resolved`).
        "current": every scale from its tensor's own amax in the same step.
        "delayed": TransformerEngine's and Flax's `fp8_ops`' delayed scaling, which lets a
        GEMM write an FP8 tensor itself (its scale is known before it runs): each FP8 layer's
        input that the previous layer's forward GEMM writes (`writes_fp8_result`), and each
        ReLU layer's gradient dZ8 that the data-gradient GEMM above writes
        (`writes_fp8_gradient`). Every FP8 layer's input and those gradients take their
        scales from amax histories kept between steps; the other gradients (the top one,
        GELU's) and the weights keep current scaling, where delayed scaling measured no
        faster on the H200 (docs/fp8.md). The layers then need `fp8_state=` (`init_state`)
        and return the next state as its gradient.
        Delayed scaling calibrates itself: while a tensor's history is cold (all zeros, as
        `init_state` makes it, or not finite), its scale comes from this step: a tensor XLA
        quantizes (the first input) from its own amax, one a GEMM writes from a bound on
        the GEMM's result (|h W + b| <= amax(h)·max column sum |W| + max |b|, and likewise
        for a data gradient), rounded up to a power of two; its own amax is recorded as
        usual, so the next step is warm. No separate calibrating step is needed.
      amax_history_length: the steps of amax history under delayed scaling (1024, as in
        TransformerEngine and Flax); the scale follows the largest.
      amax_reduction_axes: None (default), a mesh axis name or a tuple of names: inside
        `jax.shard_map`, every amax the layers take (the ones that set current scales, the
        ones recorded in the state, the ones FP8-result GEMMs write) is the largest over the
        devices along these axes (`jax.lax.pmax`), as TransformerEngine reduces amaxes over
        its data- and tensor-parallel groups: name every axis that splits the batch, an
        activation or a weight, and the shards' scales and next state are the single-device
        ones. Without it each device scales with its own shard's amaxes. Outside `shard_map`
        (one device, or `jax.jit` with sharded arrays, where an amax is already over the
        whole array) an axis that is not bound does nothing; a name that is not an axis of
        the mesh in use raises an error.
    """

    forward: Any = "float8_e4m3fn"
    gradient: Any = "float8_e5m2"
    margin: int = 0
    layers: str = "auto"
    fast_accumulation: Any = ("forward", "data gradient")
    scaling: str = "auto"
    amax_history_length: int = 1024
    amax_reduction_axes: Any = None

    def __post_init__(self):
        for name in ("forward", "gradient"):
            object.__setattr__(self, name, _format(name, getattr(self, name)))
        if self.forward == "float8_e5m2":
            raise ValueError("forward: float8_e5m2 for activations and weights would make the "
                             "forward GEMM e5m2 × e5m2, which cuBLASLt has no kernel for; use "
                             "float8_e4m3fn (and e5m2 for gradient=)")
        _check_margin(self.margin)
        if self.layers not in LAYER_CHOICES:
            raise ValueError(f"layers: expected one of {LAYER_CHOICES}, got {self.layers!r}")
        object.__setattr__(self, "fast_accumulation", _fast_gemms(self.fast_accumulation))
        if self.scaling not in SCALING_CHOICES:
            raise ValueError(f"scaling: expected one of {SCALING_CHOICES}, got {self.scaling!r}")
        length = self.amax_history_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"amax_history_length: expected a positive int, got {length!r}")
        object.__setattr__(self, "amax_reduction_axes",
                           _axis_names("amax_reduction_axes", self.amax_reduction_axes))

    @property
    def delayed(self) -> bool:
        """Whether delayed scaling runs: "delayed", or "auto" once `resolved` with a state."""
        if self.scaling == "auto":
            raise ValueError('Fp8(scaling="auto") is delayed or current scaling depending on '
                             'whether the layers get fp8_state=: ask Fp8.resolved(has_state)')
        return self.scaling == "delayed"

    @property
    def keeps_state(self) -> bool:
        """Whether layers under this config keep amax histories: the Flax modules create
        them for "auto" (which then runs delayed scaling) and "delayed"."""
        return self.scaling != "current"

    def resolved(self, has_state: bool) -> "Fp8":
        """This config with `scaling="auto"` made concrete for layers given a state
        (`fp8_state=`) or not: delayed scaling with one, current scaling without. The one
        place "auto" is decided (`plan.plan_stack` asks it)."""
        if self.scaling != "auto":
            return self
        return dataclasses.replace(self, scaling="delayed" if has_state else "current")

    def init_state(self, layers: int) -> tuple:
        """The delayed-scaling state of a stack of `layers` layers, before its first step: one
        `Fp8History` of zeros per layer (a zero amax gives scale 1 until one is recorded)."""
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers: expected the number of layers (a positive int), got "
                             f"{layers!r}")
        zeros = lambda: jnp.zeros((self.amax_history_length,), jnp.float32)
        return tuple(Fp8History(zeros(), zeros()) for _ in range(layers))

    def fast(self, gemm: str) -> bool:
        """Whether the layers' `gemm` (one of `FAST_ACCUMULATION_GEMMS`) uses fast
        accumulation."""
        if gemm not in FAST_ACCUMULATION_GEMMS:
            raise ValueError(f"gemm: expected one of {FAST_ACCUMULATION_GEMMS}, got {gemm!r}")
        fast = self.fast_accumulation
        return fast is True or fast == gemm or (isinstance(fast, tuple) and gemm in fast)

    def quantized_layers(self, rows: int, widths) -> tuple[bool, ...]:
        """Which layers of a stack (`widths`: its K_0, K_1, ..., K_last) run FP8 by the rule,
        without the decision tables (`plan.quantized_layers` says why; on a GPU a measured
        stack entry can decide otherwise, which `jax_epilog.explain` shows)."""
        return tuple(c.choice == "fp8" for c in quantized_layers(self, rows, widths))


def _fast_gemms(value):
    """`Fp8.fast_accumulation` in its one spelling: False, True, "forward", or a tuple of
    `FAST_ACCUMULATION_GEMMS` names in their order (two of the three)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list, set, frozenset)) or \
            not all(isinstance(n, str) and n in FAST_ACCUMULATION_GEMMS for n in names):
        raise ValueError(f"fast_accumulation: expected False, True, \"forward\" or a tuple of "
                         f"{FAST_ACCUMULATION_GEMMS}, got {value!r}")
    names = tuple(n for n in FAST_ACCUMULATION_GEMMS if n in names)
    if not names:
        return False
    if len(names) == len(FAST_ACCUMULATION_GEMMS):
        return True
    return "forward" if names == ("forward",) else names


def _check_margin(margin) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin: expected a non-negative int (scales are largest / "
                         f"2**margin / amax), got {margin!r}")


def _format(name: str, value) -> str:
    try:
        dtype = jnp.dtype(value).name
    except TypeError:
        dtype = None
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: expected an FP8 format, {' or '.join(FP8_DTYPES)}, got "
                         f"{value!r}")
    return dtype


def _axis_names(name: str, value) -> Optional[tuple[str, ...]]:
    """None, or `value` (a mesh axis name or a sequence of them) as a tuple of names."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or \
            not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{name}: expected None, a mesh axis name or a tuple of distinct "
                         f"names (e.g. (\"data\", \"model\")), got {value!r}")
    return tuple(names)


def as_fp8(fp8) -> Optional[Fp8]:
    """The layers' `fp8=` argument as a config: None/False -> None, True -> `Fp8()`."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Fp8()
    if isinstance(fp8, Fp8):
        return fp8
    raise TypeError(f"fp8: expected None, a bool or jax_epilog.Fp8(...), got "
                    f"{type(fp8).__name__} {fp8!r}")


class Fp8History(NamedTuple):
    """One layer's FP8 scaling state: float32 amax histories, the most recent first, of the
    layer's input (`input`) and of the gradient of its result (`gradient`; where a GEMM writes
    it, the amax before ReLU's derivative), from which `Fp8(scaling="delayed")` takes the
    scales of the tensors a GEMM writes. The layers return the next state as the gradient of
    this one (Flax's "overwrite with gradient" convention,
    `flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT`)."""

    input: Any
    gradient: Any


# --- quantization ---------------------------------------------------------------------------

def amax(x):
    """max |x| in float32 (0 for an empty x)."""
    return jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)


def multiplier(x_amax, dtype: str, margin: int):
    """The float32 quantization multiplier `q = largest / 2**margin / amax`; 1 where the amax
    is 0 or not finite (or q would not be)."""
    q = float(jnp.finfo(dtype).max) / 2.0**margin / x_amax
    ok = (x_amax > 0) & jnp.isfinite(x_amax) & jnp.isfinite(q)
    return jnp.where(ok, q, 1.0).astype(jnp.float32)


def quantize(x, x_amax, dtype: str, margin: int):
    """(x in FP8, the float32 scale that dequantizes it): `q·x` rounded and saturated, with
    q = `multiplier(x_amax, ...)`."""
    q = multiplier(x_amax, dtype, margin)
    return saturating_cast(x.astype(jnp.float32) * q, dtype), 1.0 / q


def reduce_amax(x_amax, axes):
    """`x_amax`, the largest over the devices along the bound axes among `axes`
    (`Fp8.amax_reduction_axes`), so that inside `shard_map` it is the whole tensor's amax.
    Axes that are not bound (outside `shard_map`, where the amax already covers the whole
    array) are skipped (`bound_axes`)."""
    bound = bound_axes(axes)
    return jax.lax.pmax(x_amax, bound) if bound else x_amax


def bound_axes(axes) -> tuple[str, ...]:
    """The names among `axes` (`Fp8.amax_reduction_axes`) that are bound here (inside
    `shard_map`); a name that is not an axis of the mesh in use is an error."""
    bound = []
    for name in axes or ():
        try:
            jax.lax.axis_size(name)
        except NameError:
            mesh = jax.sharding.get_abstract_mesh()
            if not mesh.empty and name not in mesh.axis_names:
                raise ValueError(f"amax_reduction_axes: {name!r} is not an axis of the mesh "
                                 f"in use, whose axes are {mesh.axis_names}; name the axes "
                                 f"that split the batch, activations or weights") from None
            continue
        bound.append(name)
    return tuple(bound)


_calibrates = contextvars.ContextVar("jax_epilog_fp8_calibrates", default=True)


@contextlib.contextmanager
def uncalibrated():
    """Within the block (in this thread), stacks traced under delayed scaling do not calibrate
    themselves: a cold history gives scale 1 (no own amax, no bounds). What the tests
    and `benchmarks/fp8_bench.py` compare self-calibration with; not for training."""
    token = _calibrates.set(False)
    try:
        yield
    finally:
        _calibrates.reset(token)


def quantize_delayed(x, history, dtype: str, margin: int, amax_axes=None):
    """(x in FP8, its dequantization scale, amax(x)): delayed scaling, the scale from the
    largest amax of `history` (earlier steps), x's own amax (over `amax_axes`,
    `reduce_amax`) recorded for the next step. While `history` is cold (`cold`) and the
    layers calibrate (`uncalibrated`), the scale is x's own amax's, chosen by a `where` on
    two scalars. Not a `jax.lax.cond`: on a GPU XLA copies a conditional's predicate to the
    host and waits for it, so every stack stalled the step once (a 4-block GPT on the H200
    ran 129 ms a step for 100 ms of kernels, docs/fp8.md). The price: the cast waits for the
    amax, so x is read twice where XLA cannot fuse the amax into x's producer."""
    x_amax = reduce_amax(amax(x), amax_axes)
    scale_amax = jnp.max(history)
    if _calibrates.get():
        scale_amax = jnp.where(cold(history), x_amax, scale_amax)
    x8, scale = quantize(x, scale_amax, dtype, margin)
    return x8, scale, x_amax


def cold(history):
    """Whether the amax `history` gives no delayed scale yet: its largest value is 0 (a fresh
    `Fp8.init_state`, or no amax recorded yet) or not finite."""
    largest = jnp.max(history)
    return ~(jnp.isfinite(largest) & (largest > 0))


def power_of_two_above(x):
    """The smallest power of two >= x (float32, x > 0): a bound rounded so that float32
    rounding in computing it cannot change the scale it gives."""
    return jnp.exp2(jnp.ceil(jnp.log2(x))).astype(jnp.float32)


def delayed_amax(history, bound):
    """The amax a GEMM-written tensor's delayed scale comes from: `history`'s largest, or,
    while it is `cold` (and the layers calibrate), `bound` (`result_bound`), an upper bound
    on this step's amax rounded up to a power of two: the FP8 values then fill less of the
    format, but nothing saturates and small values are kept (e5m2 gradients lose nothing
    a bound 64 times too large would matter to; e4m3 inputs keep 2**6 of range below it)."""
    largest = jnp.max(history)
    if not _calibrates.get():
        return largest
    return jnp.where(cold(history), power_of_two_above(bound), largest)


def result_bound(operand_amax, other, axis: int, bias=None):
    """An upper bound on |R| for a GEMM result R = A @ B (+ bias), from the amax of A's
    values (`operand_amax`) and B's values `other` (float32, summed along `axis`, its
    contracted one): |R| <= amax(A) · max_j sum_k |B[k, j]| + max |bias|."""
    bound = operand_amax * jnp.max(jnp.sum(jnp.abs(other.astype(jnp.float32)), axis=axis))
    if bias is not None:
        bound = bound + jnp.max(jnp.abs(bias.astype(jnp.float32)))
    return bound


def quantize_scaled(x, dtype: str, margin: int, history=None, amax_axes=None):
    """(x in FP8, its dequantization scale, amax(x)): delayed scaling from `history`, or
    current scaling without one: the amax (over `amax_axes`, `reduce_amax`) and the cast in
    one expression (XLA fuses the reduction with the producer of x or the cast's read of it),
    the amax the one the scale came from, so recording it in a state costs nothing."""
    if history is not None:
        return quantize_delayed(x, history, dtype, margin, amax_axes)
    x_amax = reduce_amax(amax(x), amax_axes)
    return (*quantize(x, x_amax, dtype, margin), x_amax)


def quantize_tensor(x, dtype="float8_e4m3fn", *, margin: int = 0):
    """Per-tensor current scaling of `x`, as the layers do it (`Fp8(scaling="current")`):
    `(x8, scale)` with `x ≈ scale * x8` (x8 in `dtype`, scale a float32 scalar), the convention of
    `matmul(..., quantization_scales={"a": scale_a, "b": scale_b})`. The scale maps amax(x) to
    the format's largest value divided by `2**margin`; values are rounded and saturated.
    Public as `jax_epilog.quantize`."""
    if not isinstance(x, jax.Array | np.ndarray) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x: expected a floating-point array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_margin(margin)
    x8, scale, _ = quantize_scaled(x, _format("dtype", dtype), margin)
    return x8, scale


def record(history, x_amax):
    """`history` with `x_amax` as its most recent entry (the oldest dropped)."""
    return jnp.concatenate([jnp.reshape(x_amax, (1,)).astype(history.dtype), history[:-1]])


def _matmul8(a8, sa, b8, sb, dtype, backend, fast: bool, *, epilog=Epilog.DEFAULT,
             inputs=None, result_scale=None, **transposes):
    """(y in `dtype`, aux dict) of one FP8 GEMM, `(sa·a8) @ (sb·b8)` with `epilog`, asking
    `matmul` for `backend` (the plan's `requested`), with fast accumulation if `fast`. With
    `result_scale` (the quantization multiplier of an FP8 `dtype`), y is FP8 and
    `aux["result_amax"]` its amax: cuBLASLt gives an amax only with an FP8 result
    (docs/fp8.md); a 16/32-bit y's amax is the caller's XLA reduction."""
    scales = {"a": sa, "b": sb}
    if result_scale is not None:
        scales["d"] = result_scale
    out = matmul(a8, b8, epilog=epilog, epilog_inputs=inputs,
                 backend=backend,
                 quantization_scales=scales, preferred_element_type=dtype,
                 result_amax=result_scale is not None, fast_accumulation=fast, **transposes)
    return out if isinstance(out, tuple) else (out, {})


def positive(x8):
    """`x8 > 0` for an FP8 array, as integer compares of its bits (measured faster on the H200
    than XLA's float compare of FP8 values: docs/fp8.md). Positive values are the bit patterns
    from 1 (the smallest subnormal) up to the largest finite value, or +Inf where the format
    has one; +0, negative values and NaN are not."""
    dtype = jnp.dtype(x8.dtype)
    largest = np.array(np.inf, dtype)
    if not np.isinf(largest.astype(np.float32)):  # no Inf (e4m3fn): its largest finite value
        largest = np.array(jnp.finfo(dtype).max, dtype)
    bits = jax.lax.bitcast_convert_type(x8, jnp.uint8)
    return (bits >= 1) & (bits <= largest.view(np.uint8))


def _barrier(*arrays):
    """`jax.lax.optimization_barrier` over `arrays` (None passes), each crossing it flattened.

    A 1-D array has one layout, so XLA cannot carry a layout across the barrier: without the
    flattening, layout assignment moved the weight gradient's transposes (h8ᵀ, dZ8ᵀ) into the
    producers, storing h8 and dZ8 column-major, and then transposed the forward's h8 back and
    computed the ReLU derivative on a transposed 16-bit data gradient: 13 transposes, 4.3 ms
    of an M1 step on the H200 where its 8 one-byte transposes take about 1.8 ms
    (docs/fp8.md, "Layouts")."""
    flat = jax.lax.optimization_barrier(
        tuple(None if a is None else a.reshape(-1) for a in arrays))
    return tuple(None if f is None else f.reshape(a.shape) for f, a in zip(flat, arrays))


# --- the custom VJP over a stack --------------------------------------------------------------

class Saved(NamedTuple):
    """What the backward keeps of one layer: its input (`(M, K)`, FP8 with `input_scale`, or
    in the compute dtype with None), its kernel (likewise, `(K, N)`), its activation's
    residual, and an FP8 input's amax (for the next state)."""

    input: Any
    input_scale: Any
    kernel: Any
    kernel_scale: Any
    residual: Any
    input_amax: Any = None


def _planned_forward(planned: StackPlan, x, params, state, keep_residuals: bool):
    """(y, the residuals) of the stack's forward as `planned` says, every scale as its
    config's `scaling` says (`_forward` chooses the plan)."""
    stack, fp8 = planned.stack, planned.fp8
    mode = "step" if keep_residuals else "forward"
    h, saved = x, []
    h8 = None  # the current layer's FP8 input (scale, amax), when the layer before wrote it
    for i, (layer, (kernel, bias)) in enumerate(zip(stack.layers, params)):
        own = planned.layers[i]
        keep = keep_residuals and not own.relu_from_next_input
        if not own.fp8:
            layer_input = h
            h, residual = layer_forward(stack, layer, h, kernel, bias, keep)
            saved.append(Saved(layer_input, None, kernel, None, residual))
            continue
        if h8 is not None:
            h8, h_scale, h_amax = h8
        else:
            h8, h_scale, h_amax = quantize_scaled(
                h, fp8.forward, fp8.margin, state[i].input if fp8.delayed else None,
                fp8.amax_reduction_axes)
        w8, w_scale, _ = quantize_scaled(kernel, fp8.forward, fp8.margin,
                                         amax_axes=fp8.amax_reduction_axes)
        gemm = planned.gemm(i, "forward", mode)
        epilog, fp8_result = gemm.epilog, own.writes_fp8_result
        q_next = multiplier(delayed_amax(state[i + 1].input, reduce_amax(result_bound(
            h_amax, kernel, 0, bias if layer.has_bias else None), fp8.amax_reduction_axes)),
            fp8.forward, fp8.margin) if fp8_result else None
        out, aux = _matmul8(h8, h_scale, w8, w_scale, fp8.forward if fp8_result else x.dtype,
                            gemm.requested, fp8.fast("forward"), epilog=epilog,
                            inputs={"bias": bias} if layer.has_bias else None,
                            result_scale=q_next)
        residual = aux.get(epilog.aux_output) if epilog.aux_output else None
        # Kept as h8 (M, K), as the forward GEMM read it: the previous layer's ReLU derivative
        # reads it elementwise (`relu_from_next_input`); the weight gradient's K-major h8ᵀ is
        # made in the backward, from this one byte per element.
        saved.append(Saved(h8, h_scale, w8, w_scale, residual, h_amax))
        if fp8_result:
            h, h8 = None, (out, 1.0 / q_next,
                           reduce_amax(aux["result_amax"], fp8.amax_reduction_axes))
        else:
            h, h8 = out, None
    return h, tuple(saved)


def _forward(planned: StackPlan, x, params, state, keep_residuals: bool):
    """`_planned_forward`, its residuals then named for remat policies."""
    histories = [state[i].input for i, own in enumerate(planned.layers) if own.fp8] \
        if state is not None else []
    if planned.fp8.delayed and state is not None and _calibrates.get():
        # Checked before the calibration, which picks between a history's scale (the same on
        # every device) and an unreduced amax's (not): every amax varies over the axes the
        # stack does, less those it is reduced over, and the next state must not.
        reduced = bound_axes(planned.fp8.amax_reduction_axes)
        _check_recordable(planned, [a for a in manual_axes.varying_axes([x]) if a not in reduced],
                          state)
    h, saved = _planned_forward(planned, x, params, state, keep_residuals)
    named = lambda value, name: None if value is None else checkpoint_name(value, name)
    return h, tuple(s._replace(input=named(s.input, LAYER_INPUT_NAME),
                               residual=named(s.residual, layer_gemms.residual_name(
                                   layer.activation)))
                    for s, layer in zip(saved, planned.stack.layers))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_stack(planned: StackPlan, x, params, state):
    return _forward(planned, x, params, state, keep_residuals=False)[0]


def _fp8_stack_fwd(planned: StackPlan, x, params, state):
    y, saved = _forward(planned, x, params, state, keep_residuals=True)
    return y, (saved, state)


def _fp8_stack_bwd(planned: StackPlan, residuals, dy):
    saved, state = residuals
    return _planned_backward(planned, saved, state, dy)


def _planned_backward(planned: StackPlan, saved, state, dy):
    stack, fp8 = planned.stack, planned.fp8
    stack_layers = stack.layers
    fast_data, fast_weight = fp8.fast("data gradient"), fp8.fast("weight gradient")
    dz = activation_gradient(dy, saved[-1].residual, stack_layers[-1].activation)
    gemm = dict(precision=stack.precision, backend=stack.backward)
    dbias = None  # the current layer's bias gradient, when the step above has given it
    dz8 = None  # the current layer's (dZ8, scale), when the step above has written it
    grads, gradient_amaxes = [], {}
    for i in reversed(range(len(stack_layers))):
        s = saved[i]
        previous = stack_layers[i - 1] if i else None
        previous_residual = saved[i - 1].residual if i else None
        need_bias_grad = weight_grad_gives_bias_grad(stack_layers, i)
        if not planned.layers[i].fp8:
            dkernel, own_dbias = weight_gradient(s.input, dz, bias_gradient=need_bias_grad,
                                                 **gemm)
            below = previous or Layer(None, False)
            dz, next_dbias = data_gradient(dz, s.kernel, activation=below.activation,
                                           has_bias=below.has_bias, residual=previous_residual,
                                           **gemm)
        else:
            below_plan = planned.layers[i - 1] if i else None
            data = planned.gemm(i, "data gradient")
            if dz8 is None:
                # Current scaling for gradients in 16 bits (`Fp8.scaling`).
                dz8, dz_scale, gradient_amaxes[i] = quantize_scaled(
                    dz, fp8.gradient, fp8.margin, amax_axes=fp8.amax_reduction_axes)
            else:  # written by the step above (`writes_fp8_gradient`); its bias gradient too
                dz8, dz_scale = dz8
            # Memory (docs/fp8.md, "Memory"): dZ8ᵀ and h8ᵀ, the weight gradient's K-major
            # operands, are made from dZ8 and h8 after the barrier (so the 16-bit dZ is dead by
            # then), and the data gradient's GEMM, whose 16-bit result is the largest buffer
            # here, waits for the weight gradient (so both transposes are dead by then).
            # FP8 GEMMs have no BGRADB: the bias gradient is a sum of dZ, which XLA fuses with
            # dZ's amax above (both read dZ once); before the barrier, so dZ dies there.
            own_dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(dy.dtype) \
                if need_bias_grad else None
            dz8, h8, own_dbias = _barrier(dz8, s.input, own_dbias)
            dkernel, _ = _matmul8(h8.T, s.input_scale, dz8.T, dz_scale, dy.dtype,
                                  planned.gemm(i, "weight gradient").requested, fast_weight,
                                  transpose_b=True)
            dz8, dkernel = _barrier(dz8, dkernel)
            if below_plan is not None and below_plan.writes_fp8_gradient:
                # The previous layer's dZ8 straight from the GEMM (delayed scale, its amax),
                # ReLU's derivative h8 > 0 applied to its bits, the bias gradient its sum.
                # |dZ Wᵀ| <= amax(dZ) · max row sum |W|: the bound a cold history takes
                bound = result_bound(gradient_amaxes[i], s.kernel, 1) * s.kernel_scale
                q = multiplier(delayed_amax(state[i - 1].gradient, reduce_amax(
                    bound, fp8.amax_reduction_axes)), fp8.gradient, fp8.margin)
                p8, aux = _matmul8(dz8, dz_scale, s.kernel, s.kernel_scale, fp8.gradient,
                                   data.requested, fast_data, transpose_b=True, result_scale=q)
                gradient_amaxes[i - 1] = reduce_amax(aux["result_amax"],
                                                     fp8.amax_reduction_axes)
                bits = jnp.where(positive(h8), jax.lax.bitcast_convert_type(p8, jnp.uint8),
                                 jnp.zeros((), jnp.uint8))
                dz8 = jax.lax.bitcast_convert_type(bits, p8.dtype)
                next_dbias = (jnp.sum(dz8, axis=0, dtype=jnp.float32) / q).astype(dy.dtype) \
                    if previous.has_bias else None
                dz8, dz = (dz8, 1.0 / q), None
            elif below_plan is not None and below_plan.relu_from_next_input:
                # ReLU's derivative from this layer's own FP8 input h8 = Q(relu(z)), as XLA
                # fusions after a plain FP8 GEMM (also the previous layer's bias gradient).
                p, _ = _matmul8(dz8, dz_scale, s.kernel, s.kernel_scale, dy.dtype,
                                data.requested, fast_data, transpose_b=True)
                dz = jnp.where(positive(h8), p, jnp.zeros((), p.dtype))
                next_dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(dz.dtype) \
                    if previous.has_bias else None
            else:
                epilog = data.epilog
                dz, aux = _matmul8(
                    dz8, dz_scale, s.kernel, s.kernel_scale, dy.dtype, data.requested, fast_data,
                    epilog=epilog, transpose_b=True,
                    inputs={epilog.aux_input: previous_residual} if epilog.aux_input else None)
                next_dbias = aux.get(epilog.reduction_output) if previous is not None and \
                    previous.has_bias and epilog.reduction_output else None
            if dz is not None:
                dz8 = None
        grads.append((dkernel, own_dbias if need_bias_grad else dbias))
        dbias = next_dbias
    return dz, tuple(reversed(grads)), _next_state(planned, saved, state, gradient_amaxes)


def _next_state(planned: StackPlan, saved, state, gradient_amaxes):
    """The state's cotangent: its next value (Flax's "overwrite with gradient"), each FP8
    layer's histories with this step's amaxes recorded; a bf16 layer's unchanged."""
    if state is None:
        return None
    amaxes = [s.input_amax for s in saved] + list(gradient_amaxes.values())
    _check_recordable(planned, manual_axes.varying_axes(amaxes), state)
    return tuple(Fp8History(record(h.input, s.input_amax), record(h.gradient,
                                                                   gradient_amaxes[i]))
                 if q else h for i, (q, s, h) in enumerate(zip(planned.quantized, saved, state)))


def _check_recordable(planned: StackPlan, varying, state):
    """Inside shard_map: an error where this step's amaxes, varying over the mesh axes
    `varying`, may differ between the devices that share `state`."""
    unreduced = [a for a in varying if a not in manual_axes.varying_axes(jax.tree.leaves(state))]
    if unreduced:  # each device would record its own amaxes
        wanted = tuple(dict.fromkeys((*(planned.fp8.amax_reduction_axes or ()), *unreduced)))
        raise ValueError(f"fp8_state: inside shard_map this step's amaxes may differ "
                         f"between the devices along the mesh axes {tuple(unreduced)}, but "
                         f"fp8_state is the same on every device; pass fp8=Fp8(..., "
                         f"amax_reduction_axes={wanted}) so that every device records the "
                         f"amaxes of the whole tensors")


_fp8_stack.defvjp(_fp8_stack_fwd, _fp8_stack_bwd)


def check_state(fp8: Optional[Fp8], state, n_layers: int, name: str = "fp8_state"):
    """`state` (the layers' `fp8_state=`) as a tuple of `n_layers` `Fp8History`, checked
    against `fp8`: required by `scaling="delayed"`, optional with "auto" (which it makes
    delayed) and with "current" (which then records its amaxes), refused without FP8."""
    if fp8 is None and state is not None:
        raise ValueError(f"{name}: the amax histories of FP8 layers, only with fp8="
                         f"jax_epilog.Fp8(...); got fp8={fp8!r}")
    make = f"jax_epilog.Fp8(...).init_state({n_layers})"
    if state is None:
        if fp8 is None or fp8.scaling != "delayed":
            return None
        raise ValueError(f"{name}: fp8=Fp8(scaling=\"delayed\") needs the amax histories of "
                         f"its {n_layers} layer(s): pass {name}={make} at the first step and "
                         f"the gradient w.r.t. {name} (its next value) after each step")
    if isinstance(state, Fp8History):
        state = (state,)
    if not isinstance(state, (tuple, list)) or len(state) != n_layers:
        raise ValueError(f"{name}: expected {n_layers} Fp8History (one per layer, as {make} "
                         f"makes), got {type(state).__name__} of "
                         f"{len(state) if isinstance(state, (tuple, list)) else '?'}")
    checked = []
    for i, history in enumerate(state):
        if not (isinstance(history, tuple) and len(history) == 2):
            raise ValueError(f"{name}[{i}]: expected an Fp8History(input, gradient), got "
                             f"{history!r}")
        for field, value in zip(Fp8History._fields, history):
            shape, dtype = jnp.shape(value), jnp.result_type(value)
            if len(shape) != 1 or shape[0] < 1 or dtype != jnp.float32:
                raise ValueError(f"{name}[{i}].{field}: expected a float32 amax history of "
                                 f"shape (length,), got {dtype} {shape}")
        checked.append(Fp8History(*history))
    return tuple(checked)


@jax.custom_vjp
def carry_state(y, state):
    """y, with `state`'s cotangent its own value: a stack under delayed scaling whose layers
    all stay bf16 (`Fp8(layers="auto")`) returns its state unchanged as its gradient."""
    del state
    return y


carry_state.defvjp(lambda y, state: (y, state), lambda state, dy: (dy, state))


def stack(planned: StackPlan, rows, params, state=None):
    """The stack on `rows` `(M, K)` as `planned` (`plan.plan_stack`, with FP8 layers) says
    (called by `layers._run`); `state`: the `Fp8History` of each layer under delayed scaling
    (or recording current scaling's amaxes), else None."""
    return _fp8_stack(planned, rows, params, state)
