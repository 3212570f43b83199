"""The inner primitive `kernel_p`, one device's call, and every rule of it (registered at the
end): its abstract evaluation is the outer primitive's (`primitive.abstract_eval`), its
lowerings the cuBLASLt custom call on CUDA and the reference elsewhere. It appears only inside
the outer primitive's lowering (`primitive.py`), once per device. On CUDA one plan decides,
at lowering time (`planning.call_plan.plan_call`, asked through `planner`), and `lower_cuda`
carries it out in one function, binding nothing of ours again:

- not CUDA: the reference, exact (identical semantics on every platform);
- CUDA, an empty problem, or the library not loadable in a process that has CUDA devices (with
  a warning): the reference;
- CUDA, `backend="xla"` (asked for, set by JAX_EPILOG_BACKEND, or chosen by the decision
  tables as the faster way for this problem on this GPU): the reference in XLA's way
  (`exact=False`), so XLA runs its own GEMM and fusions;
- CUDA, a problem cuBLASLt has no kernel for in any layout (it says so when asked): the
  reference, exact (for FP8 operands with a `RuntimeWarning`: SPEC §5), its per-tensor or
  row-scaled FP8 product by XLA's FP8 dot to float32 (`fp8_dot`: exact products summed in
  float32 as cuBLASLt sums them, where widened operands made it a float32 GEMM, many times
  slower than XLA's bf16 one: `reference.epilog_matmul` says more);
- otherwise the XLA FFI custom call (`runtime.targets`: `jax_epilog_matmul`, or
  `jax_epilog_matmul_c` for a call with a C matrix, SPEC §6), on XLA's stream, with
  cuBLASLt's workspace as an extra result buffer that XLA allocates (so the handler never
  allocates and is safe inside command buffers). Before it, as the plan says, the operands
  are transposed in XLA to the layout the kernel has (FP8 kernels take only a (M, K) and
  b (N, K); cuBLASLt 13.1 runs BGRADA/BGRADB only with the summed operand stored K by rows),
  a transpose
  XLA fuses into the operand's producer where it can, and K and N are zero-padded to 16 bytes
  (`padding.py`), the padded results cut back. Lowering for CUDA on a host without a CUDA
  device (`jax.export` from a CPU host) emits the custom call.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_epilog.op import block_scales, padding, planner, reference
from jax_epilog.op.primitive import abstract_eval
from jax_epilog.op.call import Params, kernel_p, problem_of, result_dtype_of
from jax_epilog.op.epilogs import Epilog, is_fp8
from jax_epilog.runtime import context as runtime_context
from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime import settings, targets


def lower_reference(ctx, *args, exact: bool = True, fp8_dot: bool = False, **params):
    # `fast_accumulation`: XLA's FP8 dot runs it (DEFAULT precision; HIGHEST otherwise) in
    # XLA's way and with `fp8_dot` (`reference.epilog_matmul`'s); the reference on widened
    # operands computes the float32 formula whatever the call asks.
    params = Params(**params)
    fn = functools.partial(reference.epilog_matmul, epilog=params.epilog,
                           transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                           allow_tf32=params.allow_tf32, exact=exact,
                           fast_accumulation=params.fast_accumulation,
                           result_dtype=params.result_dtype, result_amax=params.result_amax,
                           has_c=params.has_c, block_scaling=params.block_scaling,
                           fp8_dot=fp8_dot)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _sizes(avals_in, params: Params) -> str:
    a = avals_in[0]
    p = problem_of(a.shape, avals_in[1].shape, params.transpose_a, params.transpose_b)
    return f"batch={p.batch}, M={p.m}, N={p.n}, K={p.k}"


def _warn_fp8_reference(avals_in, params: Params, why: str) -> None:
    a = avals_in[0]
    warnings.warn(
        f"jax_epilog: cuBLASLt runs no FP8 kernel for epilog {params.epilog.name} with "
        f"{a.dtype} x {avals_in[1].dtype} -> {result_dtype_of(params, a.dtype)}"
        f"{' and result_amax' if params.result_amax else ''}"
        f"{' with fast_accumulation' if params.fast_accumulation else ''}"
        f" ({_sizes(avals_in, params)}): "
        f"{why}; this call runs the plain-XLA reference instead (the same results, slower "
        "than a fused kernel)",
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
    bias_batch = avals_in[2].shape[0] if params.epilog.has_bias else 1
    extra = {}
    if is_fp8(a.dtype):
        if not cuda_library.supports_fp8():
            return False, "this build of the jax_epilog library has no FP8 support"
        extra = dict(b_dtype=np.dtype(b.dtype).name,
                     result_dtype=result_dtype_of(params, a.dtype).name,
                     result_amax=bool(params.result_amax),
                     fast_accumulation=bool(params.fast_accumulation),
                     **({"block_rows": _block_rows(params)} if params.block_scaling else {}))
    m = block_scales.kernel_rows(params.block_scaling, p.m) if params.block_scaling else p.m
    supported, message = cuda_library.query_support(
        params.epilog, np.dtype(a.dtype).name, params.transpose_a, params.transpose_b, p.batch,
        b.shape[0], bias_batch, m, p.n, p.k, params.allow_tf32, settings.workspace_bytes(),
        has_c=bool(params.has_c), **extra)
    return supported is not False, message


def _block_rows(params: Params) -> tuple[int, int]:
    """The rows of a's and b's scale tiles (1 or 128), (0, 0) for per-tensor scales."""
    if not params.block_scaling:
        return (0, 0)
    return tuple(block_scales.block_rows(block) for block in params.block_scaling)


def _custom_call(params: Params):
    """The custom call itself, on operands in `params`' layout and aligned."""
    target = (targets.MATMUL_C if params.has_c else
              targets.MATMUL_BLOCK if params.block_scaling else targets.MATMUL)
    workspace = jax.ShapeDtypeStruct((settings.workspace_bytes(),), np.uint8)
    extra = dict(zip(("a_block_rows", "b_block_rows"), _block_rows(params))
                 ) if params.block_scaling else {}
    attributes = targets.attributes(
        target, epilog=params.epilog, transpose_a=params.transpose_a,
        transpose_b=params.transpose_b, allow_tf32=params.allow_tf32,
        fast_accumulation=params.fast_accumulation, **extra)

    def call(*operands):
        rows = None
        if params.block_scaling and params.block_scaling[0] == "1x128":
            operands, rows = _pad_tile_rows(params, list(operands))
        avals, _ = kernel_p.abstract_eval(*map(jax.typeof, operands), **params._asdict())
        shapes = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in avals] + [workspace]
        if params.block_scaling:  # the scales in cuBLASLt's padded layout
            first = 2 + len(params.epilog.input_names)
            operands = list(operands)
            for i, block in zip((first, first + 1), params.block_scaling):
                operands[i] = block_scales.kernel_values(operands[i], block)
        y, *rest = jax.ffi.ffi_call(target.name, shapes)(*operands, **attributes)[:-1]
        return [y if rows is None else y[:, :rows], *rest]

    return call


def _pad_tile_rows(params: Params, operands: list):
    """(operands, M) with a's rows (M) zero-padded to `block_scales.kernel_rows` and its 1x128
    scales padded with ones, or (operands, None) where M is a multiple already: cuBLASLt 13.1
    has no kernel for 1x128 scales on a whose M is not (it said so for M = 129, ran M = 256)."""
    a = operands[0]
    m_axis = 2 if params.transpose_a else 1
    m = a.shape[m_axis]
    padded = block_scales.kernel_rows(params.block_scaling, m)
    if padded == m:
        return operands, None
    widths = [(0, 0)] * a.ndim
    widths[m_axis] = (0, padded - m)
    operands[0] = jnp.pad(a, widths)
    i = 2 + len(params.epilog.input_names)  # scale_a: (K / 128, M)
    operands[i] = jnp.pad(operands[i], ((0, 0), (0, padded - m)), constant_values=1.0)
    return operands, m


def around_kernel(kernel, params: Params, layout, padded):
    """`kernel` (a call in `layout`, aligned) on the call's own operands: a and b transposed
    to `layout` where it differs, K and N zero-padded to `padded` (K, N) if given, the
    results cut back to the call's."""
    if layout == (params.transpose_a, params.transpose_b) and padded is None:
        return kernel
    inner = params._replace(transpose_a=layout[0], transpose_b=layout[1])

    def call(a, b, *rest):
        a = jnp.swapaxes(a, 1, 2) if layout[0] != params.transpose_a else a
        b = jnp.swapaxes(b, 1, 2) if layout[1] != params.transpose_b else b
        return (kernel if padded is None else padding.padded(kernel, inner, padded))(a, b, *rest)

    return call


def lower_cuda(ctx, *args, **params):
    params = Params(**params)
    # JAX calls a lowering with the call's avals alone: the per-trace context is read here.
    plan = planner.current().plan_call(runtime_context.current(), ctx.avals_in, params,
                                       kernel_supports)
    if plan.warning == "unavailable":
        _warn_unavailable(cuda_library.unavailable_reason())
    elif plan.warning == "fp8-reference":
        _warn_fp8_reference(ctx.avals_in, params, plan.why)
    if plan.way in ("reference", "xla"):
        return lower_reference(ctx, *args, exact=plan.way == "reference", fp8_dot=True,
                               **params._asdict())
    inner = params._replace(transpose_a=plan.layout[0], transpose_b=plan.layout[1])
    fn = around_kernel(_custom_call(inner), params, plan.layout, plan.padded)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


# --- registration: every rule of the inner primitive ----------------------------------------

kernel_p.multiple_results = True
kernel_p.def_abstract_eval(abstract_eval)
mlir.register_lowering(kernel_p, lower_reference)
mlir.register_lowering(kernel_p, lower_cuda, platform="cuda")
