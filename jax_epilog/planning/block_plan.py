"""The plans of what the layers run without a `stack_plan.StackPlan`, for `explain`: a SwiGLU
block, a block-scaled FP8 stack, and layers whose kernels are stored in FP8; and the one rule
for which GEMMs run block-scaled FP8 (`block_scaled`).

A `BlockPlan` decides nothing beyond what its function returns: the layers make it when they
are traced and act on its choices, and tell the planning context's observer of it
(`observe`), which is how `explain` lists them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from jax_epilog.op.block_scales import BLOCK
from jax_epilog.planning import context
from jax_epilog.planning.context import Choice
from jax_epilog.planning.stack_plan import fp8_pays_why, quantized_layers


class Gemm(NamedTuple):
    """One GEMM of a block, `(rows, k) @ (k, n)`, named as `explain` prints it, and how it runs."""

    name: str
    k: int
    n: int
    choice: Choice


class BlockPlan(NamedTuple):
    """How a block runs: `kind` ("swiglu", "block-scaled stack", "served stack" or "served
    swiglu"), in `dtype` over `rows` rows, the way chosen for the whole block and why, and its
    GEMMs. `recipe`: the `Fp8` config, or how the stored weights are scaled."""

    kind: str
    dtype: str
    rows: int
    recipe: Optional[str]
    way: Choice
    gemms: tuple[Gemm, ...]


def observe(plan: BlockPlan) -> BlockPlan:
    """Tells the planning context's observer (`explain`) of `plan`; returns it."""
    observer = context.current().observe
    if observer is not None:
        observer(plan, "block")
    return plan


def block_scaled(fp8, rows: int, gemms, widths) -> tuple[Choice, ...]:
    """Per GEMM `(k, n)` of `gemms`, "fp8" (block-scaled) or "bf16" (the compute dtype) under
    `fp8` (`scaling="block"`), and why: every GEMM with `layers="all"`; with "auto", those
    whose K and N are multiples of 128 (every width is some GEMM's contraction, in 1×128
    tiles) and whose FLOPs pay (`stack_plan.fp8_pays_why`). `widths`: (argument, axis, width)
    for each width of the GEMMs, in order; with `layers="all"` the first that is not a
    multiple of 128 is refused by a `ValueError` naming its argument."""
    unaligned = [named for named in widths if named[2] % BLOCK]
    if unaligned and fp8.layers == "all":
        name, axis, width = unaligned[0]
        raise ValueError(f"{name}: Fp8(scaling=\"block\") needs {axis} a multiple of {BLOCK} "
                         f"(each width is the contraction of some GEMM, in 1×128 tiles), got "
                         f"{width}; zero-pad it to {-(-width // BLOCK) * BLOCK}, or pass "
                         f"Fp8(scaling=\"block\", layers=\"auto\") to run such a layer in the "
                         f"compute dtype")
    choices = []
    for k, n in gemms:
        if k % BLOCK or n % BLOCK:
            choices.append(Choice("bf16", f"K={k} or N={n} is not a multiple of {BLOCK} (the "
                                          f"block-scaled tiles)"))
        elif fp8.layers == "all":
            choices.append(Choice("fp8", 'Fp8(layers="all")'))
        else:
            choices.append(fp8_pays_why(rows, k, n))
    return tuple(choices)


#: How `swiglu_plan` names the block's two GEMMs.
SWIGLU_GEMMS = ("gate/up", "down")


def swiglu_plan(fp8, rows: int, d: int, hidden: int, d_out: int, dtype: str) -> BlockPlan:
    """How the SwiGLU block `(rows, D) -> [g u] (rows, 2F) -> (rows, D_out)` runs under `fp8`
    (an `Fp8` or None): "fp8" (per-tensor, one custom VJP of six FP8 GEMMs), "fp8_block"
    (block-scaled, six block-scaled GEMMs) or "compute" (XLA's GEMMs in the compute dtype,
    differentiated by JAX). FP8 runs only where both GEMMs would (the block is one custom VJP):
    `layers="all"`, or both by their rule (`quantized_layers`, `block_scaled`)."""
    shapes = ((d, 2 * hidden), (hidden, d_out))
    if fp8 is None:
        choices = (Choice("bf16", "no fp8="),) * 2
    elif fp8.block:
        choices = block_scaled(fp8, rows, shapes, (
            ("x", "D, its features (last axis)", d), ("gate_up", "F, its columns", hidden),
            ("down", "D_out, its columns", d_out)))
    else:
        choices = tuple(quantized_layers(fp8, rows, shape)[0] for shape in shapes)
    gemms = tuple(Gemm(name, k, n, c) for name, (k, n), c in zip(SWIGLU_GEMMS, shapes, choices))
    if fp8 is not None and all(c.choice == "fp8" for c in choices):
        way = (Choice("fp8_block", "block-scaled e4m3 GEMMs (1×128 tiles, 128×128 blocks), "
                                   "both GEMMs by their rule") if fp8.block else
               Choice("fp8", "per-tensor FP8 GEMMs, both GEMMs by their rule"))
    else:
        why = ("no fp8=: XLA's GEMMs, differentiated by JAX" if fp8 is None else
               "XLA's GEMMs in the compute dtype: FP8 runs the block only where both GEMMs "
               "would")
        way = Choice("compute", why)
    recipe = None if fp8 is None else repr(fp8)
    return BlockPlan("swiglu", dtype, rows, recipe, way, gemms)


def block_stack_plan(fp8, rows: int, widths, dtype: str) -> BlockPlan:
    """How a `dense`/`mlp` stack of `widths` (K_0, ..., K_last) runs under `fp8`
    (`scaling="block"`): each layer block-scaled or in the compute dtype (`block_scaled`)."""
    shapes = tuple(zip(widths, widths[1:]))
    named = [("x", "its features (last axis)", widths[0])] + [
        (f"layers[{i}] kernel", "its columns N", n) for i, n in enumerate(widths[1:])]
    choices = block_scaled(fp8, rows, shapes, named)
    fp8_layers = sum(c.choice == "fp8" for c in choices)
    way = Choice("fp8_block" if fp8_layers else "compute",
                 f"{fp8_layers} of {len(choices)} layers block-scaled, each by its rule; each "
                 f"run of consecutive ones is one custom VJP")
    return BlockPlan("block-scaled stack", dtype, rows, repr(fp8), way,
                     tuple(Gemm(f"layer {i}", k, n, c)
                           for i, ((k, n), c) in enumerate(zip(shapes, choices))))
