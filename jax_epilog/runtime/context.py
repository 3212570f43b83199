"""The per-trace state: one `Context`, what the choices made while a program is traced and
lowered depend on beyond the call itself (the backend override, this host's devices and library,
the decision tables, the planner the op asks), and the switches that change how a traced
program is built (a forced serving way, delayed scaling's self-calibration, a calibration's
recording).

The code below the public entry points takes the context as an argument (the planners'
`ctx`). It is held in one `ContextVar` (`current`, set for a block by `using`), read only where
JAX's tracing, or a user's own model, leaves no argument to carry it:

- a primitive's lowering, which JAX calls with the call's avals alone (`op.lowering`);
- the public calls themselves (`matmul`, `dense`, `mlp`, the Flax modules), whose signatures are
  the user's, and which a user's model calls: `tune` and `explain` plan a whole program with
  their own context, `serving.calibrate` records the inputs of a model it runs eagerly;
- the FP8 scaling functions (`float8.scaling`) reached from every FP8 layer, stock Flax ones
  included, which read `calibrates`.

A bare `Context()` stands for this process's settings, devices and tables: `planning.context`
fills its planning fields (`planning.context.filled`). Nothing here imports above `runtime`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, NamedTuple, Optional


class Context(NamedTuple):
    """The per-trace state (see the module doc). The planning fields are callables asked only
    when a choice needs them; None (a bare context) stands for this process's."""

    override: Optional[Callable[[], Optional[str]]] = None  # JAX_EPILOG_BACKEND: "cublaslt", "xla"
    tables_decide: Optional[Callable[[], bool]] = None  # a CUDA GPU whose tables choose
    cuda_devices: Optional[Callable[[], bool]] = None  # this host has CUDA devices (else an export)
    library: Optional[Callable[[], bool]] = None  # the cuBLASLt library is loaded
    gemm_table: Optional[Callable[..., Any]] = None  # (epilog, dtype, batch, m, n, k, ta, tb)
    stack_table: Optional[Callable[[Any], Any]] = None  # a stack's measured entry
    # `Fp8(layers="auto")`: "fp8" or "bf16" for a training-step stack from a measured entry
    fp8_table: Optional[Callable[[Any], Any]] = None
    # A served layer's way over some rows from a measured serving entry (`serving_plan`)
    serving_table: Optional[Callable[[int], Any]] = None
    # Told of each stack when planned ("planned") and whose fused form is traced ("step" or
    # "forward"), of each differentiable matmul call's step plan ("matmul") and of each block
    # ("block"): how `tune` and `explain` find a program's stacks and calls. Decides nothing.
    observe: Optional[Callable[[Any, str], None]] = None
    # How every layer with a stored FP8 weight runs (`settings.forced_serving_way`), else None:
    # JAX_EPILOG_SERVING, then `planning.serving_plan`.
    serving_way: Optional[str] = None
    # Delayed scaling calibrates itself from a cold history (`float8.scaling.uncalibrated`: the
    # switch tests and benchmarks compare it with; not part of the public `Fp8` recipe).
    calibrates: bool = True
    # While `layers.serving.calibrate` runs a model eagerly: each stored weight's input amax.
    calibration: Optional[dict] = None


_active: contextvars.ContextVar[Context] = contextvars.ContextVar(
    "jax_epilog_context", default=Context())


def current() -> Context:
    """The context set for this block (`using`), else a bare one: this process's."""
    return _active.get()


@contextlib.contextmanager
def using(ctx: Context):
    """Within the block (in this thread), traces and lowerings use `ctx`. A function jitted
    before keeps its cached trace: `tune` and `explain` clear JAX's caches first."""
    token = _active.set(ctx)
    try:
        yield ctx
    finally:
        _active.reset(token)


def changed(**fields):
    """`using` the current context with `fields` changed."""
    return using(current()._replace(**fields))
