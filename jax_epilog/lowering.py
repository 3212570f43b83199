"""How the inner primitive `kernel_p` runs: the cuBLASLt custom call on CUDA, the reference
elsewhere. Every choice between the two is made here, at lowering time, in `_way`:

- not CUDA: the reference, exact (identical semantics on every platform);
- CUDA, an empty problem: the reference (nothing for a GEMM to do);
- CUDA, the library not loadable in a process that has CUDA devices: the reference, with a
  warning;
- CUDA, `backend="xla"` (asked for, set by JAX_EPILOG_BACKEND, or chosen by `dispatch` as the
  faster way for this problem on this GPU): the reference in XLA's way (`exact=False`), so XLA
  runs its own GEMM and fusions;
- CUDA, operands in a layout cuBLASLt has no kernel for, where it has one for another layout
  (`_kernel_layout`): the operand(s) transposed in XLA (a transpose XLA fuses into the
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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from . import config, cuda_library, padding, reference
from .epilogs import Epilog, is_fp8
from .call import Params, kernel_p, problem_of, result_dtype_of


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


@functools.cache
def _has_cuda_devices() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _backend(params: Params, avals_in) -> str:
    """'cublaslt' or 'xla': the call's own choice, else the environment's, else dispatch's."""
    if params.backend != "auto":
        return params.backend
    forced = config.backend_override()
    if forced or not _has_cuda_devices():  # exporting from a host without a GPU: the kernel
        return forced or "cublaslt"
    from . import dispatch  # measured tables; loaded on the first CUDA lowering
    a = avals_in[0]
    p = problem_of(a.shape, avals_in[1].shape, params.transpose_a, params.transpose_b)
    return dispatch.choose(Epilog(params.epilog), np.dtype(a.dtype), p.batch, p.m, p.n, p.k,
                           params.transpose_a, params.transpose_b)


def _kernel_supports(avals_in, params: Params) -> tuple[bool, str]:
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


Layout = tuple[bool, bool]  # (transpose_a, transpose_b)
K_MAJOR: Layout = (False, True)  # a (M, K), b (N, K): the only layout of cuBLASLt's FP8 kernels


def _transposed(aval, flip: bool):
    """`aval` (a rank-3 operand) with its last two axes swapped when `flip`."""
    return aval.update(shape=(*aval.shape[:-2], aval.shape[-1], aval.shape[-2])) if flip else aval


def _kernel_layout(avals_in, params: Params) -> Optional[Layout]:
    """For a call in a layout cuBLASLt has no kernel for: the other layout it has one for with
    the fewest bytes to transpose, or None. On the H200 (cuBLASLt 13.1) BGRADA runs only with a
    stored (K, M) and BGRADB only with b stored (K, N): the summed operand with K by rows."""
    own = (params.transpose_a, params.transpose_b)
    a, b = avals_in[0], avals_in[1]
    cost = {(ta, tb): (ta != own[0]) * a.size * a.dtype.itemsize +
            (tb != own[1]) * b.size * b.dtype.itemsize
            for ta in (False, True) for tb in (False, True) if (ta, tb) != own}
    for ta, tb in sorted(cost, key=cost.get):
        avals = [_transposed(a, ta != own[0]), _transposed(b, tb != own[1]), *avals_in[2:]]
        if _kernel_supports(avals, params._replace(transpose_a=ta, transpose_b=tb))[0]:
            return ta, tb
    return None


def _way(avals_in, params: Params) -> tuple[str, Optional[Layout]]:
    """'reference', 'xla', 'relayout', 'padded' or 'kernel' (see the module docstring), and
    for 'relayout' the layout the kernel runs in."""
    if any(0 in x.shape for x in avals_in[:2]):
        return "reference", None
    if not cuda_library.available() and _has_cuda_devices():
        _warn_unavailable(cuda_library.unavailable_reason())
        return "reference", None
    if _backend(params, avals_in) == "xla":
        return "xla", None
    fp8 = is_fp8(avals_in[0].dtype)
    if fp8 and (params.transpose_a, params.transpose_b) != K_MAJOR:
        return "relayout", K_MAJOR
    if padding.needed(avals_in, params.transpose_a, params.transpose_b):
        return "padded", None
    if cuda_library.available():
        supported, why = _kernel_supports(avals_in, params)
        if not supported:
            layout = None if fp8 else _kernel_layout(avals_in, params)
            if layout is not None:
                return "relayout", layout
            if fp8:
                _warn_fp8_reference(avals_in, params, why)
            return "reference", None
    return "kernel", None


def _relaid_out(params: Params, layout: Layout):
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
    way, layout = _way(ctx.avals_in, params)
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

