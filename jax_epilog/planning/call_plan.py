"""The plan of one call: when `matmul` is differentiated, whether its training step runs the
plain expression under JAX's autodiff (`plan_matmul_step`), and when one call is lowered for
CUDA, how (`plan_call`): the cuBLASLt kernel, in which operand layout and with which padding,
XLA's own GEMM, or the reference. The lowering carries the plan out in one go; nothing is
planned twice.
`PLANNER` is what the op asks (`op.planner`), with the per-trace context the op passes.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from jax_epilog.op import padding
from jax_epilog.op.call import Params, problem_of
from jax_epilog.op.epilogs import Epilog, is_fp8
from jax_epilog.op.planner import CallPlan, Layout
from jax_epilog.planning import context
from jax_epilog.planning.context import Choice, Context, Gemm, gemm_backend, on_cuda


def matmul_step_gemms(params: Params, a_shape, b_shape, dtype,
                      forward_epilog: Epilog) -> tuple[Gemm, ...]:
    """The GEMMs of a differentiated `matmul` call's training step, as `matmul._forward_bwd`
    issues them: its forward (`forward_epilog`: with the residual its backward needs), the
    data gradient dA in a's layout and the weight gradient dB in b's (with the bias gradient,
    BGRADB, or BGRADA for a transposed b, where the call has a bias). `a_shape` and `b_shape`
    are the call's rank-3 operands."""
    ta, tb = params.transpose_a, params.transpose_b
    batch, m, n, k = problem_of(a_shape, b_shape, ta, tb)
    dtype, requested = np.dtype(dtype).name, params.backend
    has_bias = params.epilog.has_bias
    shared_b = b_shape[0] == 1
    if shared_b and not (ta and batch == 1):  # dA = dZ op(b)ᵀ, every row in one GEMM (then
        data = (1, batch * m, k, n, False, not tb)  # transposed for a batched aᵀ)
    elif not ta:
        data = (batch, m, k, n, False, not tb)
    else:  # dAᵀ = op(b) dZᵀ, written in a's layout
        data = (batch, k, m, n, tb, True)
    if shared_b:  # one GEMM over every row (a batched aᵀ transposed by XLA first)
        rows, batches, transpose_h = batch * m, 1, ta and batch == 1
    else:
        rows, batches, transpose_h = m, batch, ta
    if tb:  # dBᵀ = dZᵀ op(h): the summed operand is A
        weight = (Epilog.BGRADA if has_bias else Epilog.DEFAULT, batches, n, k, rows, True,
                  transpose_h)
    else:
        weight = (Epilog.BGRADB if has_bias else Epilog.DEFAULT, batches, k, n, rows,
                  not transpose_h, False)
    return (Gemm(None, "forward", forward_epilog, dtype, dtype, batch, m, n, k, ta, tb,
                 requested),
            Gemm(None, "data gradient", Epilog.DEFAULT, dtype, dtype, *data, requested),
            Gemm(None, "weight gradient", weight[0], dtype, dtype, *weight[1:], requested))


class MatmulStep(NamedTuple):
    """A differentiable `matmul` call (its normalised shapes) and how its step runs."""

    params: Params
    a_shape: tuple
    b_shape: tuple
    dtype: Any
    choice: Choice


def plan_matmul_step(ctx: Context, params: Params, a_shape, b_shape, dtype,
                     forward_epilog: Epilog) -> Choice:
    """"plain" where every GEMM of a `matmul` call's training step runs XLA's way on this CUDA
    GPU (asked for, the override, or the tables): JAX then differentiates the plain expression,
    which XLA compiles as it compiles a user's own; else "fused" (the call's custom VJP).

    The weight gradient is judged as a plain GEMM even where the step would give it the bias
    gradient (BGRADB/BGRADA): a table entry times that epilog against XLA's GEMM plus a bias
    sum of its own, but in the plain step XLA fuses the sum into the pass that makes dZ. A
    BGRADB entry faster than XLA's GEMM plus its sum sent a step to the custom VJP, which then
    ran behind XLA's step where the plain step kept up (benchmarks/results/never_slower_matmul)."""
    if not ctx.tables_decide():
        return Choice("fused", "not a CUDA GPU with the library: the reference runs, the "
                               "custom VJP around it")
    gemms = matmul_step_gemms(params, a_shape, b_shape, dtype, forward_epilog)
    plain_sum = (Epilog.BGRADA, Epilog.BGRADB)
    gemms = on_cuda(ctx, tuple(g._replace(epilog=Epilog.DEFAULT) if g.epilog in plain_sum
                               else g for g in gemms), dtype)
    each = "; ".join(f"{g.role}: {g.backend} ({g.why})" for g in gemms)
    if all(g.backend == "xla" for g in gemms):
        return Choice("plain", f"every GEMM of the step runs XLA's way (the bias gradient a sum "
                               f"XLA fuses): {each}")
    return Choice("fused", f"a GEMM of the step runs cuBLASLt: {each}")


# --- one call's plan at lowering -------------------------------------------------------------

K_MAJOR: Layout = (False, True)  # a (M, K), b (N, K): the only layout of cuBLASLt's FP8 kernels


def _transposed(aval, flip: bool):
    """`aval` (a rank-3 operand) with its last two axes swapped when `flip`."""
    return aval.update(shape=(*aval.shape[:-2], aval.shape[-1], aval.shape[-2])) if flip else aval


def relaid_out(avals_in, params: Params, layout: Layout) -> tuple[list, Params]:
    """The call's operands and parameters with a and b in `layout`."""
    flips = (layout[0] != params.transpose_a, layout[1] != params.transpose_b)
    avals = [_transposed(avals_in[0], flips[0]), _transposed(avals_in[1], flips[1]),
             *avals_in[2:]]
    return avals, params._replace(transpose_a=layout[0], transpose_b=layout[1])


def kernel_layout(avals_in, params: Params, supports) -> Optional[Layout]:
    """For a call in a layout cuBLASLt has no kernel for: the other layout it has one for with
    the fewest bytes to transpose, or None. cuBLASLt 13.1 runs BGRADA only with a stored
    (K, M) and BGRADB only with b stored (K, N): the summed operand with K by rows."""
    own = (params.transpose_a, params.transpose_b)
    a, b = avals_in[0], avals_in[1]
    cost = {(ta, tb): (ta != own[0]) * a.size * a.dtype.itemsize +
            (tb != own[1]) * b.size * b.dtype.itemsize
            for ta in (False, True) for tb in (False, True) if (ta, tb) != own}
    for layout in sorted(cost, key=cost.get):
        if supports(*relaid_out(avals_in, params, layout))[0]:
            return layout
    return None


def plan_call(ctx: Context, avals_in, params: Params, supports) -> CallPlan:
    """The way one call lowers for CUDA (`lowering.py`'s module doc lists the cases).
    `supports(avals, params) -> (bool, why)`: cuBLASLt's answer (True where it cannot tell),
    asked of the problem the kernel would run: relaid out and padded."""
    ctx = context.filled(ctx)
    if any(0 in x.shape for x in avals_in[:2]):
        return CallPlan("reference", "an empty problem: nothing for a GEMM to do")
    if not ctx.library() and ctx.cuda_devices():
        return CallPlan("reference", "the cuBLASLt library is unavailable", warning="unavailable")
    a, b = avals_in[0], avals_in[1]
    p = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b)
    backend = gemm_backend(ctx, params.backend, params.epilog, a.dtype, p.batch, p.m, p.n, p.k,
                           params.transpose_a, params.transpose_b)
    if backend.choice == "xla":
        return CallPlan("xla", backend.why)
    fp8 = is_fp8(a.dtype)
    why = [backend.why]
    layout = (params.transpose_a, params.transpose_b)
    if fp8 and layout != K_MAJOR:
        layout = K_MAJOR
        why.append("cuBLASLt's FP8 kernels take only a (M, K) and b (N, K)")
    avals, kernel_params = (relaid_out(avals_in, params, layout) if layout != (
        params.transpose_a, params.transpose_b) else (avals_in, params))
    padded = padding.padded_sizes(avals, kernel_params)
    if padded is not None:
        avals = padding.padded_avals(avals, kernel_params, padded)
        why.append("K or N is not a multiple of 16 bytes: padded (JAX_EPILOG_PAD_UNALIGNED)")
    if ctx.library():
        supported, answer = supports(avals, kernel_params)
        if not supported:
            other = None if fp8 else kernel_layout(avals, kernel_params, supports)
            if other is None:
                return CallPlan("reference", answer, warning="fp8-reference" if fp8 else None)
            layout = other
            why.append(f"cuBLASLt has a kernel only in another layout ({answer})")
    return CallPlan("kernel", "; ".join(why), layout, padded)


def step_runs_xla(ctx: Context, params: Params, a_shape, b_shape, dtype,
                  forward_epilog: Epilog) -> bool:
    """The op's question (`op.planner.Planner.step_runs_xla`): `plan_matmul_step` is "plain"
    (told to the context's observer, `explain`, whichever it is)."""
    ctx = context.filled(ctx)
    step = plan_matmul_step(ctx, params, a_shape, b_shape, dtype, forward_epilog)
    if ctx.observe is not None:
        ctx.observe(MatmulStep(params, a_shape, b_shape, dtype, step), "matmul")
    return step.choice == "plain"


class Planner(NamedTuple):
    """The planner the op asks (`op.planner.register`d on `import jax_epilog`): this module's
    plans, each filling the op's context with this process's tables where it leaves them
    unset."""

    step_runs_xla: Callable[..., bool]
    plan_call: Callable[..., CallPlan]


PLANNER = Planner(step_runs_xla, plan_call)
