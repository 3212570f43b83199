"""Who chooses how a call runs: the op asks, `planning` answers.

The op depends on the runtime only. Two of its steps need a choice that planning makes from
the decision tables and this host: whether a differentiated call's training step runs the
plain expression under JAX's autodiff (`Planner.step_runs_xla`), and how one call of the inner
primitive lowers for CUDA (`Planner.plan_call`), each asked with the per-trace
`runtime.context.Context` (which the planner fills with this process's tables where it leaves
them unset). The op asks `current()`; `planning` registers
its planner when `jax_epilog` is imported (`jax_epilog/__init__.py`), so the op never imports
planning. Until one is registered, `Reference` answers: the custom VJP, and the exact reference
on CUDA, which computes the same results everywhere.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Protocol

Layout = tuple[bool, bool]  # (transpose_a, transpose_b)


class CallPlan(NamedTuple):
    """How one call of the inner primitive lowers for CUDA: `way` is "reference" (exact),
    "xla" (the reference in XLA's way: its own GEMM and fusions) or "kernel" (the cuBLASLt
    custom call), the kernel's operands in `layout` (transposed in XLA where it differs from
    the call's) and, where `padded` is (K, N), zero-padded to those sizes first; `warning` says
    what to warn of."""

    way: str
    why: str
    layout: Optional[Layout] = None
    padded: Optional[tuple[int, int]] = None
    warning: Optional[str] = None  # "unavailable" or "fp8-reference"


# `supports(avals, params) -> (bool, why)`: cuBLASLt's answer for a problem (the lowering's
# `kernel_supports`), which the planner asks of the problem the kernel would run.
Supports = Callable[..., tuple[bool, str]]


class Planner(Protocol):
    """What the op asks of a planner (`ctx` is the per-trace `runtime.context.Context`,
    `params` a `call.Params`)."""

    def step_runs_xla(self, ctx, params, a_shape, b_shape, dtype, forward_epilog) -> bool:
        """Whether the training step of a differentiable `matmul` call (its rank-3 shapes, the
        epilog its forward runs) is the plain expression under JAX's autodiff."""

    def plan_call(self, ctx, avals_in, params, supports: Supports) -> CallPlan:
        """How one call of the inner primitive lowers for CUDA."""


class Reference:
    """The planner before `planning` registers its own: nothing measured decides, so the step
    is the custom VJP and CUDA runs the exact reference."""

    def step_runs_xla(self, ctx, params, a_shape, b_shape, dtype, forward_epilog) -> bool:
        return False

    def plan_call(self, ctx, avals_in, params, supports: Supports) -> CallPlan:
        return CallPlan("reference", "no planner registered: the exact reference")


_planner: Planner = Reference()


def register(planner: Planner) -> Planner:
    """Makes `planner` the one the op asks; returns the one it replaces."""
    global _planner
    previous, _planner = _planner, planner
    return previous


def current() -> Planner:
    """The planner the op asks now."""
    return _planner
