"""The cuBLASLt epilogs and THE table of what each one computes, reads and writes.

`Epilog` mirrors `cublasLtEpilogue_t` (and nvmath-python's `MatmulEpilog`) value for value.
Every other module learns about an epilog from `TABLE` (through `Epilog`'s properties):
abstract evaluation, the reference, padding, sharding and the argument checks. To add
an input or output to an epilog, change its row here (and `ARRAYS` for a new kind of array),
and the C++ table in `ffi/epilogs.h`; docs/architecture.md lists what restates parts of it.
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
import jax
import numpy as np

from jax_epilog.op import activations
from jax_epilog.op.activations import gelu_aux_columns, relu_mask_bytes


class Activation(NamedTuple):
    """An activation, what the forward keeps of it, and how the backward applies its derivative."""

    fn: Callable          # z -> act(z), as cuBLASLt computes it
    plain: Callable       # z -> act(z), as a user writes it (XLA fuses this form into its GEMM)
    residual: str         # the array the forward keeps for the backward (an `ARRAYS` key)
    keep: Callable        # (z, dtype) -> that array
    derivative: Callable  # (dy, residual, n) -> dy * act'(z)


ACTIVATIONS = {
    "relu": Activation(activations.relu, jax.nn.relu, "relu_aux", activations.keep_relu,
                       activations.apply_relu),
    "gelu": Activation(activations.gelu, functools.partial(jax.nn.gelu, approximate=True),
                       "gelu_aux", activations.keep_gelu, activations.apply_gelu),
}


class Array(NamedTuple):
    """An array a call reads or writes besides a, b and y, in the kernel's rank-3 form.

    `dims` name its axes: batch (a's batch), bias_batch (1 or batch), m, n, and the aux arrays'
    row lengths mask_bytes (16·⌈N/128⌉) and gelu_cols (8·⌈N/8⌉); () is a scalar. `sums` marks a
    bias gradient: the sum over M of the epilog's result ("y"), or over K of operand "a" or "b".
    `dtype` None is the floating aux dtype of the call (`aux_dtype`).
    """

    dims: tuple[str, ...]
    dtype: Optional[str]  # None: aux_dtype(the result's dtype)
    what: str
    sums: Optional[str] = None


ARRAYS = {
    "bias": Array(("bias_batch", "n"), None, "the bias along N"),
    "relu_aux": Array(("batch", "m", "mask_bytes"), "uint8", "the ReLU bit mask"),
    "gelu_aux": Array(("batch", "m", "gelu_cols"), None, "the GELU pre-activation"),
    "drelu_bgrad": Array(("batch", "n"), None, "the bias gradient", sums="y"),
    "dgelu_bgrad": Array(("batch", "n"), None, "the bias gradient", sums="y"),
    "bgrada": Array(("batch", "m"), None, "a summed over K", sums="a"),
    # One row per batch, also for a shared b (the rows are then equal).
    "bgradb": Array(("batch", "n"), None, "b summed over K", sums="b"),
    # FP8 calls only (SPEC §5): the scales are operands after the epilog's inputs, the amax a
    # result after its outputs (`operand_names`, `result_names`).
    "scale_a": Array((), "float32", "a's dequantization scale"),
    "scale_b": Array((), "float32", "b's dequantization scale"),
    "scale_d": Array((), "float32", "the FP8 result's quantization scale"),
    "result_amax": Array((), "float32", "max |R| before the d scale and the cast"),
    # Calls with a C matrix only (SPEC §6): R = epilog(alpha · P + beta · C); after the scales
    # (`operand_names`). C has y's shape and dtype (the 16/32-bit result's: an FP8 result
    # with C is refused), folded like y.
    "c": Array(("batch", "m", "n"), None, "the matrix C added as beta · C (y's shape)"),
    "alpha": Array((), "float32", "the product's scale alpha"),
    "beta": Array((), "float32", "C's scale beta"),
}

#: The operands a call with a C matrix adds, after the FP8 scales (SPEC §6).
C_NAMES = ("c", "alpha", "beta")

# --- dtypes (SPEC §1 and §5) -------------------------------------------------------------------

#: Operand dtypes without quantization (the result has the operands' dtype).
WIDE_DTYPES = ("float16", "bfloat16", "float32")
#: FP8 operand and result dtypes (SPEC §5): both operands FP8, never both e5m2.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: What `preferred_element_type` may be with FP8 operands; DEFAULT_FP8_RESULT when not given.
FP8_RESULT_DTYPES = WIDE_DTYPES + FP8_DTYPES
DEFAULT_FP8_RESULT = "bfloat16"


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).name in FP8_DTYPES


def aux_dtype(result_dtype) -> np.dtype:
    """The dtype of every floating aux input and output (bias, gelu_aux, bias gradients): the
    result's when that is 16- or 32-bit, bfloat16 when the result is FP8 (SPEC §5)."""
    return jnp.dtype("bfloat16") if is_fp8(result_dtype) else jnp.dtype(result_dtype)


def array_dtype(name: str, result_dtype) -> np.dtype:
    """The dtype of `ARRAYS[name]` in a call whose result `y` has `result_dtype`."""
    fixed = ARRAYS[name].dtype
    return jnp.dtype(fixed) if fixed else aux_dtype(result_dtype)


def scale_names(operand_dtype, result_dtype) -> tuple[str, ...]:
    """The scale operands of a call: a's and b's with FP8 operands, and d's for an FP8 result."""
    if not is_fp8(operand_dtype):
        return ()
    return ("scale_a", "scale_b", "scale_d") if is_fp8(result_dtype) else ("scale_a", "scale_b")


def operand_names(epilog: "Epilog", operand_dtype, result_dtype,
                  has_c: bool = False) -> tuple[str, ...]:
    """A call's operands in the kernel's order: a, b, the epilog's inputs, the scales, and
    with a C matrix c, alpha, beta (SPEC §6)."""
    return ("a", "b", *epilog.input_names, *scale_names(operand_dtype, result_dtype),
            *(C_NAMES if has_c else ()))


def result_names(epilog: "Epilog", result_amax: bool = False) -> tuple[str, ...]:
    """A call's results in the kernel's order: y, the epilog's outputs, the amax if asked."""
    return ("y", *epilog.output_names, *(("result_amax",) if result_amax else ()))


#: Columns of N one shard must hold whole for an aux dim to split with N (16 bytes = 128 bits).
AUX_DIM_COLUMNS = {"mask_bytes": 128, "gelu_cols": 8}


def dim_sizes(batch: int, m: int, n: int, bias_batch: int = 1) -> dict[str, int]:
    return dict(batch=batch, bias_batch=bias_batch, m=m, n=n, mask_bytes=relu_mask_bytes(n),
                gelu_cols=gelu_aux_columns(n))


class Row(NamedTuple):
    """One epilog: y = activation(P [+ bias]) or y = P * derivative(aux), and its arrays."""

    activation: Optional[str] = None  # applied to P + bias (forward epilogs)
    derivative: Optional[str] = None  # whose derivative multiplies P (backward epilogs)
    inputs: tuple[str, ...] = ()      # in the kernel's operand order, after a and b
    outputs: tuple[str, ...] = ()     # in the kernel's result order, after y


class Epilog(enum.IntEnum):
    """What cuBLASLt does to the product `P = a @ b` before writing it (see SPEC §1)."""

    DEFAULT = 1
    RELU = 2
    RELU_AUX = 130
    BIAS = 4
    RELU_BIAS = 6
    RELU_AUX_BIAS = 134
    DRELU = 136
    DRELU_BGRAD = 152
    GELU = 32
    GELU_AUX = 160
    GELU_BIAS = 36
    GELU_AUX_BIAS = 164
    DGELU = 192
    DGELU_BGRAD = 208
    BGRADA = 256
    BGRADB = 512

    # The facts below derive from the static `TABLE`: each is computed once per member.

    @functools.cached_property
    def row(self) -> Row:
        return TABLE[self]

    @functools.cached_property
    def activation(self) -> Optional[str]:
        """'relu' or 'gelu' for the forward epilogs that apply one, else None."""
        return self.row.activation

    @functools.cached_property
    def derivative(self) -> Optional[str]:
        """'relu' or 'gelu' for the backward epilogs that apply its derivative, else None."""
        return self.row.derivative

    @functools.cached_property
    def has_bias(self) -> bool:
        return "bias" in self.row.inputs

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        """The keys `epilog_inputs` must have, in the order the kernel takes them."""
        return self.row.inputs

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        """Keys of the aux dict `matmul` returns (empty: `matmul` returns y alone)."""
        return self.row.outputs

    @functools.cached_property
    def aux_input(self) -> Optional[str]:
        """'relu_aux' or 'gelu_aux' for the epilogs that read one, else None."""
        return next((name for name in self.row.inputs if name != "bias"), None)

    @functools.cached_property
    def aux_output(self) -> Optional[str]:
        """'relu_aux' / 'gelu_aux' for the forward epilogs that keep one, else None."""
        return next((name for name in self.row.outputs if not ARRAYS[name].sums), None)

    @functools.cached_property
    def reduction_output(self) -> Optional[str]:
        """The name of the bias-gradient output, for the epilogs that reduce one."""
        return next((name for name in self.row.outputs if ARRAYS[name].sums), None)

    @functools.cached_property
    def is_backward(self) -> bool:
        """Epilogs that are themselves gradients (they read a mask or reduce a bias gradient)."""
        return bool(self.derivative or self.reduction_output)

    @functools.cached_property
    def linear_in_k(self) -> bool:
        """Whether every output is a sum over K of terms (so partial sums may be added)."""
        return not (self.activation or self.derivative or self.has_bias)

    @functools.cached_property
    def with_aux(self) -> "Epilog":
        """The same forward computation keeping the residual the backward pass needs."""
        return self.find(self.activation, self.has_bias, keep_residual=True) \
            if self.activation else self

    @functools.cached_property
    def without_aux(self) -> "Epilog":
        """The same forward computation without the auxiliary output (for inference)."""
        return self.find(self.activation, self.has_bias) if self.activation else self

    @staticmethod
    def find(activation: Optional[str], bias: bool, keep_residual: bool = False) -> "Epilog":
        """The forward epilog computing `activation(P [+ bias])` [keeping its residual]."""
        inputs = ("bias",) if bias else ()
        outputs = (ACTIVATIONS[activation].residual,) if keep_residual and activation else ()
        return _BY_ROW[Row(activation, None, inputs, outputs)]

    @staticmethod
    def find_derivative(activation: str, bias_gradient: bool) -> "Epilog":
        """The backward epilog computing `P * activation'(z)` [and its sum over M]."""
        residual = ACTIVATIONS[activation].residual
        outputs = (f"d{activation}_bgrad",) if bias_gradient else ()
        return _BY_ROW[Row(None, activation, (residual,), outputs)]


_R, _G = "relu", "gelu"
TABLE: dict[Epilog, Row] = {
    Epilog.DEFAULT: Row(),
    Epilog.RELU: Row(_R),
    Epilog.RELU_AUX: Row(_R, outputs=("relu_aux",)),
    Epilog.BIAS: Row(inputs=("bias",)),
    Epilog.RELU_BIAS: Row(_R, inputs=("bias",)),
    Epilog.RELU_AUX_BIAS: Row(_R, inputs=("bias",), outputs=("relu_aux",)),
    Epilog.DRELU: Row(derivative=_R, inputs=("relu_aux",)),
    Epilog.DRELU_BGRAD: Row(derivative=_R, inputs=("relu_aux",), outputs=("drelu_bgrad",)),
    Epilog.GELU: Row(_G),
    Epilog.GELU_AUX: Row(_G, outputs=("gelu_aux",)),
    Epilog.GELU_BIAS: Row(_G, inputs=("bias",)),
    Epilog.GELU_AUX_BIAS: Row(_G, inputs=("bias",), outputs=("gelu_aux",)),
    Epilog.DGELU: Row(derivative=_G, inputs=("gelu_aux",)),
    Epilog.DGELU_BGRAD: Row(derivative=_G, inputs=("gelu_aux",), outputs=("dgelu_bgrad",)),
    Epilog.BGRADA: Row(outputs=("bgrada",)),
    Epilog.BGRADB: Row(outputs=("bgradb",)),
}
_BY_ROW = {row: epilog for epilog, row in TABLE.items()}


def as_epilog(epilog) -> Epilog:
    """An `Epilog` from a member, its value, its (case-insensitive) name, or nvmath-python's
    `MatmulEpilog` member of the same name."""
    if isinstance(epilog, Epilog):
        return epilog
    if type(epilog).__module__.startswith("nvmath") and isinstance(epilog, enum.Enum):
        if epilog.name in Epilog.__members__:
            return Epilog[epilog.name]
        raise ValueError(f"epilog: nvmath-python's {epilog.name} has no cuBLASLt epilog here; "
                         f"expected one of {', '.join(Epilog.__members__)}")
    if isinstance(epilog, str):
        try:
            return Epilog[epilog.strip().upper()]
        except KeyError:
            names = ", ".join(e.name.lower() for e in Epilog)
            raise ValueError(f"epilog: unknown name {epilog!r}; expected one of {names}") from None
    try:  # any integer, NumPy's included, but not bool
        value = operator.index(epilog) if not isinstance(epilog, (bool, np.bool_)) else None
    except TypeError:
        value = None
    if value is None:
        raise TypeError(f"epilog: expected an Epilog, its name or its int value, "
                        f"got {type(epilog).__name__} {epilog!r}")
    try:
        return Epilog(value)
    except ValueError:
        values = ", ".join(f"{e.name}={e.value}" for e in Epilog)
        raise ValueError(f"epilog: unknown value {epilog}; expected one of {values}") from None


__all__ = ["ACTIVATIONS", "ARRAYS", "AUX_DIM_COLUMNS", "Activation", "Array", "C_NAMES",
           "DEFAULT_FP8_RESULT",
           "Epilog", "FP8_DTYPES", "FP8_RESULT_DTYPES", "Row", "TABLE", "WIDE_DTYPES",
           "array_dtype", "as_epilog", "aux_dtype", "dim_sizes", "gelu_aux_columns", "is_fp8",
           "operand_names", "relu_mask_bytes", "result_names", "scale_names"]
