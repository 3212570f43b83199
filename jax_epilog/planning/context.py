"""What a plan depends on beyond the call itself (`Context`: the backend override, this host's
CUDA devices and library, the decision tables), and the one place a GEMM's ``backend="auto"``
becomes "cublaslt" or "xla" (`gemm_backend` for one call's problem, `on_cuda` for the `Gemm`s
of a step), which both the call's and the stack's plans ask.

The context (`runtime.context.Context`, the one per-trace state) reaches the planners as an
argument; `filled` gives a bare one this process's settings, devices and tables. `planning(ctx)`
sets a context's planning fields for a block, which is how `tune` and `explain` plan with their
own; `current()` is the one set, filled.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import numpy as np

from jax_epilog.op.epilogs import Epilog
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.runtime import context as runtime_context
from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime import settings
from jax_epilog.runtime.context import Context


# --- what is known beyond the call ----------------------------------------------------------

@functools.cache
def has_cuda_devices() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def on_cuda_gpu() -> bool:
    """Whether the layers run on a CUDA GPU with the library (elsewhere they run the reference:
    the layer is the same code whichever path it takes)."""
    return jax.default_backend() == "gpu" and cuda_library.available()


#: This process's planning fields: its settings, its devices, its tables (each read when asked).
_PROCESS = dict(override=lambda: settings.backend_override(),
                tables_decide=lambda: on_cuda_gpu(),
                cuda_devices=lambda: has_cuda_devices(),
                library=lambda: cuda_library.available(),
                gemm_table=lambda *problem: decisions.decision(*problem),
                stack_table=lambda key: decisions.stack_decision(key),
                fp8_table=lambda key: decisions.fp8_stack_decision(key),
                serving_table=lambda rows: decisions.serving_decision(rows))
#: The fields a plan reads (`planning` sets them; the others are `runtime.context`'s switches).
PLANNING_FIELDS = (*_PROCESS, "observe")


def filled(ctx: Context) -> Context:
    """`ctx` with this process's settings, devices and tables where it leaves them unset (a
    bare `Context()` is this process's)."""
    missing = {name: ask for name, ask in _PROCESS.items() if getattr(ctx, name) is None}
    return ctx._replace(**missing) if missing else ctx


def default_context() -> Context:
    """This process's context: its settings, its devices, its tables (each read when asked)."""
    return filled(Context())


def current() -> Context:
    """The context the layers and the lowering plan with: the one `planning` set, else
    `default_context()` (with the switches of `runtime.context` as set)."""
    return filled(runtime_context.current())


def measuring(table: table_format.Table) -> Context:
    """The context a tune run times a stack's candidates in: `table`, the GEMM entries it has
    just measured, decides GEMMs before the user's and the shipped tables, and no stack entry
    decides (each candidate is timed as itself)."""
    return default_context()._replace(
        gemm_table=lambda *problem: decisions.decision(*problem, measuring=table),
        stack_table=lambda key: None, fp8_table=lambda key: None)


def planning(ctx: Context):
    """Within the block (in this thread), traces and lowerings plan with `ctx`'s planning fields
    (`PLANNING_FIELDS`; the switches, such as `float8.scaling.uncalibrated`, stay as set). A
    function jitted before keeps its cached trace: `tune` and `explain` clear JAX's caches
    first."""
    return runtime_context.changed(**{name: getattr(ctx, name) for name in PLANNING_FIELDS})


# --- one GEMM's backend ------------------------------------------------------------------------

class Choice(NamedTuple):
    """A choice and the rule or table entry that made it."""

    choice: str
    why: str


def describe(decision: table_format.Decision) -> str:
    """Why `decisions` decided as it did, in words."""
    entry = decision.entry
    measured = ""
    if entry is not None and hasattr(entry, "seconds"):
        times = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in entry.seconds.items()
                          if isinstance(v, float))
        where = (f"{entry.epilog} {entry.dtype} rows={entry.m} N={entry.n} K={entry.k}"
                 if isinstance(entry, table_format.Entry) else str(entry.key))
        measured = f": nearest entry {where} ({times})"
    return {
        "override": "JAX_EPILOG_BACKEND",
        "measuring": "this tune run's measurement" + measured,
        "user": "your table (JAX_EPILOG_DECISIONS)" + measured,
        "shipped": "the table shipped for this GPU" + measured,
        "fp8": "FP8 operands without a nearby entry: the kernel (SPEC §5)",
        "none": "no nearby entry in this GPU's tables: XLA",
        "reference-gpu": ("no table for this GPU: the kernel only where every nearby entry "
                          "of the reference GPU's table chose it") + measured,
    }.get(decision.source, decision.source)


def auto_backend(ctx: Context, epilog, dtype, batch: int, m: int, n: int, k: int,
                 transpose_a: bool, transpose_b: bool) -> Choice:
    """What ``backend="auto"`` runs on a CUDA GPU: the override, else the tables."""
    override = ctx.override()
    if override is not None:
        return Choice(override, "JAX_EPILOG_BACKEND")
    decision = ctx.gemm_table(Epilog(epilog), np.dtype(dtype), batch, m, n, k, transpose_a,
                              transpose_b)
    return Choice(decision.choice, describe(decision))


def gemm_backend(ctx: Context, requested: str, epilog, dtype, batch: int, m: int, n: int,
                 k: int, transpose_a: bool, transpose_b: bool) -> Choice:
    """"cublaslt" or "xla" for one normalised problem lowered for CUDA with
    ``backend=requested``: as asked, else `auto_backend`; exported from a host without a CUDA
    device (no tables for the device it will run on): the kernel."""
    if requested != "auto":
        return Choice(requested, f"backend={requested!r} asked for")
    if ctx.override() is None and not ctx.cuda_devices():
        return Choice("cublaslt", "no CUDA device on this host (an export): the kernel")
    return auto_backend(ctx, epilog, dtype, batch, m, n, k, transpose_a, transpose_b)


class Gemm(NamedTuple):
    """One GEMM a stack issues, as the kernel sees it (batch, M, N, K normalised), with the
    backend the layer asks of `matmul` (`requested`, and why where the layer changed it) and,
    where the plan is made for a CUDA GPU, what that becomes (`backend`, `why`)."""

    layer: Optional[int]  # None: a call of its own (`explanation`), not a stack's
    role: str  # "forward", "weight gradient" or "data gradient"
    epilog: Epilog
    dtype: str  # a's dtype, and b's after "x" where it differs (FP8)
    result_dtype: str
    batch: int
    m: int
    n: int
    k: int
    transpose_a: bool
    transpose_b: bool
    requested: str
    requested_why: str = ""
    backend: Optional[str] = None
    why: str = ""

    @property
    def problem(self) -> tuple:
        """`decisions`' arguments after the epilog and dtype."""
        return (self.batch, self.m, self.n, self.k, self.transpose_a, self.transpose_b)

    @property
    def operand_dtype(self) -> str:
        return self.dtype.split(" x ")[0]


def on_cuda(ctx: Context, gemms, dtype) -> tuple[Gemm, ...]:
    """`gemms` with what each runs on a CUDA GPU (the tables consulted where the GEMM is left
    to "auto")."""
    planned = []
    for g in gemms:
        if g.requested == "auto":
            choice = auto_backend(ctx, g.epilog, g.operand_dtype, *g.problem)
        else:
            choice = Choice(g.requested, g.requested_why or f"backend={g.requested!r} asked for")
        planned.append(g._replace(backend=choice.choice, why=choice.why))
    return tuple(planned)
