"""`python -m jax_epilog.tune`: measure cuBLASLt against XLA for your own shapes, on your GPU.

The automatic backend choice (`jax_epilog.dispatch`) reads a table of measured problems. This
command fills the user's table (``settings.decisions_path()``: ``$JAX_EPILOG_DECISIONS``, else
``~/.cache/jax_epilog/decisions.json``, beside the autotune cache) for the problems a program
actually runs:

1. It traces functions (`jax.make_jaxpr`, walking nested jaxprs: jit, custom_vjp/custom_jvp,
   scan, cond, remat, custom_partitioning) and collects every `epilog_matmul` call left to
   ``backend="auto"``: epilog, dtype, transposes and the normalised problem (batch, M, N, K);
   and every `dense`/`mlp` stack left to "auto" (the planning context's observer, `context.Context`:
   dtype, rows, widths, activations, biases; a training step where its custom VJP's forward was
   traced, an inference forward where its primal was).
2. It times each distinct problem with ``backend="cublaslt"`` and ``backend="xla"``:
   `jax_epilog.matmul` jitted on random operands of those shapes (a random bit mask for the
   DRELU epilogs), wall-clock rounds of back-to-back calls with one `block_until_ready` each,
   median over rounds after a warm-up, about `SECONDS_PER_CANDIDATE` of GPU time per candidate.
   Small problems run several independent copies per call so that host dispatch does not hide
   the kernels (as inside a real network). Then each distinct stack, as the layer is used
   (inference: the forward; training step: forward and backward of a loss), as the
   plain expression under XLA ("plain") and as the fused stack ("fused", each GEMM choosing by
   the GEMM entries just measured): one real call after another, rotating inputs through
   enough copies to leave L2, so the custom calls' own cost is in the times. A training step
   is `jax.value_and_grad` of `squared_error` (the loss `benchmarks/never_slower.py` times)
   w.r.t. x and the parameters. "fused" must win by `dispatch.MARGIN`, and it is recorded
   only where at least one of its GEMMs runs cuBLASLt: with every GEMM on XLA it is our own
   backward around XLA's GEMMs, while "plain" is exactly the program XLA makes of the user's
   expression, so "plain" is recorded (never slower than XLA by construction).
   With ``--fp8`` (``tune(fp8=True)``) each training step whose widths are all multiples of 16
   is also timed in FP8 (``"fp8"``: the same stack with ``fp8=Fp8(layers="all")``,
   `FP8_CANDIDATE`; on a warm amax state where its scaling keeps one, after one untimed step,
   as a training loop carries it). That time decides `Fp8(layers="auto")` for the stack (FP8
   in every layer where it beat the faster bf16 step by `dispatch.MARGIN`, else none;
   `stack_plan.measured_fp8`). ``--fp8-only`` times only that candidate, keeping the table's other
   times of the stack.
3. It merges the decisions into the table (atomic write; other entries are kept): the GEMM
   entries once they are timed, then each stack entry as it is timed, so a run stopped by
   ``--max-seconds`` (no new problem or stack is started after it), an interrupt or a kill
   keeps what it measured.

    python -m jax_epilog.tune --grid                       # the benchmark grid G1-G7, M1-M3
    python -m jax_epilog.tune --grid --rows G7,M3 --dry-run
    python -m jax_epilog.tune --fn mypkg.model:train_step --args "bf16[256,784]" "bf16[784,100]"
    python -m jax_epilog.tune --grid --output jax_epilog/tables/nvidia-h200.json
    python -m jax_epilog.tune --grid --rows M1,T1 --fp8-only --max-seconds 600

From Python: ``jax_epilog.tune.tune([(train_step, (params, batch)), ...])`` (any pytrees of
arrays or `jax.ShapeDtypeStruct`s), or `tune` on `Problem`s from `problems_of`. The grid's
workloads are `jax_epilog.grid`'s, the timing loop `jax_epilog.timing`'s (the benchmarks'),
the command line's argument parsing `jax_epilog.command_line`'s.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr

from jax_epilog.runtime import settings

from jax_epilog.planning import decisions as dispatch

from jax_epilog.layers import functional as layers

from jax_epilog.planning import context, stack_plan
from jax_epilog.tools import timing
from jax_epilog.tools.command_line import DTYPE_NAMES, load_callable, parse_arg_spec  # noqa: F401
from jax_epilog.op.epilogs import Epilog, gelu_aux_columns, is_fp8, relu_mask_bytes
from jax_epilog.float8.recipe import Fp8
from jax_epilog.op.epilogs import aux_dtype as aux_dtype_of
from jax_epilog.tools.grid import (GELU_ROWS, GRID, NETWORKS, TRANSFORMER_MLPS, Workload,  # noqa: F401
                   epilog_stack, forward_fn, grid_functions, grid_workloads, squared_error,
                   step_fn)
from jax_epilog.op.matmul import matmul
from jax_epilog.op.primitive import epilog_matmul_p, problem_of

SECONDS_PER_CANDIDATE = 0.3
ROUNDS = 5
MAX_COPIES = 16  # of a problem's operands, until twice the L2 is touched (`timing.input_copies`)
#: The "fp8" candidate of a training-step stack: the same stack trained with FP8 in every layer,
#: the defaults otherwise.
FP8_CANDIDATE = Fp8(layers="all")
FP8_CHOICES = (False, True, "only")  # `tune(fp8=...)`


#: What `--dry-run` prints first: how to read its lines.
DRY_RUN_HEADER = ("problems: epilog dtype layout (N/T: a, b transposed or not) B×K×N (B rows, "
                  "times batch= GEMMs); stacks: mode dtype B×K, then each layer's →N (+b: "
                  "bias) and activation (with --fp8: then the candidates timed)")


class Problem(NamedTuple):
    """One `epilog_matmul` call as the kernel sees it (normalised operands)."""

    epilog: str
    dtype: str
    transpose_a: bool
    transpose_b: bool
    batch: int
    m: int
    n: int
    k: int
    b_batch: int = 1
    bias_batch: int = 1
    allow_tf32: bool = False  # float32 only: TF32 allowed (precision DEFAULT/HIGH)
    b_dtype: Optional[str] = None  # FP8 calls: b's format where it differs from a's
    result_dtype: Optional[str] = None  # FP8 calls: y's dtype (SPEC §5)
    result_amax: bool = False

    @property
    def table_key(self) -> tuple:
        """What the decision table is keyed by (rows = batch · M)."""
        return (self.epilog, self.dtype, self.transpose_a, self.transpose_b,
                self.batch * self.m, self.n, self.k)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def __str__(self) -> str:
        t = "".join(("T" if self.transpose_a else "N", "T" if self.transpose_b else "N"))
        batch = f"batch={self.batch} " if self.batch > 1 else ""
        return f"{self.epilog} {self.dtype} {t} {batch}{self.m}×{self.k}×{self.n}"  # README's B×K×N


# --- 1. finding the problems ---------------------------------------------------------------

def _sub_jaxprs(params: dict) -> Iterable[Jaxpr]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def epilog_eqns(jaxpr: Jaxpr) -> Iterable:
    """Every `epilog_matmul` equation of `jaxpr` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is epilog_matmul_p:
            yield eqn
            continue
        for sub in _sub_jaxprs(eqn.params):
            yield from epilog_eqns(sub)


def _problem_of_eqn(eqn) -> Problem:
    params = eqn.params
    epilog = Epilog(params["epilog"])
    a, b = eqn.invars[0].aval, eqn.invars[1].aval
    p = problem_of(a.shape, b.shape, params["transpose_a"], params["transpose_b"])
    bias_batch = eqn.invars[2].aval.shape[0] if epilog.has_bias else 1
    a_dtype, b_dtype = jnp.dtype(a.dtype).name, jnp.dtype(b.dtype).name
    return Problem(epilog.name, a_dtype, bool(params["transpose_a"]),
                   bool(params["transpose_b"]), p.batch, p.m, p.n, p.k, b.shape[0], bias_batch,
                   bool(params.get("allow_tf32", False)),
                   b_dtype if b_dtype != a_dtype else None, params.get("result_dtype"),
                   bool(params.get("result_amax", False)))


def traced(fn: Callable, *args, **kwargs) -> tuple[list[Problem], list[dispatch.StackKey]]:
    """(every `epilog_matmul` call left to ``backend="auto"``, every `dense`/`mlp` stack left to
    "auto") of `fn(*args, **kwargs)`, in trace order, repeats included. `args` may be arrays or
    `jax.ShapeDtypeStruct`s."""
    # A function traced before (by jit, or a custom VJP's cached trace) would not run the
    # layers' Python again: no stack seen, and the path of that trace, not the fused one.
    jax.clear_caches()
    stacks = []

    def observe(planned: stack_plan.StackPlan, mode: str) -> None:
        if mode != "planned" and stack_plan.left_to_auto(planned.stack):
            stacks.append(planned.key(mode))

    # The layers' fused path, whatever the tables say, so every GEMM and stack is seen.
    forced = context.default_context()._replace(override=lambda: "cublaslt", observe=observe)
    with context.planning(forced):
        jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
    problems = [_problem_of_eqn(eqn) for eqn in epilog_eqns(jaxpr)
                if eqn.params.get("backend", "auto") == "auto"]
    return problems, list(stacks)


def problems_of(fn: Callable, *args, **kwargs) -> list[Problem]:
    """The `epilog_matmul` calls of `traced`."""
    return traced(fn, *args, **kwargs)[0]


def stacks_of(fn: Callable, *args, **kwargs) -> list[dispatch.StackKey]:
    """The `dense`/`mlp` stacks of `traced`."""
    return traced(fn, *args, **kwargs)[1]


def distinct(problems: Iterable[Problem]) -> list[Problem]:
    """One problem per decision-table key (the first seen), largest first."""
    unique: dict[tuple, Problem] = {}
    for p in problems:
        unique.setdefault(p.table_key, p)
    return sorted(unique.values(), key=lambda p: (-p.flops, p.table_key))


def stack_flops(key: dispatch.StackKey) -> int:
    """1 GEMM per layer forward, 3 per layer for a training step (dX of the first included)."""
    forward = sum(2 * key.rows * k * n for k, n in zip(key.widths, key.widths[1:]))
    return forward if key.mode == "forward" else 3 * forward


def distinct_stacks(stacks: Iterable[dispatch.StackKey]) -> list[dispatch.StackKey]:
    """Each stack once, largest first."""
    return sorted(set(stacks), key=lambda key: (-stack_flops(key), key.order))


# --- 2. timing ----------------------------------------------------------------------------------

def random_operands(p: Problem, seed: int = 0) -> tuple:
    """Random normal (a, b, epilog inputs, FP8 scales) for `jax_epilog.matmul`, shaped so that
    it makes exactly the normalised call `p` (a random bit mask for relu_aux; FP8 operands are
    rounded normal values with unit scales)."""
    epilog = Epilog[p.epilog]
    dtype = jnp.dtype(p.dtype)
    b_dtype = jnp.dtype(p.b_dtype or p.dtype)
    aux_dtype = aux_dtype_of(p.result_dtype or dtype) if is_fp8(dtype) else dtype
    keys = iter(jax.random.split(jax.random.key(seed), 4))
    lead = (p.batch,) if p.batch > 1 or p.b_batch > 1 or p.bias_batch > 1 else ()
    a_shape = (*lead, *((p.k, p.m) if p.transpose_a else (p.m, p.k)))
    b_lead = lead if p.b_batch > 1 else ()
    b_shape = (*b_lead, *((p.n, p.k) if p.transpose_b else (p.k, p.n)))
    a = jax.random.normal(next(keys), a_shape, jnp.float32).astype(dtype)
    b = (jax.random.normal(next(keys), b_shape, jnp.float32) / math.sqrt(max(p.k, 1))).astype(b_dtype)
    inputs = {}
    if epilog.has_bias:
        bias_shape = (*lead, p.n) if p.bias_batch > 1 else (p.n,)
        inputs["bias"] = jax.random.normal(next(keys), bias_shape, aux_dtype)
    if epilog.aux_input == "relu_aux":
        inputs["relu_aux"] = jax.random.bits(next(keys), (*lead, p.m, relu_mask_bytes(p.n)),
                                             jnp.uint8)
    elif epilog.aux_input == "gelu_aux":
        inputs["gelu_aux"] = jax.random.normal(next(keys), (*lead, p.m, gelu_aux_columns(p.n)),
                                               aux_dtype)
    scales = {}
    if is_fp8(dtype):
        scales = {"a": jnp.float32(1), "b": jnp.float32(1)}
        if p.result_dtype and is_fp8(p.result_dtype):
            scales["d"] = jnp.float32(1)
    return a, b, inputs, scales


def call_fn(p: Problem, backend: str) -> Callable:
    """(a, b, epilog inputs, FP8 scales) -> `jax_epilog.matmul` of `p` on `backend`."""
    precision = None if p.allow_tf32 or p.dtype != "float32" else jax.lax.Precision.HIGHEST
    fp8 = dict(quantization_scales=None, preferred_element_type=p.result_dtype,
               result_amax=p.result_amax)

    def call(a, b, inputs, scales=None):
        kwargs = {**fp8, "quantization_scales": scales} if scales else {}
        return matmul(a, b, epilog=Epilog[p.epilog], epilog_inputs=inputs or None,
                      transpose_a=p.transpose_a, transpose_b=p.transpose_b, precision=precision,
                      backend=backend, **kwargs)
    return call


def _copies(nbytes: int) -> int:
    """Copies of `nbytes` of operands that touch twice the L2 (at most `MAX_COPIES`)."""
    return timing.input_copies(max(nbytes, 1), max_copies=MAX_COPIES)


def copies_for(p: Problem) -> int:
    """Independent copies per timed call: enough to touch twice the L2."""
    size = jnp.dtype(p.dtype).itemsize
    return _copies(size * p.batch * (p.m * p.k + p.m * p.n) + size * p.b_batch * p.k * p.n)


def time_problem(p: Problem, backend: str, *, seconds: float = SECONDS_PER_CANDIDATE,
                 rounds: int = ROUNDS) -> float:
    """Seconds per call of `p` on `backend` (`timing.time_calls`: rounds of `seconds /
    rounds`). Each call runs `copies_for(p)` independent problems; the result is per
    problem."""
    operands = _operand_sets(p)
    call = call_fn(p, backend)
    run_all = jax.jit(lambda sets: [call(*s) for s in sets])
    jax.block_until_ready(run_all(operands))  # compile, plan, autotune
    measured = timing.time_calls(run_all, [(operands,)], rounds=rounds,
                                 round_seconds=seconds / rounds)
    return measured.seconds / len(operands)


@functools.lru_cache(maxsize=1)  # both candidates of a problem time the same arrays
def _operand_sets(p: Problem) -> list[tuple]:
    return jax.block_until_ready([random_operands(p, seed) for seed in range(copies_for(p))])


def stack_of(key: dispatch.StackKey) -> stack_plan.Stack:
    """The `stack_plan.Stack` of a stack entry, every GEMM left to "auto"."""
    return stack_plan.Stack(layers=tuple(stack_plan.Layer(act, bias)
                                   for act, bias in zip(key.activations, key.biases)),
                      precision=None, forward="auto", backward="auto")


def plan_of(key: dispatch.StackKey, on_gpu: bool) -> stack_plan.StackPlan:
    """The plan of a stack entry: with `on_gpu`, its GEMMs' backends as "auto" chooses them
    now on this CUDA GPU (inside `dispatch.measuring`, by this run's GEMM entries); without,
    the fused stack throughout (the "fused" candidate, whatever the tables say)."""
    ctx = context.default_context()._replace(tables_decide=lambda: on_gpu)
    return stack_plan.plan_stack(ctx, stack_of(key), key.rows, key.widths, key.dtype)


def fp8_measurable(key: dispatch.StackKey) -> bool:
    """Whether tune times `key` in FP8: a training step whose every layer has K and N in
    multiples of `stack_plan.FP8_ALIGNMENT` (where one does not, the rule keeps it bf16)."""
    return key.mode == "step" and all(w % stack_plan.FP8_ALIGNMENT == 0 for w in key.widths)


def fp8_keeps_state(fp8: Fp8) -> bool:
    """Whether a training loop carries amax histories for `fp8`: every scaling but "current"
    (delayed scaling needs them); the candidate is then timed on a warm state."""
    return fp8.scaling != "current"


def stack_fn(key: dispatch.StackKey, candidate: str) -> Callable:
    """The stack as `candidate` runs it: "plain" (the plain expression, which XLA compiles as
    a user's own), "fused" (the layers' custom VJP) or, for a training step, "fp8" (the layers
    with `FP8_CANDIDATE`). Inference: (x, params) -> y; training step: (x, params, target) ->
    (loss, (dx, dparams)), `jax.value_and_grad` of `squared_error` w.r.t. x and the
    parameters, as a training step uses the layer (the loss gradient's elementwise work is
    then in the step, as it is in the user's); "fp8" with a state (`fp8_keeps_state`):
    (x, params, target, state) -> (loss, (dx, dparams, next state))."""
    if candidate == dispatch.FP8:
        return _fp8_step(key)
    if candidate == "plain":
        forward = functools.partial(layers._plain_expression, stack_of(key))
    else:
        forward = functools.partial(layers._stack, plan_of(key, on_gpu=False))
    if key.mode == "forward":
        return forward

    def loss(x, params, target):
        return squared_error(forward(x, params), target)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _fp8_step(key: dispatch.StackKey) -> Callable:
    """`stack_fn`'s "fp8" candidate."""
    if not fp8_measurable(key):
        raise ValueError(f"{key}: FP8 is timed only for training steps whose widths are "
                         f"multiples of {stack_plan.FP8_ALIGNMENT}")

    def loss(x, params, target, *state):
        y = layers._run(x, params, key.activations, precision=None, forward="auto",
                        backward="auto", dtype=None, fp8=FP8_CANDIDATE,
                        fp8_state=state[0] if state else None)
        return squared_error(y, target)
    return jax.value_and_grad(loss, argnums=(0, 1, 3) if fp8_keeps_state(FP8_CANDIDATE)
                              else (0, 1))


def fused_gemm_backends(key: dispatch.StackKey) -> list[str]:
    """"cublaslt" or "xla" for each GEMM the fused candidate of `key` issues (the training
    step's forward and backward GEMMs, or the inference forward's), as "auto" chooses them now:
    inside `dispatch.measuring`, by this run's GEMM entries."""
    planned = plan_of(key, on_gpu=True)
    gemms = planned.forward_gemms if key.mode == "forward" else planned.gemms
    return [gemm.backend for gemm in gemms]


def stack_operands(key: dispatch.StackKey, seed: int = 0) -> tuple:
    """Random normal (x, params[, target]) for `stack_fn(key, ...)`: kernels scaled by
    1/sqrt(K), small biases (None where the layer has none), a float32 target as
    `benchmarks/never_slower.py` draws it."""
    dtype = jnp.dtype(key.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(key.biases) + 2))
    params = tuple(
        ((jax.random.normal(next(keys), (k, n), jnp.float32) / math.sqrt(k)).astype(dtype),
         (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype) if bias
         else None)
        for k, n, bias in zip(key.widths, key.widths[1:], key.biases))
    x = jax.random.normal(next(keys), (key.rows, key.widths[0]), dtype)
    if key.mode == "forward":
        return x, params
    return x, params, jax.random.normal(next(keys), (key.rows, key.widths[-1]), jnp.float32)


def _stack_copies(key: dispatch.StackKey) -> int:
    size = jnp.dtype(key.dtype).itemsize
    outer = size * key.widths[0] + (size if key.mode == "forward" else 4) * key.widths[-1]
    weights = sum(k * n + n for k, n in zip(key.widths, key.widths[1:]))
    return _copies(key.rows * outer + size * weights)


@functools.lru_cache(maxsize=1)  # both candidates of a stack time the same arrays
def _stack_operand_sets(key: dispatch.StackKey) -> list[tuple]:
    return jax.block_until_ready([stack_operands(key, seed)
                                 for seed in range(_stack_copies(key))])


def time_stack(key: dispatch.StackKey, candidate: str, *,
               seconds: float = SECONDS_PER_CANDIDATE, rounds: int = ROUNDS) -> float:
    """Seconds per call of the stack as `candidate` (`timing.time_calls`): one jitted call per
    step, each on the next copy of the inputs (so the inputs come from HBM, and each call pays
    its custom calls' own cost, as in a real program). "fp8" with a state runs one untimed
    step from `Fp8.init_state` first and times every call on the state it returned (a warm
    history, as from the second step of a training loop on). Call it inside
    `dispatch.measuring`."""
    sets = _stack_operand_sets(key)
    fn = jax.jit(stack_fn(key, candidate))
    if candidate == dispatch.FP8 and fp8_keeps_state(FP8_CANDIDATE):
        _, grads = fn(*sets[0], FP8_CANDIDATE.init_state(len(key.biases)))
        sets = [(*s, grads[-1]) for s in sets]
    jax.block_until_ready([fn(*s) for s in sets])  # compile, plan, autotune
    return timing.time_calls(fn, sets, rounds=rounds, round_seconds=seconds / rounds).seconds


# --- 3. the run ---------------------------------------------------------------------------------

class _Progress:
    """tqdm's bar where tqdm is installed (the `demo` extra), plain lines otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc="jax_epilog.tune", unit="problem")
            except ImportError:
                pass

    def report(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def has_cuda_gpu() -> bool:
    return dispatch.device_identity()[0] is not None


def _collect(items) -> tuple[list[Problem], list[dispatch.StackKey]]:
    """The distinct problems and stacks of `tune`'s items."""
    problems, stacks = [], []
    for item in items:
        if isinstance(item, Problem):
            problems.append(item)
        elif isinstance(item, dispatch.StackKey):
            stacks.append(item)
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[0]):
            fn, args = item
            found = traced(fn, *args)
            problems += found[0]
            stacks += found[1]
        elif callable(item):
            raise TypeError("fns_or_problems: give a function with its example arguments, as "
                            f"(fn, args), got the bare callable {item!r}")
        else:
            raise TypeError(f"fns_or_problems: expected Problem, dispatch.StackKey or (fn, args) "
                            f"items, got {type(item).__name__}")
    return distinct(problems), distinct_stacks(stacks)


def _timed(measure: Callable, what, candidates: Sequence[str], seconds: float,
           failures: list[str]) -> dict:
    """{candidate: seconds per call, None where it failed (noted in `failures`)}."""
    times = {}
    for candidate in candidates:
        try:
            times[candidate] = float(measure(what, candidate, seconds=seconds))
        except Exception as e:  # noqa: BLE001  (one failure costs one candidate)
            times[candidate] = None
            failures.append(f"{what} on {candidate}: {type(e).__name__}: {e}")
    return times


def _us(seconds: Optional[float]) -> str:
    return "failed" if seconds is None else f"{seconds * 1e6:.1f} us"


def _stack_candidates(key: dispatch.StackKey, fp8) -> tuple[str, ...]:
    """What `tune(fp8=...)` times of `key`: "fused" and "plain" (not with fp8="only"), and
    "fp8" where asked for and `fp8_measurable`."""
    bf16 = () if fp8 == "only" else dispatch.STACK_CANDIDATES
    return (*bf16, dispatch.FP8) if fp8 and fp8_measurable(key) else bf16


def _stack_line(entry: dispatch.StackEntry, candidates: Sequence[str]) -> str:
    """A progress line: the candidates' times and what they decide."""
    times = ", ".join(f"{c} {_us(entry.seconds[c])}" for c in candidates)
    verdicts = []
    if entry.choice is not None:
        gemms = entry.seconds.get(dispatch.FUSED_CUBLASLT_GEMMS)
        verdicts.append(entry.choice + (" (fused runs no cuBLASLt GEMM)" if gemms == 0 else ""))
    fp8 = dispatch.decide_fp8_from_times(entry.seconds)
    if fp8 is not None:
        verdicts.append(f"{'fp8' if fp8 == 'fp8' else 'no fp8'} "
                        f"({entry.seconds[dispatch.FP8_SCALING]} scaling)")
    return f"{entry.key}: {times}" + (f" -> {'; '.join(verdicts)}" if verdicts else "")


def tune(fns_or_problems: Iterable, *, output: Optional[Path] = None,
         seconds: float = SECONDS_PER_CANDIDATE, measure: Optional[Callable] = None,
         measure_stack: Optional[Callable] = None, progress: bool = True,
         write: bool = True, fp8=False, max_seconds: Optional[float] = None) -> dispatch.Table:
    """Time every distinct problem of `fns_or_problems` on both backends, then every distinct
    stack as "fused" and "plain" (and "fp8"), and merge the decisions into `output` (default:
    `settings.decisions_path()`).

    Args:
      fns_or_problems: `Problem`s, `dispatch.StackKey`s and/or `(fn, args)` pairs (args: a
        tuple of pytrees of arrays or `jax.ShapeDtypeStruct`s), traced with `traced`.
      output: the table file; None: the user's table.
      seconds: GPU time per candidate and problem or stack (rounds of back-to-back calls).
      measure: `measure(problem, backend, seconds=...) -> seconds per call`; `time_problem` by
        default (tests inject their own).
      measure_stack: `measure_stack(stack_key, candidate, seconds=...) -> seconds per call`;
        `time_stack` by default. It runs inside `dispatch.measuring` with this run's GEMM
        entries.
      progress: show a progress bar (plain lines without tqdm).
      write: merge the results into the file (False: only return them).
      fp8: False; True: also time each training-step stack whose widths are multiples of 16
        in FP8 (`FP8_CANDIDATE`), which then decides `Fp8(layers="auto")` for it; "only":
        time only that (no GEMM, no "fused" or "plain": the table's earlier times of those
        stay).
      max_seconds: start no new problem or stack after this many seconds (None: no limit);
        what was measured is written.

    Returns:
      The `dispatch.Table` of this run's measurements (device, cuBLASLt version, entries,
      stack entries).
    """
    if fp8 not in FP8_CHOICES:
        raise ValueError(f"fp8: expected one of {FP8_CHOICES}, got {fp8!r}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds: expected a positive number of seconds or None, got "
                         f"{max_seconds!r}")
    if not has_cuda_gpu():
        raise RuntimeError("jax_epilog.tune needs a CUDA GPU: JAX sees none on this machine")
    device, version = dispatch.device_identity()
    problems, stacks = _collect(fns_or_problems)
    if fp8 == "only":
        problems, stacks = [], [key for key in stacks if fp8_measurable(key)]
    measure, measure_stack = measure or time_problem, measure_stack or time_stack
    started = time.perf_counter()
    path = Path(output) if output is not None else settings.decisions_path()
    bar = _Progress(len(problems) + len(stacks), progress)
    entries, stack_entries, failures = [], [], []
    saved = [0, 0]  # entries and stack entries written so far

    def save() -> None:
        if write and path is not None and (entries[saved[0]:] or stack_entries[saved[1]:]):
            dispatch.merge_into(path, device, version, entries[saved[0]:],
                                stack_entries[saved[1]:])
        saved[:] = len(entries), len(stack_entries)

    def out_of_time() -> bool:
        return max_seconds is not None and time.perf_counter() - started > max_seconds

    try:
        for p in problems:
            if out_of_time():
                break
            times = _timed(measure, p, dispatch.CANDIDATES, seconds, failures)
            entry = dispatch.make_entry(p.epilog, p.dtype, p.transpose_a, p.transpose_b,
                                        p.batch * p.m, p.n, p.k, times)
            entries.append(entry)
            bar.report(f"{p}: cublaslt {_us(times['cublaslt'])}, xla {_us(times['xla'])} "
                       f"-> {entry.choice}")
        _operand_sets.cache_clear()
        save()
        with dispatch.measuring(dispatch.Table(device, version, tuple(entries))):
            for key in stacks:
                if out_of_time():
                    break
                candidates = _stack_candidates(key, fp8)
                times = _timed(measure_stack, key, candidates, seconds, failures)
                if "fused" in candidates:
                    # Stored with the times: with 0, "plain" is chosen (`dispatch`, module doc).
                    times[dispatch.FUSED_CUBLASLT_GEMMS] = fused_gemm_backends(key).count(
                        "cublaslt")
                if dispatch.FP8 in candidates:
                    times[dispatch.FP8_SCALING] = ("delayed" if fp8_keeps_state(FP8_CANDIDATE)
                                                   else "current")
                stack_entries.append(dispatch.make_stack_entry(key, times))
                bar.report(_stack_line(stack_entries[-1], candidates))
                save()
    finally:
        bar.close()
        _operand_sets.cache_clear()
        _stack_operand_sets.cache_clear()
        save()  # whatever was measured is kept, also when a later problem stopped the run
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    left = len(problems) - len(entries) + len(stacks) - len(stack_entries)
    if left:
        print(f"stopped after {max_seconds:g} s (max_seconds): {left} problems and stacks not "
              f"timed", file=sys.stderr)
    wins = sum(e.choice == "cublaslt" for e in entries)
    fused = sum(e.choice == "fused" for e in stack_entries)
    plain = sum(e.choice == "plain" for e in stack_entries)
    fp8_verdicts = [dispatch.decide_fp8_from_times(e.seconds) for e in stack_entries
                    if dispatch.FP8 in e.seconds]
    fp8_note = (f"; fp8 timed {len(fp8_verdicts)}, won {fp8_verdicts.count('fp8')}"
                if fp8 else "")
    where = f" into {path}" if write and path is not None else ""
    print(f"tuned {len(entries)} problems and {len(stack_entries)} stacks in "
          f"{time.perf_counter() - started:.1f} s: cublaslt {wins}, xla {len(entries) - wins}; "
          f"fused {fused}, plain {plain}{fp8_note}{where}", flush=True)
    return dispatch.Table(device, version, tuple(entries), tuple(stack_entries))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_epilog.tune",
        description="Measure cuBLASLt against XLA for the epilog matmuls of a function (or of "
                    "the benchmark grid) on this GPU and store the choices for backend='auto'.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--grid", action="store_true",
                      help="the benchmark grid G1-G7 and networks M1-M3 (forward and step); "
                           "the transformer MLPs T1, T2 where --rows names them")
    what.add_argument("--fn", metavar="MODULE:CALLABLE", help="a function to trace")
    parser.add_argument("--args", nargs="*", default=[], metavar="DTYPE[SHAPE]",
                        help='example inputs of --fn, e.g. "bf16[256,784]" "bf16[784,100]"')
    parser.add_argument("--rows", help="with --grid: comma-separated ids (e.g. G1,G7,M3,T1)")
    parser.add_argument("--output", type=Path,
                        help="the table to merge into (default: $JAX_EPILOG_DECISIONS or "
                             "~/.cache/jax_epilog/decisions.json)")
    parser.add_argument("--seconds", type=float, default=SECONDS_PER_CANDIDATE,
                        help="GPU time per candidate and problem or stack (default "
                             "%(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the problems and stacks without timing them (works without "
                             "a GPU)")
    parser.add_argument("--no-progress", action="store_true", help="plain lines, no bar")
    fp8 = parser.add_mutually_exclusive_group()
    fp8.add_argument("--fp8", action="store_true",
                     help="also time each training step whose widths are multiples of 16 with "
                          "FP8 in every layer; that decides fp8=Fp8(layers='auto') for it")
    fp8.add_argument("--fp8-only", action="store_true",
                     help="time only the FP8 training steps (no GEMMs, no bf16 stacks: the "
                          "table's earlier times of those stay)")
    parser.add_argument("--max-seconds", type=float, metavar="S",
                        help="start no new problem or stack after S seconds; what was "
                             "measured is written")
    args = parser.parse_args(argv)
    fp8_mode = "only" if args.fp8_only else args.fp8
    if args.args and not args.fn:
        parser.error("--args goes with --fn")
    if args.rows and not args.grid:
        parser.error("--rows goes with --grid")
    if args.max_seconds is not None and not args.max_seconds > 0:
        parser.error("--max-seconds: expected a positive number of seconds")

    if args.grid:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
        try:
            targets = [(fn, example) for _, fn, example in grid_functions(rows)]
        except ValueError as e:
            parser.error(str(e))
    else:
        try:
            fn = load_callable(args.fn)
            example = tuple(parse_arg_spec(spec) for spec in args.args)
        except (ValueError, TypeError, ImportError, AttributeError) as e:
            parser.error(str(e))
        targets = [(fn, example)]

    if not args.dry_run and not has_cuda_gpu():
        print("jax_epilog.tune: no CUDA GPU visible to JAX here; timing needs one (use --dry-run "
              "to list the problems)", file=sys.stderr)
        return 2
    problems, stacks = _collect(targets)
    if args.dry_run:
        if fp8_mode == "only":
            problems, stacks = [], [key for key in stacks if fp8_measurable(key)]
        print(DRY_RUN_HEADER)
        for item in problems:
            print(item)
        for key in stacks:
            timed = f"  ({', '.join(_stack_candidates(key, fp8_mode))})" if fp8_mode else ""
            print(f"{key}{timed}")
        print(f"{len(problems)} distinct problems, {len(stacks)} stacks", flush=True)
        return 0
    tune([*problems, *stacks], output=args.output, seconds=args.seconds,
         progress=not args.no_progress, fp8=fp8_mode, max_seconds=args.max_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
