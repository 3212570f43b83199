"""The FP8 recipe of the layers (SPEC §5): `Fp8`, the configuration `fp8=` takes (formats,
scaling, margin, which layers, fast accumulation, amax reduction axes), and `Fp8History`, one
layer's delayed-scaling state (`fp8_state=`), with `check_state`, its argument check.

How a layer carries the recipe out is `jax_epilog.layers.fp8_step`; the quantization math is
`jax_epilog.float8.scaling`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Optional, get_args

import jax.numpy as jnp
import numpy as np

from jax_epilog.op.epilogs import FP8_DTYPES

#: `Fp8(layers=)`: which layers of a stack run FP8.
Layers = Literal["auto", "all"]
LAYER_CHOICES = get_args(Layers)
#: The layers' GEMMs, as `Fp8(fast_accumulation=)` names them.
FAST_ACCUMULATION_GEMMS = ("forward", "data gradient", "weight gradient")
#: `Fp8(scaling=)`: the recipe's scaling.
Scaling = Literal["auto", "current", "delayed", "block"]
SCALING_CHOICES = get_args(Scaling)
#: The gradient format of each scaling where `Fp8(gradient=)` is not given: e5m2's range for
#: one scale per tensor; e4m3 for block scaling, whose per-tile scales need no such range
#: (DeepSeek-V3's and TransformerEngine's `Float8BlockScaling` recipe).
DEFAULT_GRADIENT = {"block": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True)
class Fp8:
    """How the layers train in FP8 (`dense(..., fp8=Fp8(...))`; `fp8=True` is `Fp8()`).

    Attributes:
      forward: the format of the activations and weights (the forward GEMM's two operands):
        "float8_e4m3fn" (or `jnp.float8_e4m3fn`). e5m2 is refused: the forward GEMM would be
        e5m2 × e5m2, which cuBLASLt lacks.
      gradient: the format of the gradients dZ: None (default) is "float8_e5m2" (the wider
        range per-tensor gradients need), and "float8_e4m3fn" under `scaling="block"`; or
        either format by name, except e5m2 with block scaling (refused: its GEMMs are e4m3).
      margin: a non-negative int; scales are `largest / 2**margin / amax` (TransformerEngine's
        margin), leaving headroom of `2**margin` below the format's largest value.
      layers: "auto" (the stack's measured entry, else FP8 where `fp8_pays` says the
        layer's GEMM is large enough; `stack_plan.quantized_layers`) or "all" (every layer).
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
        weight gradient, whose sum runs over every row of the batch: it was the fastest choice,
        with M1's gradient error that of "forward" and a little more on smaller stacks
        (docs/fp8.md, "Fast accumulation"; benchmarks/results/fp8_peer.md).
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
        faster (docs/fp8.md). The layers then need `fp8_state=` (`init_state`)
        and return the next state as its gradient.
        Delayed scaling calibrates itself: while a tensor's history is cold (all zeros, as
        `init_state` makes it, or not finite), its scale comes from this step: a tensor XLA
        quantizes (the first input) from its own amax, one a GEMM writes from a bound on
        the GEMM's result (|h W + b| <= amax(h)·max column sum |W| + max |b|, and likewise
        for a data gradient), rounded up to a power of two; its own amax is recorded as
        usual, so the next step is warm. No separate calibrating step is needed.
        "block": DeepSeek-V3's block scaling (`jax_epilog.layers.block_step`; docs/fp8.md,
        "Block-scaled training"): current scaling per 1×128 tile of the activations and
        gradients (along each GEMM's contraction) and per 128×128 block of the weights, e4m3
        throughout. It keeps no state (`fp8_state=` is refused), so the Flax modules hold no
        amax histories; `margin` must be 0 and `amax_reduction_axes` None (a tile's amax is
        its own), and `fast_accumulation` does not apply (cuBLASLt's block-scaled GEMMs take
        no such choice).
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
    gradient: Any = None
    margin: int = 0
    layers: Layers = "auto"
    fast_accumulation: Any = ("forward", "data gradient")
    scaling: Scaling = "auto"
    amax_history_length: int = 1024
    amax_reduction_axes: Any = None

    def __post_init__(self):
        if self.gradient is None:
            object.__setattr__(self, "gradient",
                               DEFAULT_GRADIENT.get(self.scaling, "float8_e5m2"))
        for name in ("forward", "gradient"):
            object.__setattr__(self, name, fp8_format(name, getattr(self, name)))
        if self.forward == "float8_e5m2":
            raise ValueError("forward: float8_e5m2 for activations and weights would make the "
                             "forward GEMM e5m2 × e5m2, which cuBLASLt has no kernel for; use "
                             "float8_e4m3fn (and e5m2 for gradient=)")
        check_margin(self.margin)
        if self.layers not in LAYER_CHOICES:
            raise ValueError(f"layers: expected one of {LAYER_CHOICES}, got {self.layers!r}")
        object.__setattr__(self, "fast_accumulation", _fast_gemms(self.fast_accumulation))
        if self.scaling not in SCALING_CHOICES:
            raise ValueError(f"scaling: expected one of {SCALING_CHOICES}, got {self.scaling!r}")
        if self.scaling == "block":
            self._check_block()
        length = self.amax_history_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"amax_history_length: expected a positive int, got {length!r}")
        object.__setattr__(self, "amax_reduction_axes",
                           _axis_names("amax_reduction_axes", self.amax_reduction_axes))

    def _check_block(self) -> None:
        """Refuses, naming the field, what block scaling has no use for."""
        if self.gradient != "float8_e4m3fn":
            raise ValueError(f"gradient: scaling=\"block\" quantizes gradients to "
                             f"float8_e4m3fn (one scale per 1×128 tile needs no e5m2 range, as "
                             f"in DeepSeek-V3 and TransformerEngine), got {self.gradient!r}; "
                             f"leave gradient= unset")
        if self.margin:
            raise ValueError(f"margin: scaling=\"block\" maps each tile's own amax to the "
                             f"format's largest value (no stale scale to leave headroom for); "
                             f"expected 0, got {self.margin!r}")
        if self.amax_reduction_axes is not None:
            raise ValueError(f"amax_reduction_axes: scaling=\"block\" takes each tile's amax "
                             f"from the tile alone, which no device shares; expected None, got "
                             f"{self.amax_reduction_axes!r}")

    @property
    def block(self) -> bool:
        """Whether this is block scaling (`scaling="block"`: no state, per-tile scales)."""
        return self.scaling == "block"

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
        return self.scaling in ("auto", "delayed")

    def resolved(self, has_state: bool) -> "Fp8":
        """This config with `scaling="auto"` made concrete for layers given a state
        (`fp8_state=`) or not: delayed scaling with one, current scaling without. The one
        place "auto" is decided (`stack_plan.plan_stack` asks it)."""
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


def check_margin(margin) -> None:
    """A `ValueError` naming `margin` unless it is a non-negative int (every quantizer asks)."""
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin: expected a non-negative int (scales are largest / "
                         f"2**margin / amax), got {margin!r}")


def fp8_format(name: str, value) -> str:
    """`value` (a dtype or its name) as an FP8 format's name, or a `ValueError` naming the
    argument `name`: the one check of an FP8 dtype argument."""
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

def check_state(fp8: Optional[Fp8], state, n_layers: int, name: str = "fp8_state"):
    """`state` (the layers' `fp8_state=`) as a tuple of `n_layers` `Fp8History`, checked
    against `fp8`: required by `scaling="delayed"`, optional with "auto" (which it makes
    delayed) and with "current" (which then records its amaxes), refused without FP8 and
    with "block" (which keeps no state)."""
    if fp8 is None and state is not None:
        raise ValueError(f"{name}: the amax histories of FP8 layers, only with fp8="
                         f"jax_epilog.Fp8(...); got fp8={fp8!r}")
    if fp8 is not None and fp8.block and state is not None:
        raise ValueError(f"{name}: fp8=Fp8(scaling=\"block\") scales every tile from its own "
                         f"amax and keeps no state; pass no {name}")
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
