"""How the inner primitive `kernel_p` runs: the cuBLASLt custom call on CUDA, the reference
elsewhere. Every choice between the two is made here, at lowering time, in `_way`:

- not CUDA: the reference, exact (identical semantics on every platform);
- CUDA, an empty problem: the reference (nothing for a GEMM to do);
- CUDA, the library not loadable in a process that has CUDA devices: the reference, with a
  warning;
- CUDA, `backend="xla"` (asked for, set by JAX_EPILOG_BACKEND, or chosen by `dispatch` as the
  faster way for this problem on this GPU): the reference in XLA's way (`exact=False`), so XLA
  runs its own GEMM and fusions;
- CUDA, a call with a C matrix (`c`, `alpha`, `beta`; SPEC §6): the reference, exact, with a
  `RuntimeWarning` (the C++ handler does not take them yet; docs/c_alpha_beta.md);
- CUDA, FP8 operands not both K-major (cuBLASLt's FP8 kernels take only a `(M, K)` and b
  `(N, K)`, i.e. transpose_a=False, transpose_b=True): the operand(s) transposed in XLA (a
  transpose XLA fuses into the operand's producer, typically the quantizing convert), then the
  kernel on the K-major problem;
- CUDA, K or N not a multiple of 16 bytes: zero-padded (`padding.py`), then the kernel;
- CUDA, a problem cuBLASLt has no kernel for (it says so when asked): the reference, exact
  (for FP8 operands with a `RuntimeWarning`: SPEC §5);
- otherwise the XLA FFI custom call `jax_epilog_matmul` (`ffi/README.md`) on XLA's stream, with
  cuBLASLt's workspace as an extra result buffer that XLA allocates (so the handler never
  allocates and is safe inside command buffers). Lowering for CUDA on a host without a CUDA
  device (`jax.export` from a CPU host) emits the custom call.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from . import config, cuda_library, padding, reference
from .epilogs import Epilog, is_fp8
from .primitive import Params, kernel_p, problem_of, result_dtype_of


def _lower_reference(ctx, *args, exact: bool = True, **params):
    params = Params(**params)
    fn = functools.partial(reference.epilog_matmul, epilog=params.epilog,
                           transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                           allow_tf32=params.allow_tf32, exact=exact,
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
        f"{' and result_amax' if params.result_amax else ''} ({_sizes(avals_in, params)}): "
        f"{why}; this call runs the plain-XLA reference instead (same results, slower)",
        RuntimeWarning, stacklevel=2)


def _warn_c_reference(avals_in, params: Params) -> None:
    warnings.warn(
        f"jax_epilog: the cuBLASLt kernel path for a call with c, alpha and beta is not built "
        f"yet (epilog {Epilog(params.epilog).name}, {avals_in[0].dtype}, "
        f"{_sizes(avals_in, params)}); this call runs the exact plain-XLA reference instead "
        "(same results, slower; docs/c_alpha_beta.md)", RuntimeWarning, stacklevel=2)


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
                     result_amax=bool(params.result_amax))
    supported, message = cuda_library.query_support(
        params.epilog, np.dtype(a.dtype).name, params.transpose_a, params.transpose_b, p.batch,
        b.shape[0], bias_batch, p.m, p.n, p.k, params.allow_tf32, config.workspace_bytes(),
        **extra)
    return supported is not False, message


def _k_major(params: Params) -> bool:
    """The layout cuBLASLt's FP8 kernels take: a (M, K) and b (N, K), both K contiguous."""
    return not params.transpose_a and params.transpose_b


def _way(avals_in, params: Params) -> str:
    """'reference', 'xla', 'k_major', 'padded' or 'kernel' (see the module docstring)."""
    if any(0 in x.shape for x in avals_in[:2]):
        return "reference"
    if not cuda_library.available() and _has_cuda_devices():
        _warn_unavailable(cuda_library.unavailable_reason())
        return "reference"
    if _backend(params, avals_in) == "xla":
        return "xla"
    if params.has_c:  # SPEC §6: the C++ handler does not take c, alpha, beta yet
        _warn_c_reference(avals_in, params)
        return "reference"
    fp8 = is_fp8(avals_in[0].dtype)
    if fp8 and not _k_major(params):
        return "k_major"
    if padding.needed(avals_in, params.transpose_a, params.transpose_b):
        return "padded"
    if cuda_library.available():
        supported, why = _kernel_supports(avals_in, params)
        if not supported:
            if fp8:
                _warn_fp8_reference(avals_in, params, why)
            return "reference"
    return "kernel"


def _as_k_major(params: Params):
    """The inner call on K-major operands: a (batch, M, K), b (batch|1, N, K)."""
    inner = params._replace(transpose_a=False, transpose_b=True, backend="cublaslt")

    def call(a, b, *rest):
        a = jnp.swapaxes(a, 1, 2) if params.transpose_a else a
        b = b if params.transpose_b else jnp.swapaxes(b, 1, 2)
        return kernel_p.bind(a, b, *rest, **inner._asdict())

    return call


def _lower_cuda(ctx, *args, **params):
    params = Params(**params)
    way = _way(ctx.avals_in, params)
    if way in ("reference", "xla"):
        return _lower_reference(ctx, *args, exact=way == "reference", **params._asdict())
    if way == "k_major":  # lowered again on K-major operands
        return mlir.lower_fun(_as_k_major(params), multiple_results=True)(ctx, *args)
    if way == "padded":  # lowered again with aligned K and N: the inner call takes the kernel
        bind = functools.partial(kernel_p.bind, **params._replace(backend="cublaslt")._asdict())
        fn = padding.padded(bind, params)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    workspace = ShapedArray((config.workspace_bytes(),), np.uint8)
    call = jax.ffi.ffi_lowering(cuda_library.TARGET_NAME)
    results = call(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args,
                   epilog=np.int32(params.epilog), transpose_a=bool(params.transpose_a),
                   transpose_b=bool(params.transpose_b), allow_tf32=bool(params.allow_tf32))
    return results[:-1]


mlir.register_lowering(kernel_p, _lower_reference)
mlir.register_lowering(kernel_p, _lower_cuda, platform="cuda")
