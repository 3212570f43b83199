"""Fused FP8 passes around the GEMMs: the library's CUDA kernels (`ffi/fused_kernels.cu`) for
work that XLA otherwise spreads over several fusions, each pass with its plain-JAX formulation
as the reference, which runs off CUDA and wherever the engine is XLA's (docs/fp8.md, "Fused
passes").

This module: which engine runs the passes (`uses_cuda`, from JAX_EPILOG_FUSED_PASSES), the
custom call shared by every pass (`custom_call`), and the cast-transpose pass
(`cast_transpose`, and `quantize_transpose`, the layers' per-tensor quantization of a tensor
with its transposed copy). SwiGLU's passes are `layers.fused_swiglu`.

The kernels compute what the reference computes, operation for operation: `x·q` in float32,
clipped to the format's largest finite value (NaN kept), one round-to-nearest-even conversion
(`op.reference.saturating_cast`); the transposed copy holds the same bytes. Only 2-D bfloat16
and float16 inputs run the kernel; other dtypes (float32 compute) and empty arrays run the
reference. The kernels are custom calls that XLA's partitioner does not split: under `jit`
with arrays sharded over several devices they would run replicated, so `auto` picks them
only in a process with one device (inside `shard_map`, `cuda` runs them per device).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.recipe import check_margin, fp8_format
from jax_epilog.float8.scaling import (calibrates, delayed_scale_amax, multiplier, reduce_amax,
                                       reduced_amaxes)
from jax_epilog.op.amaxes import amax
from jax_epilog.op.reference import saturating_cast
from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime import settings, targets

#: The input dtypes the kernels take.
INPUT_DTYPES = ("bfloat16", "float16")


def unavailable_reason() -> Optional[str]:
    """Why the fused kernels cannot run in this process, or None where they can."""
    if jax.default_backend() != "gpu":
        return f"the default JAX backend is {jax.default_backend()}, not a CUDA GPU"
    if not cuda_library.available():
        return cuda_library.unavailable_reason()
    if not cuda_library.fused_kernels_built():
        return ("libjax_epilog_ffi.so was built without nvcc, so it has no fused kernels "
                "(reinstall with a CUDA toolkit's nvcc, or NVIDIA's wheels nvidia-cuda-nvcc and "
                "nvidia-nvvm, in the build environment)")
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        old = capability is not None and float(capability) < 9.0
    except ValueError:
        old = False
    if old:
        return f"the GPU's compute capability is {capability}; the kernels need 9.0 or newer"
    return None


def uses_cuda() -> bool:
    """Whether the passes traced now run the CUDA kernels: JAX_EPILOG_FUSED_PASSES `cuda` (a
    `RuntimeError` where they cannot run), `auto` (where they can, in a one-device process) or
    `xla` (never)."""
    choice = settings.fused_passes()
    if choice == "xla":
        return False
    reason = unavailable_reason()
    if choice == "cuda":
        if reason is not None:
            raise RuntimeError(f"JAX_EPILOG_FUSED_PASSES=cuda: the fused kernels cannot run: "
                               f"{reason}; set it to xla or auto")
        return True
    return reason is None and jax.device_count() == 1


def runs_kernel(*arrays) -> bool:
    """Whether a pass over `arrays` (its 16-bit inputs) runs the kernel: the engine is CUDA's,
    every array is bfloat16 or float16 and none is empty."""
    return all(jnp.dtype(a.dtype).name in INPUT_DTYPES and a.size for a in arrays) and \
        uses_cuda()


def custom_call(target: targets.Target, results, operands, reference):
    """The tuple of the kernel `target`'s `results` (`jax.ShapeDtypeStruct`s) on CUDA, of
    `reference(*operands)` on any other platform the call is lowered for."""
    def cuda(*args):
        return tuple(jax.ffi.ffi_call(target.name, list(results))(*args))

    return tuple(jax.lax.platform_dependent(*operands, cuda=cuda,
                                            default=lambda *a: tuple(reference(*a))))


def check_matrix(name: str, x, dtypes=None):
    """`x` as an array, or a `ValueError`/`TypeError` naming `name`: 2-D floating point (of
    `dtypes` where given)."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or \
            (dtypes is not None and jnp.dtype(x.dtype).name not in dtypes):
        wanted = " or ".join(dtypes) if dtypes else "a floating-point dtype"
        raise TypeError(f"{name}: expected {wanted}, got {jnp.dtype(x.dtype).name}")
    if jnp.ndim(x) != 2:
        raise ValueError(f"{name}: expected a 2-D array (rows, columns), got shape "
                         f"{jnp.shape(x)}")
    return x


def check_scalar(name: str, value, size: int = 0):
    """`value` as float32, or a `ValueError` naming `name`: a scalar (size 0) or a vector of
    `size` floats."""
    value = jnp.asarray(value)
    want = () if size == 0 else (size,)
    if value.shape != want or not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a float32 array of shape {want}, got "
                         f"{value.dtype} {value.shape}")
    return value.astype(jnp.float32)


# --- cast-transpose ---------------------------------------------------------------------------

def cast_transpose_reference(x, q, dtype):
    """`cast_transpose` in plain JAX (what XLA fuses): the layers' cast, its transpose, the
    amax."""
    y = saturating_cast(x.astype(jnp.float32) * q, dtype)
    return y, y.T, amax(x)


def cast_transpose(x, q, dtype="float8_e4m3fn"):
    """`(y, yt, amax)`: y = `x·q` rounded and saturated to the FP8 `dtype` (the layers'
    quantization, `scaling.quantize`, with the multiplier `q` given), `yt = yᵀ`, and
    `amax = max |x|` (float32), reading x once on CUDA.

    Args:
      x: `(rows, cols)`, bfloat16 or float16 for the kernel (float32 runs the reference).
      q: the float32 quantization multiplier, a scalar (`scaling.multiplier`).
      dtype: `float8_e4m3fn` or `float8_e5m2`.
    """
    check_matrix("x", x)
    dtype = fp8_format("dtype", dtype)
    q = check_scalar("q", q)
    if not runs_kernel(x):
        return cast_transpose_reference(x, q, dtype)
    rows, cols = x.shape
    results = (jax.ShapeDtypeStruct((rows, cols), dtype), jax.ShapeDtypeStruct((cols, rows), dtype),
               jax.ShapeDtypeStruct((), jnp.float32))
    return custom_call(targets.CAST_TRANSPOSE, results, (x, q),
                       lambda x, q: cast_transpose_reference(x, q, dtype))


def quantize_transpose(x, dtype, margin: int = 0, history=None, amax_axes=None, x_amax=None):
    """`(x8, x8ᵀ, scale, amax)`: `scaling.quantize_scaled(x, ...)` (current scaling, or delayed
    from `history`, its arguments the same) and the transposed copy that a weight gradient
    reads, both written by one pass over x (`cast_transpose`). Where the scale needs x's own
    amax (current scaling, or a history that calibrates), that amax is one XLA reduction
    first, unless `x_amax` gives it; otherwise the kernel's amax is the one recorded."""
    check_matrix("x", x)
    dtype = fp8_format("dtype", dtype)
    check_margin(margin)
    if x_amax is None and (history is None or calibrates()):
        x_amax = reduced_amaxes([x], amax_axes)[0]
    scale_amax = x_amax if history is None else delayed_scale_amax(history, x_amax)
    q = multiplier(scale_amax, dtype, margin)
    x8, x8t, own = cast_transpose(x, q, dtype)
    if x_amax is None:
        x_amax = reduce_amax(own, amax_axes)
    return x8, x8t, 1.0 / q, x_amax
