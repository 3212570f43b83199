"""How the inner primitive `kernel_p` runs: the cuBLASLt custom call on CUDA, the reference
elsewhere. On CUDA the way is chosen at lowering time by `plan.plan_call`, and carried out
here:

- not CUDA: the reference, exact (identical semantics on every platform);
- CUDA, an empty problem: the reference (nothing for a GEMM to do);
- CUDA, the library not loadable in a process that has CUDA devices: the reference, with a
  warning;
- CUDA, `backend="xla"` (asked for, set by JAX_EPILOG_BACKEND, or chosen by `dispatch` as the
  faster way for this problem on this GPU): the reference in XLA's way (`exact=False`), so XLA
  runs its own GEMM and fusions;
- CUDA, operands in a layout cuBLASLt has no kernel for, where it has one for another layout
  (`plan.kernel_layout`): the operand(s) transposed in XLA (a transpose XLA fuses into the
  operand's producer where it can), then the kernel in that layout. FP8 operands must be
  K-major (cuBLASLt's FP8 kernels take only a `(M, K)` and b `(N, K)`), decided before
  padding without asking; for other problems cuBLASLt is asked, e.g. on the H200 BGRADA and
  BGRADB have kernels only with the summed operand stored K by rows (a `(K, M)`, b `(K, N)`);
- CUDA, K or N not a multiple of 16 bytes: zero-padded (`padding.py`), then the kernel;
- CUDA, a problem cuBLASLt has no kernel for in any layout (it says so when asked): the
  reference, exact (for FP8 operands with a `RuntimeWarning`: SPEC §5);
- otherwise the XLA FFI custom call `jax_epilog_matmul` (`ffi/README.md`), or for a call with a
  C matrix (`c`, `alpha`, `beta`: SPEC §6, docs/c_alpha_beta.md) `jax_epilog_matmul_c`, on
  XLA's stream, with cuBLASLt's workspace as an extra result buffer that XLA allocates (so the
  handler never allocates and is safe inside command buffers). Lowering for CUDA on a host
  without a CUDA device (`jax.export` from a CPU host) emits the custom call.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from . import config, cuda_library, padding, plan, reference
from .call import Params, kernel_p, problem_of, result_dtype_of
from .epilogs import Epilog, is_fp8


def lower_reference(ctx, *args, exact: bool = True, **params):
    # `fast_accumulation`: the exact reference computes the float32 formula whatever the call
    # asks; XLA's way (not `exact`) asks XLA's FP8 dot for it (DEFAULT precision, which XLA
    # runs with fast accumulation; HIGHEST otherwise).
    params = Params(**params)
    fn = functools.partial(reference.epilog_matmul, epilog=params.epilog,
                           transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                           allow_tf32=params.allow_tf32, exact=exact,
                           fast_accumulation=params.fast_accumulation,
                           result_dtype=params.result_dtype, result_amax=params.result_amax,
                           has_c=params.has_c)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _sizes(avals_in, params: Params) -> str:
    a = avals_in[0]
    p = problem_of(a.shape, avals_in[1].shape, params.transpose_a, params.transpose_b)
    return f"batch={p.batch}, M={p.m}, N={p.n}, K={p.k}"


def _warn_fp8_reference(avals_in, params: Params, why: str) -> None:
    a = avals_in[0]
    warnings.warn(
        f"jax_epilog: cuBLASLt runs no FP8 kernel for epilog {Epilog(params.epilog).name} with "
        f"{a.dtype} x {avals_in[1].dtype} -> {result_dtype_of(params, a.dtype)}"
        f"{' and result_amax' if params.result_amax else ''}"
        f"{' with fast_accumulation' if params.fast_accumulation else ''}"
        f" ({_sizes(avals_in, params)}): "
        f"{why}; this call runs the plain-XLA reference instead (same results, slower)",
        RuntimeWarning, stacklevel=2)


@functools.cache
def _warn_unavailable(reason: str) -> None:
    warnings.warn(f"jax_epilog: the cuBLASLt library is unavailable ({reason}); CUDA calls run "
                  "the plain-XLA reference instead.", RuntimeWarning, stacklevel=3)


def kernel_supports(avals_in, params: Params) -> tuple[bool, str]:
    """Whether cuBLASLt has a kernel for these operands, and if not why (None from the library:
    cannot ask here, e.g. no GPU on this host; trust the kernel)."""
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b)
    bias_batch = avals_in[2].shape[0] if Epilog(params.epilog).has_bias else 1
    extra = {}
    if is_fp8(a.dtype):
        if not cuda_library.supports_fp8():
            return False, "this build of the jax_epilog library has no FP8 support"
        extra = dict(b_dtype=np.dtype(b.dtype).name,
                     result_dtype=result_dtype_of(params, a.dtype).name,
                     result_amax=bool(params.result_amax),
                     fast_accumulation=bool(params.fast_accumulation))
    supported, message = cuda_library.query_support(
        params.epilog, np.dtype(a.dtype).name, params.transpose_a, params.transpose_b, p.batch,
        b.shape[0], bias_batch, p.m, p.n, p.k, params.allow_tf32, config.workspace_bytes(),
        has_c=bool(params.has_c), **extra)
    return supported is not False, message


def _relaid_out(params: Params, layout: plan.Layout):
    """The inner call on operands transposed in XLA to `layout`; the results do not depend on
    the operands' layout."""
    transpose_a, transpose_b = layout
    inner = params._replace(transpose_a=transpose_a, transpose_b=transpose_b, backend="cublaslt")

    def call(a, b, *rest):
        a = jnp.swapaxes(a, 1, 2) if transpose_a != params.transpose_a else a
        b = jnp.swapaxes(b, 1, 2) if transpose_b != params.transpose_b else b
        return kernel_p.bind(a, b, *rest, **inner._asdict())

    return call


def lower_cuda(ctx, *args, **params):
    params = Params(**params)
    call_plan = plan.plan_call(plan.context(), ctx.avals_in, params, kernel_supports)
    if call_plan.warning == "unavailable":
        _warn_unavailable(cuda_library.unavailable_reason())
    elif call_plan.warning == "fp8-reference":
        _warn_fp8_reference(ctx.avals_in, params, call_plan.why)
    way, layout = call_plan.way, call_plan.layout
    if way in ("reference", "xla"):
        return lower_reference(ctx, *args, exact=way == "reference", **params._asdict())
    if way == "relayout":  # lowered again on the transposed operands
        return mlir.lower_fun(_relaid_out(params, layout), multiple_results=True)(ctx, *args)
    if way == "padded":  # lowered again with aligned K and N: the inner call takes the kernel
        bind = functools.partial(kernel_p.bind, **params._replace(backend="cublaslt")._asdict())
        fn = padding.padded(bind, params)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    workspace = ShapedArray((config.workspace_bytes(),), np.uint8)
    call = jax.ffi.ffi_lowering(cuda_library.TARGET_NAME_C if params.has_c
                                else cuda_library.TARGET_NAME)
    results = call(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args,
                   epilog=np.int32(params.epilog), transpose_a=bool(params.transpose_a),
                   transpose_b=bool(params.transpose_b), allow_tf32=bool(params.allow_tf32),
                   fast_accumulation=bool(params.fast_accumulation))
    return results[:-1]

