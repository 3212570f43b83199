"""The XLA FFI targets of the C++ handler: their names, the attributes each decodes, and their
registration with XLA.

A module exported with `jax.export` names a target and passes its attributes; it runs in a
later process only if that target is still registered and decodes the same attributes. So a
target's attribute set never changes under its name (docs/exporting.md): a change is a new
target, and the old one stays registered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class Target(NamedTuple):
    """One registered custom-call target: its name, the library's symbol of its execute stage
    (the initialize stage is the same symbol + "Initialize"), and the attributes it decodes,
    in `ffi/epilog_matmul.cc`'s order, with their types."""

    name: str
    symbol: str
    attributes: tuple[tuple[str, type], ...]


#: The attributes of the matmul targets (`ffi/epilog_matmul.cc`, `.Attr<T>(name)`).
MATMUL_ATTRIBUTES = (("epilog", np.int32), ("transpose_a", bool), ("transpose_b", bool),
                     ("allow_tf32", bool), ("fast_accumulation", bool))
MATMUL = Target("jax_epilog_matmul", "JaxEpilogMatmul", MATMUL_ATTRIBUTES)
#: A call with a C matrix (SPEC §6): the same handler, c, alpha and beta as its last operands.
MATMUL_C = Target("jax_epilog_matmul_c", "JaxEpilogMatmulC", MATMUL_ATTRIBUTES)
#: A block-scaled FP8 call (docs/fp8.md, "Block scaling"): its scales are arrays of tiles; the
#: extra attributes are the rows of a's and b's tiles (1: 1x128 tiles, 128: 128x128 blocks).
MATMUL_BLOCK = Target("jax_epilog_matmul_block", "JaxEpilogMatmulBlock",
                      MATMUL_ATTRIBUTES + (("a_block_rows", np.int32), ("b_block_rows", np.int32)))
#: The fused FP8 passes (`float8.fused`, `layers.fused_swiglu`; ffi/fused_passes.cc): no
#: attributes, the FP8 format read off the results' dtypes.
CAST_TRANSPOSE = Target("jax_epilog_cast_transpose", "JaxEpilogCastTranspose", ())
SWIGLU_AMAXES = Target("jax_epilog_swiglu_amaxes", "JaxEpilogSwigluAmaxes", ())
SWIGLU_QUANTIZE = Target("jax_epilog_swiglu_quantize", "JaxEpilogSwigluQuantize", ())
SWIGLU_GRAD_AMAX = Target("jax_epilog_swiglu_grad_amax", "JaxEpilogSwigluGradAmax", ())
SWIGLU_GRAD_QUANTIZE = Target("jax_epilog_swiglu_grad_quantize", "JaxEpilogSwigluGradQuantize",
                              ())
FUSED_TARGETS = (CAST_TRANSPOSE, SWIGLU_AMAXES, SWIGLU_QUANTIZE, SWIGLU_GRAD_AMAX,
                 SWIGLU_GRAD_QUANTIZE)
#: The matmul targets (ffi/epilog_matmul.cc).
TARGETS = (MATMUL, MATMUL_C, MATMUL_BLOCK)

#: Pass as `jax.export.export(..., disabled_checks=EXPORT_SAFETY_CHECKS)` when exporting for
#: CUDA: the exported module calls our custom calls, which JAX does not know to be stable.
EXPORT_SAFETY_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(t.name)
                             for t in TARGETS + FUSED_TARGETS)


def register(handle, table=TARGETS) -> None:
    """Registers the two stages of every target of `table` from the loaded library `handle`
    (a ctypes CDLL) for CUDA. Before JAX's CUDA backend starts, JAX keeps the registration
    until it does."""
    for target in table:
        stages = {"execute": jax.ffi.pycapsule(getattr(handle, target.symbol)),
                  "initialize": jax.ffi.pycapsule(getattr(handle, target.symbol + "Initialize"))}
        jax.ffi.register_ffi_target(target.name, stages, platform="CUDA")


def attributes(target: Target, **values) -> dict:
    """The attributes of one call of `target`, exactly those it decodes, with their types."""
    if set(values) != {name for name, _ in target.attributes}:
        raise ValueError(f"{target.name} decodes {[n for n, _ in target.attributes]}, "
                         f"got {sorted(values)}")
    return {name: kind(values[name]) for name, kind in target.attributes}
