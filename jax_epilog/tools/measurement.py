"""What `tune` measures: the GEMM problems and layer stacks a program runs (found by tracing
it, walking nested jaxprs) and the time of each candidate way to run them (`timing`'s loop on
random operands, enough copies to leave L2). `tune` runs these and writes the table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr


from jax_epilog.planning import table_format
from jax_epilog.layers import functional as layers

from jax_epilog.planning import context, stack_plan
from jax_epilog.tools import timing
from jax_epilog.tools.command_line import gemm_size
from jax_epilog.op.epilogs import Epilog, gelu_aux_columns, is_fp8, relu_mask_bytes
from jax_epilog.float8.recipe import Fp8
from jax_epilog.op.epilogs import aux_dtype as aux_dtype_of
from jax_epilog.tools.grid import squared_error
from jax_epilog.op.matmul import matmul
from jax_epilog.op.call import epilog_matmul_p, problem_of

SECONDS_PER_CANDIDATE = 0.3
ROUNDS = 5
MAX_COPIES = 16  # of a problem's operands, until twice the L2 is touched (`timing.input_copies`)
#: The "fp8" candidate of a training-step stack: the same stack trained with FP8 in every layer,
#: the defaults otherwise.
FP8_CANDIDATE = Fp8(layers="all")
FP8_CHOICES = (False, True, "only")  # `tune(fp8=...)`


#: What `--dry-run` prints first: how to read its lines.
DRY_RUN_HEADER = ("problems: epilog dtype layout (N/T: a, b transposed or not) M×K×N (M rows, "
                  "times a batch of GEMMs); stacks: mode dtype M×K, then each layer's →N (+b: "
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
        return f"{self.epilog} {self.dtype} {t} {gemm_size(self.batch, self.m, self.k, self.n)}"


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


def traced(fn: Callable, *args, **kwargs) -> tuple[list[Problem], list[table_format.StackKey]]:
    """(every `epilog_matmul` call left to ``backend="auto"``, every `dense`/`mlp` stack left to
    "auto") of `fn(*args, **kwargs)`, in trace order, repeats included. `args` may be arrays or
    `jax.ShapeDtypeStruct`s."""
    # A function traced before (by jit, or a custom VJP's cached trace) would not run the
    # layers' Python again: no stack seen, and the path of that trace, not the fused one.
    jax.clear_caches()
    stacks = []

    def observe(planned, mode: str) -> None:
        if mode in ("step", "forward") and stack_plan.left_to_auto(planned.stack):
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


def stacks_of(fn: Callable, *args, **kwargs) -> list[table_format.StackKey]:
    """The `dense`/`mlp` stacks of `traced`."""
    return traced(fn, *args, **kwargs)[1]


def distinct(problems: Iterable[Problem]) -> list[Problem]:
    """One problem per decision-table key (the first seen), largest first."""
    unique: dict[tuple, Problem] = {}
    for p in problems:
        unique.setdefault(p.table_key, p)
    return sorted(unique.values(), key=lambda p: (-p.flops, p.table_key))


def stack_flops(key: table_format.StackKey) -> int:
    """1 GEMM per layer forward, 3 per layer for a training step (dX of the first included)."""
    forward = sum(2 * key.rows * k * n for k, n in zip(key.widths, key.widths[1:]))
    return forward if key.mode == "forward" else 3 * forward


def distinct_stacks(stacks: Iterable[table_format.StackKey]) -> list[table_format.StackKey]:
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


def stack_of(key: table_format.StackKey) -> stack_plan.Stack:
    """The `stack_plan.Stack` of a stack entry, every GEMM left to "auto"."""
    return stack_plan.Stack(layers=tuple(stack_plan.Layer(act, bias)
                                   for act, bias in zip(key.activations, key.biases)),
                      precision=None, forward="auto", backward="auto")


def plan_of(key: table_format.StackKey, on_gpu: bool) -> stack_plan.StackPlan:
    """The plan of a stack entry: with `on_gpu`, its GEMMs' backends as "auto" chooses them
    now on this CUDA GPU (inside `context.measuring`, by this run's GEMM entries); without,
    the fused stack throughout (the "fused" candidate, whatever the tables say)."""
    ctx = context.current()._replace(tables_decide=lambda: on_gpu)
    return stack_plan.plan_stack(ctx, stack_of(key), key.rows, key.widths, key.dtype)


def fp8_measurable(key: table_format.StackKey) -> bool:
    """Whether tune times `key` in FP8: a training step whose every layer has K and N in
    multiples of `stack_plan.FP8_ALIGNMENT` (where one does not, the rule keeps it bf16)."""
    return key.mode == "step" and all(w % stack_plan.FP8_ALIGNMENT == 0 for w in key.widths)


def fp8_keeps_state(fp8: Fp8) -> bool:
    """Whether a training loop carries amax histories for `fp8`: every scaling but "current"
    (delayed scaling needs them); the candidate is then timed on a warm state."""
    return fp8.scaling != "current"


def stack_fn(key: table_format.StackKey, candidate: str) -> Callable:
    """The stack as `candidate` runs it: "plain" (the plain expression, which XLA compiles as
    a user's own), "fused" (the layers' custom VJP) or, for a training step, "fp8" (the layers
    with `FP8_CANDIDATE`). Inference: (x, params) -> y; training step: (x, params, target) ->
    (loss, (dx, dparams)), `jax.value_and_grad` of `squared_error` w.r.t. x and the
    parameters, as a training step uses the layer (the loss gradient's elementwise work is
    then in the step, as it is in the user's); "fp8" with a state (`fp8_keeps_state`):
    (x, params, target, state) -> (loss, (dx, dparams, next state))."""
    if candidate == table_format.FP8:
        return _fp8_step(key)
    if candidate == "plain":
        forward = functools.partial(layers.plain_expression, stack_of(key))
    else:
        forward = functools.partial(layers.fused_stack, plan_of(key, on_gpu=False))
    if key.mode == "forward":
        return forward

    def loss(x, params, target):
        return squared_error(forward(x, params), target)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _fp8_step(key: table_format.StackKey) -> Callable:
    """`stack_fn`'s "fp8" candidate."""
    if not fp8_measurable(key):
        raise ValueError(f"{key}: FP8 is timed only for training steps whose widths are "
                         f"multiples of {stack_plan.FP8_ALIGNMENT}")

    def loss(x, params, target, *state):
        y = layers.run(x, params, key.activations, precision=None, forward="auto",
                        backward="auto", dtype=None, fp8=FP8_CANDIDATE,
                        fp8_state=state[0] if state else None)
        return squared_error(y, target)
    return jax.value_and_grad(loss, argnums=(0, 1, 3) if fp8_keeps_state(FP8_CANDIDATE)
                              else (0, 1))


def fused_gemm_backends(key: table_format.StackKey) -> list[str]:
    """"cublaslt" or "xla" for each GEMM the fused candidate of `key` issues (the training
    step's forward and backward GEMMs, or the inference forward's), as "auto" chooses them now:
    inside `context.measuring`, by this run's GEMM entries."""
    planned = plan_of(key, on_gpu=True)
    gemms = planned.forward_gemms if key.mode == "forward" else planned.gemms
    return [gemm.backend for gemm in gemms]


def stack_operands(key: table_format.StackKey, seed: int = 0) -> tuple:
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


def _stack_copies(key: table_format.StackKey) -> int:
    size = jnp.dtype(key.dtype).itemsize
    outer = size * key.widths[0] + (size if key.mode == "forward" else 4) * key.widths[-1]
    weights = sum(k * n + n for k, n in zip(key.widths, key.widths[1:]))
    return _copies(key.rows * outer + size * weights)


@functools.lru_cache(maxsize=1)  # both candidates of a stack time the same arrays
def _stack_operand_sets(key: table_format.StackKey) -> list[tuple]:
    return jax.block_until_ready([stack_operands(key, seed)
                                 for seed in range(_stack_copies(key))])


def time_stack(key: table_format.StackKey, candidate: str, *,
               seconds: float = SECONDS_PER_CANDIDATE, rounds: int = ROUNDS) -> float:
    """Seconds per call of the stack as `candidate` (`timing.time_calls`): one jitted call per
    step, each on the next copy of the inputs (so the inputs come from HBM, and each call pays
    its custom calls' own cost, as in a real program). "fp8" with a state runs one untimed
    step from `Fp8.init_state` first and times every call on the state it returned (a warm
    history, as from the second step of a training loop on). Call it inside
    `context.measuring`."""
    sets = _stack_operand_sets(key)
    fn = jax.jit(stack_fn(key, candidate))
    if candidate == table_format.FP8 and fp8_keeps_state(FP8_CANDIDATE):
        _, grads = fn(*sets[0], FP8_CANDIDATE.init_state(len(key.biases)))
        sets = [(*s, grads[-1]) for s in sets]
    jax.block_until_ready([fn(*s) for s in sets])  # compile, plan, autotune
    return timing.time_calls(fn, sets, rounds=rounds, round_seconds=seconds / rounds).seconds
