"""How `epilog_matmul_p` runs: a cuBLASLt custom call on CUDA, the reference elsewhere.

- Every platform: `reference.epilog_matmul` lowered as plain JAX (identical semantics).
- CUDA: the XLA FFI custom call `jax_epilog_matmul` (see `ffi/README.md`), running on XLA's
  stream, with cuBLASLt's workspace as an extra result buffer that XLA allocates (so the
  handler never allocates and is safe inside command buffers). Problems cuBLASLt has no kernel
  for (it says so when asked at lowering time) and processes with CUDA devices where the
  library could not be loaded get the reference lowering instead, with a warning in the
  second case. Lowering for CUDA without a CUDA device (`jax.export` from a CPU host) emits
  the custom call. An unaligned K or N is zero-padded first (`padding.py`).

A module exported with `jax.export` for CUDA contains the custom call, so it must be exported
with `disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jax_epilog_matmul")]`
(see `jax_epilog.EXPORT_SAFETY_CHECKS`).
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from . import cuda_library, padding, reference
from .epilogs import Epilog
from .primitive import epilog_matmul_p, problem_of

# cuBLASLt's recommended workspace on Hopper; XLA reuses the buffer between calls.
WORKSPACE_BYTES = int(os.environ.get("JAX_EPILOG_WORKSPACE_BYTES", 32 * 1024 * 1024))


def _lower_reference(ctx, *args, epilog, transpose_a, transpose_b, allow_tf32):
    fn = functools.partial(reference.epilog_matmul, epilog=epilog, transpose_a=transpose_a,
                           transpose_b=transpose_b, allow_tf32=allow_tf32)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


@functools.cache
def _warn_unavailable(reason: str) -> None:
    warnings.warn(f"jax_epilog: the cuBLASLt library is unavailable ({reason}); CUDA calls run "
                  "the plain-XLA reference instead.", RuntimeWarning, stacklevel=3)


def cuda_kernel_supports(avals_in, epilog: int, transpose_a: bool, transpose_b: bool,
                         allow_tf32: bool) -> bool:
    """Whether the lowering may emit the custom call for these operands."""
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    bias_batch = avals_in[2].shape[0] if Epilog(epilog).has_bias else 1
    supported, _ = cuda_library.query_support(
        int(epilog), np.dtype(a.dtype).name, bool(transpose_a), bool(transpose_b), p.batch,
        b.shape[0], bias_batch, p.m, p.n, p.k, bool(allow_tf32), WORKSPACE_BYTES)
    # None: cannot ask here (no GPU on this host, e.g. exporting); trust the kernel.
    return supported is not False


def _has_cuda_devices() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _lower_cuda(ctx, *args, epilog, transpose_a, transpose_b, allow_tf32):
    params = dict(epilog=epilog, transpose_a=transpose_a, transpose_b=transpose_b,
                  allow_tf32=allow_tf32)
    if not cuda_library.available() and _has_cuda_devices():
        # This process will run the module but cannot run the kernel: stay correct, say so.
        _warn_unavailable(cuda_library.unavailable_reason())
        return _lower_reference(ctx, *args, **params)
    if padding.needed(ctx.avals_in, transpose_a, transpose_b):
        # Lowered again with aligned K and N: the inner call takes the path below.
        bind = functools.partial(epilog_matmul_p.bind, **params)
        fn = padding.padded(bind, epilog, transpose_a, transpose_b)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    # Without a CUDA device here we are exporting for one: emit the kernel regardless.
    if cuda_library.available() and not cuda_kernel_supports(ctx.avals_in, **params):
        return _lower_reference(ctx, *args, **params)
    workspace = ShapedArray((WORKSPACE_BYTES,), np.uint8)
    call = jax.ffi.ffi_lowering(cuda_library.TARGET_NAME)
    results = call(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args,
                   epilog=np.int32(epilog), transpose_a=bool(transpose_a),
                   transpose_b=bool(transpose_b), allow_tf32=bool(allow_tf32))
    return results[:-1]


mlir.register_lowering(epilog_matmul_p, _lower_reference)
mlir.register_lowering(epilog_matmul_p, _lower_cuda, platform="cuda")
