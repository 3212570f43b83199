"""The cuBLASLt epilogs: names, values, and what each one reads and writes.

`Epilog` mirrors `cublasLtEpilogue_t` (and nvmath-python's `MatmulEpilog`) value for value, so
code written against either reads the same here. Everything the rest of the package needs to
know about an epilog (its activation, which inputs it takes, which auxiliary output it writes)
is derived here from the value, in one place.
"""

from __future__ import annotations

import enum
import operator
from typing import Optional

import numpy as np


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

    # --- what the epilog computes -------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        return self in _WITH_BIAS

    @property
    def activation(self) -> Optional[str]:
        """'relu' or 'gelu' for the forward epilogs that apply one, else None."""
        if self in (Epilog.RELU, Epilog.RELU_AUX, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS):
            return "relu"
        if self in (Epilog.GELU, Epilog.GELU_AUX, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS):
            return "gelu"
        return None

    @property
    def is_backward(self) -> bool:
        """Epilogs that are themselves gradients (they read a mask or reduce a bias gradient)."""
        return self in _BACKWARD

    # --- what it reads besides a and b ----------------------------------------------------
    @property
    def aux_input(self) -> Optional[str]:
        """'relu_aux' or 'gelu_aux' for the epilogs that read one, else None."""
        if self in (Epilog.DRELU, Epilog.DRELU_BGRAD):
            return "relu_aux"
        if self in (Epilog.DGELU, Epilog.DGELU_BGRAD):
            return "gelu_aux"
        return None

    @property
    def input_names(self) -> tuple[str, ...]:
        """The keys `epilog_inputs` must have, in the order the kernel takes them."""
        names = ("bias",) if self.has_bias else ()
        return names + ((self.aux_input,) if self.aux_input else ())

    # --- what it writes besides y ------------------------------------------------------------
    @property
    def aux_output(self) -> Optional[str]:
        """'relu_aux' / 'gelu_aux' for the forward epilogs that keep one, else None."""
        if self in (Epilog.RELU_AUX, Epilog.RELU_AUX_BIAS):
            return "relu_aux"
        if self in (Epilog.GELU_AUX, Epilog.GELU_AUX_BIAS):
            return "gelu_aux"
        return None

    @property
    def reduction_output(self) -> Optional[str]:
        """The name of the bias-gradient output, for the epilogs that reduce one."""
        return _REDUCTIONS.get(self)

    @property
    def output_names(self) -> tuple[str, ...]:
        """Keys of the aux dict `matmul` returns (empty: `matmul` returns y alone)."""
        return tuple(n for n in (self.aux_output, self.reduction_output) if n)

    @property
    def without_aux(self) -> "Epilog":
        """The same forward computation without the auxiliary output (for inference)."""
        return _WITHOUT_AUX.get(self, self)

    @property
    def with_aux(self) -> "Epilog":
        """The same forward computation keeping the residual the backward pass needs."""
        return _WITH_AUX.get(self, self)


_WITH_BIAS = frozenset({Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS,
                        Epilog.GELU_AUX_BIAS})
_BACKWARD = frozenset({Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.DGELU, Epilog.DGELU_BGRAD,
                       Epilog.BGRADA, Epilog.BGRADB})
_REDUCTIONS = {
    Epilog.DRELU_BGRAD: "drelu_bgrad",
    Epilog.DGELU_BGRAD: "dgelu_bgrad",
    Epilog.BGRADA: "bgrada",
    Epilog.BGRADB: "bgradb",
}
_WITHOUT_AUX = {
    Epilog.RELU_AUX: Epilog.RELU,
    Epilog.RELU_AUX_BIAS: Epilog.RELU_BIAS,
    Epilog.GELU_AUX: Epilog.GELU,
    Epilog.GELU_AUX_BIAS: Epilog.GELU_BIAS,
}
_WITH_AUX = {v: k for k, v in _WITHOUT_AUX.items()}


def as_epilog(epilog) -> Epilog:
    """An `Epilog` from a member, its value or its (case-insensitive) name."""
    if isinstance(epilog, Epilog):
        return epilog
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


def relu_mask_bytes(n: int) -> int:
    """Bytes per row of a ReLU bit mask: cuBLASLt's leading dimension is N rounded up to 128 bits."""
    return 16 * -(-n // 128)


def gelu_aux_columns(n: int) -> int:
    """Columns per row of the GELU pre-activation buffer: N rounded up to 8 elements."""
    return 8 * -(-n // 8)
