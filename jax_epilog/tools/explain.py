"""`jax_epilog.explain(fn, *args)`: how each stack and each GEMM of a program runs on CUDA, and
the rule or table entry that decided it.

It traces `fn` (nothing runs) and prints the plans the layers and the lowering make
(`jax_epilog.plan`): for each `dense`/`mlp` stack, the training step's and the inference
forward's path (fused or the plain expression) and why, each layer's FP8 choice and why, and
each GEMM with its epilog, layout and backend (the table entry that chose it); for each
SwiGLU block, block-scaled FP8 stack and layer of stored FP8 weights, its way and each GEMM's
rule (`planning.block_plan`); then each `epilog_matmul` call of the program as the CUDA
lowering would emit it (the kernel, XLA's GEMM, padded or relaid out, a block-scaled call's
tiles). On a host without a CUDA GPU the program runs the reference; the explanation then
says what CUDA would do, planned with the tables of `table_format.REFERENCE_DEVICE` (the
reference GPU) and without cuBLASLt's support answers (which only a GPU can give).

    jax_epilog.explain(train_step, params, batch)        # prints, returns an `Explanation`
    python -m jax_epilog.explanation --fn mypkg.model:train_step --args "bf16[256,784]" ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import jax
import numpy as np

from jax_epilog.runtime import library as cuda_library

from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.op import lowering

from jax_epilog.planning import block_plan, call_plan, context, stack_plan
from jax_epilog.op.call import Params, problem_of
from jax_epilog.tools.command_line import gemm_size, load_callable, parse_arg_spec
from jax_epilog.tools.measurement import epilog_eqns


class Call(NamedTuple):
    """One `epilog_matmul` call of the traced program (a `stack_plan.Gemm` of no layer) and how it
    lowers for CUDA; `block_scaling`: a block-scaled FP8 call's tiles of a and b."""

    gemm: stack_plan.Gemm
    lowering: call_plan.CallPlan
    block_scaling: Optional[tuple[str, str]] = None


class Explanation(NamedTuple):
    """The plans of a traced program: where (`target`), its stacks, its calls."""

    target: str
    stacks: tuple[stack_plan.StackPlan, ...]
    calls: tuple[Call, ...]
    matmuls: tuple[call_plan.MatmulStep, ...] = ()  # the differentiable `matmul` calls
    # SwiGLU blocks, block-scaled stacks and layers of stored FP8 weights
    blocks: tuple[block_plan.BlockPlan, ...] = ()

    def __str__(self) -> str:
        return "\n".join(_lines(self))

    def __repr__(self) -> str:
        return (f"<jax_epilog.Explanation: {len(self.stacks)} stacks, {len(self.blocks)} "
                f"blocks, {len(self.calls)} calls>")


def _layout(transpose_a: bool, transpose_b: bool) -> str:
    return ("T" if transpose_a else "N") + ("T" if transpose_b else "N")


def _gemm_line(g: stack_plan.Gemm) -> str:
    result = f" -> {g.result_dtype}" if g.result_dtype != g.operand_dtype else ""
    asked = f" ({g.requested_why})" if g.requested_why else ""
    runs = f" -> {g.backend}: {g.why}" if g.backend is not None else ""
    return (f"    layer {g.layer} {g.role:<15} {g.epilog.name:<14} {g.dtype}{result} "
            f"{_layout(g.transpose_a, g.transpose_b)} {gemm_size(g.batch, g.m, g.k, g.n)}  "
            f"backend={g.requested}{asked}{runs}")


def _stack_lines(i: int, sp: stack_plan.StackPlan) -> list[str]:
    s = sp.stack
    layers = "".join(f" ->{n}{'+b' if layer.has_bias else ''}"
                     f"{' ' + layer.activation if layer.activation else ''}"
                     for n, layer in zip(sp.widths[1:], s.layers))
    lines = [f"stack {i}: {sp.dtype} M×K {sp.rows}×{sp.widths[0]}{layers}  (forward={s.forward}, "
             f"backward={s.backward}{', fp8=' + repr(sp.fp8) if sp.fp8 is not None else ''})",
             f"  training step: {sp.step.choice}: {sp.step.why}",
             f"  inference forward: {sp.inference.choice}: {sp.inference.why}"]
    if sp.fp8 is not None:
        for j, lp in enumerate(sp.layers):
            extra = [name.replace("_", " ") for name in
                     ("relu_from_next_input", "writes_fp8_result", "writes_fp8_gradient")
                     if getattr(lp, name)]
            lines.append(f"  layer {j}: {'FP8' if lp.fp8 else sp.dtype}: {lp.why}"
                         f"{'; ' + ', '.join(extra) if extra else ''}")
        if sp.fp8.delayed:
            lines.append("  delayed scaling: while a tensor's amax history is cold (a fresh "
                         "state), its scale comes from this step (the first input's own amax; "
                         "a GEMM-written tensor's bound from its operands' amaxes)")
    for title, path, gemms in (
            ("the training step (forward, then backward from the last layer)", sp.step,
             sp.gemms),
            ("the inference forward", sp.inference, sp.forward_gemms)):
        unused = " (not issued: the plain expression runs)" if path.choice == "plain" else ""
        lines.append(f"  GEMMs of {title}{unused}:")
        lines += [_gemm_line(g) for g in gemms]
    return lines


def _block_lines(i: int, b: block_plan.BlockPlan) -> list[str]:
    recipe = f", {b.recipe}" if b.recipe else ""
    lines = [f"{b.kind} {i}: {b.dtype}, {b.rows} rows{recipe}: {b.way.choice}: {b.way.why}"]
    lines += [f"  {g.name} GEMM {gemm_size(1, b.rows, g.k, g.n)}: {g.choice.choice}"
              + ("" if g.choice == b.way else f": {g.choice.why}") for g in b.gemms]
    return lines


def _lines(e: Explanation) -> list[str]:
    lines = [f"jax_epilog.explain: {e.target}"]
    if not (e.stacks or e.blocks):
        lines.append("no dense/mlp stack, SwiGLU block or stored-FP8 layer")
    for i, sp in enumerate(e.stacks):
        lines += _stack_lines(i, sp)
    for i, b in enumerate(e.blocks):
        lines += _block_lines(i, b)
    for m in e.matmuls:
        p = problem_of(m.a_shape, m.b_shape, m.params.transpose_a, m.params.transpose_b)
        lines.append(f"matmul {m.params.epilog.name} {np.dtype(m.dtype).name} "
                     f"{_layout(m.params.transpose_a, m.params.transpose_b)} "
                     f"{gemm_size(p.batch, p.m, p.k, p.n)}: "
                     + ("the plain expression under JAX's autodiff, no epilog_matmul call: "
                        if m.choice.choice == "plain" else "this package's custom VJP: ")
                     + m.choice.why)
    lines.append(f"epilog_matmul calls in the traced program: {len(e.calls)}")
    if not e.calls:
        plain_stacks = [sp for sp in e.stacks if sp.step.choice == "plain"]
        plain_matmuls = [m for m in e.matmuls if m.choice.choice == "plain"]
        if plain_stacks or plain_matmuls:
            lines.append("  none: the stacks and matmul calls above run the plain expression, "
                         "which XLA compiles as its own")
        elif e.blocks:
            lines.append("  none: the blocks above run XLA's own GEMMs")
        elif not (e.stacks or e.matmuls):
            lines.append("  none: the program calls no jax_epilog.matmul, dense, mlp or swiglu")
    for c in e.calls:
        g = c.gemm
        own = (g.transpose_a, g.transpose_b)
        layout = f" in {_layout(*c.lowering.layout)}" if c.lowering.layout not in (None, own) else ""
        if c.lowering.padded:
            layout += " K,N padded to {}×{}".format(*c.lowering.padded)
        if c.block_scaling:
            layout += " scales {} × {}".format(*c.block_scaling)
        lines.append(f"  {g.epilog.name:<14} {g.dtype} {_layout(g.transpose_a, g.transpose_b)} "
                     f"{gemm_size(g.batch, g.m, g.k, g.n)}  backend={g.requested}: "
                     f"{c.lowering.way}{layout}"
                     f" ({c.lowering.why})")
    return lines


def _context(observe) -> tuple[context.Context, Callable, str]:
    """(the planning context, cuBLASLt's support answers, where) for this host: its own CUDA
    GPU, or, without one, as if on the reference GPU with the library."""
    ctx = context.default_context()._replace(observe=observe)
    if context.on_cuda_gpu():
        device, version = decisions.device_identity()
        return ctx, lowering.kernel_supports, f"as lowered on this host's {device} " \
                                              f"(cuBLASLt {version})"
    identity = (table_format.REFERENCE_DEVICE, None)
    emulated = ctx._replace(
        tables_decide=lambda: True, cuda_devices=lambda: True, library=lambda: True,
        gemm_table=lambda *problem: decisions.decision(*problem, identity=identity),
        stack_table=lambda key: decisions.stack_decision(key, identity=identity),
        fp8_table=lambda key: decisions.fp8_stack_decision(key, identity=identity),
        serving_table=lambda rows: decisions.serving_decision(rows, identity=identity))
    why = cuda_library.unavailable_reason() if jax.default_backend() == "gpu" else \
        f"the platform is {jax.default_backend()}"
    target = (f"no CUDA GPU with the library here ({why}): this host runs the reference; "
              f"shown is what CUDA would run on an {table_format.REFERENCE_DEVICE} with its "
              f"tables (cuBLASLt's support not asked)")
    return emulated, lambda avals, params: (True, "cannot ask cuBLASLt here"), target


def _calls(jaxpr, ctx: context.Context, supports) -> list[Call]:
    calls = []
    for eqn in epilog_eqns(jaxpr):
        params = Params(**eqn.params)
        avals = [v.aval for v in eqn.invars]
        p = problem_of(avals[0].shape, avals[1].shape, params.transpose_a, params.transpose_b)
        dtypes = [np.dtype(a.dtype).name for a in avals[:2]]
        result = np.dtype(eqn.outvars[0].aval.dtype).name
        gemm = stack_plan.Gemm(None, "call", params.epilog, " x ".join(dict.fromkeys(dtypes)),
                         result, p.batch, p.m, p.n, p.k, params.transpose_a, params.transpose_b,
                         params.backend)
        calls.append(Call(gemm, call_plan.plan_call(ctx, avals, params, supports),
                          params.block_scaling))
    return calls


def explanation(fn: Callable, args: tuple = (), kwargs: Optional[dict] = None) -> Explanation:
    """The `Explanation` of `fn(*args, **kwargs)` (arrays or `jax.ShapeDtypeStruct`s)."""
    stacks, matmuls, blocks = [], [], []

    def observe(planned, mode: str) -> None:
        if mode == "planned":
            stacks.append(planned)
        elif mode == "matmul":
            matmuls.append(planned)
        elif mode == "block":
            blocks.append(planned)

    ctx, supports, target = _context(observe)
    # A function traced before keeps its cached trace: no stack would be planned again.
    jax.clear_caches()
    with context.planning(ctx):
        jaxpr = jax.make_jaxpr(fn)(*args, **(kwargs or {})).jaxpr
        calls = _calls(jaxpr, ctx, supports)
    jax.clear_caches()  # nothing traced under this context is reused outside it
    return Explanation(target, tuple(stacks), tuple(calls), tuple(matmuls), tuple(blocks))


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """Print how each stack and GEMM of `fn(*args, **kwargs)` runs on CUDA and why (see the
    module doc); returns the `Explanation`."""
    result = explanation(fn, args, kwargs)
    print(result)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_epilog.explanation",
        description="Print how each dense/mlp stack and each epilog GEMM of a function runs on "
                    "CUDA, and the rule or table entry that decided it.")
    parser.add_argument("--fn", required=True, metavar="MODULE:CALLABLE",
                        help="the function to trace")
    parser.add_argument("--args", nargs="*", default=[], metavar="DTYPE[SHAPE]",
                        help='its example inputs, e.g. "bf16[256,784]" "bf16[784,100]"')
    args = parser.parse_args(argv)
    try:
        fn = load_callable(args.fn)
        example = tuple(parse_arg_spec(spec) for spec in args.args)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        parser.error(str(e))
    explain(fn, *example)
    return 0


if __name__ == "__main__":
    sys.exit(main())
