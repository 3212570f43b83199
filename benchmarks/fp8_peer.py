"""FP8 against the peer (issue 24 part 6): Flax's own FP8 beside ours, from the same weights.

A Flax user gets FP8 today with one argument, `nn.Dense(..., dot_general_cls=
flax.linen.fp8_ops.Fp8DirectDotGeneralOp)`. This benchmark runs that, Flax's other FP8 op and
our `jax_epilog.linen.MLP(fp8=...)` recipes side by side, each a Flax linen model of the same
stack, all from the parameters of one `init`:

- flax_bf16: a stack of `flax.linen.Dense` (bf16 compute), each followed by its activation;
- flax_fp8_direct: the same with `dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp` (XLA's direct
  FP8 GEMM, delayed scaling);
- flax_fp8_qdq: the same with `fp8_ops.Fp8DotGeneralOp` (quantize-dequantize around a bf16 dot,
  left to XLA to rewrite; Flax deprecates it in favour of the direct op);
- ours_bf16: `jax_epilog.linen.MLP` in bf16;
- ours_fp8: `MLP(..., fp8=True)`: the defaults, whatever they are on this commit;
- ours_fp8_all: `fp8=Fp8(layers="all")`: FP8 in every layer;
- ours_fp8_current_all: `fp8=Fp8(scaling="current", layers="all")`;
- ours_fp8_delayed_all: `fp8=Fp8(scaling="delayed", layers="all")`;
- ours_fp8_fast_forward: the same with `fast_accumulation="forward"` (TransformerEngine's
  recipe: fast accumulation in the forward GEMMs, float32 in the gradients);
- ours_fp8_fast_data: the same with `fast_accumulation=("forward", "data gradient")` (the
  weight gradient, a sum over the whole batch, keeps float32 accumulation);
- ours_fp8_fast_all: the same with `fast_accumulation=True` (every GEMM, as XLA runs Flax's);
- ours_fp8_e4m3_grad, ours_fp8_e4m3_grad_fast_data: `ours_fp8_delayed_all` and
  `ours_fp8_fast_data` with `gradient="float8_e4m3fn"` (TransformerEngine's E4M3 recipe: one
  more mantissa bit for the gradients, 2^14 less range);
- stock_fp8, stock_fp8_all: flax_bf16's `nn.Dense` stack with our FP8 GEMMs by one keyword,
  `dot_general_cls=jax_epilog.linen.Fp8DotGeneral` (Flax's state and delayed scaling), with
  the defaults and with `Fp8(layers="all")`: the bias and activation stay XLA fusions;
- stock_fp8_intercepted_all: flax_bf16's model unchanged, trained through
  `jax_epilog.linen.fp8_training(model, fp8=Fp8(scaling="current", layers="all"))`, which
  takes each `nn.Dense` whole: its bias in the FP8 GEMM's epilog, the activation (the
  model's code, between the layers) still an XLA fusion.

An `ours_*` variant that builds the same program as one before it on a row (on M1, `fp8=True`
already runs every layer FP8) is not compiled twice: the report names the one it equals.

The step is Flax's training step without the optimizer: `jax.jit(jax.value_and_grad(loss))`
over all the model's variables, the parameters and the FP8 state collection
(`"_overwrite_with_gradient"`), loss = mean of the squared output in float32. As
`TrainState.apply_gradients` does, the FP8 collection is replaced by its gradient after each
step; 3 such calibrating steps run before anything is measured, and the state they leave is
the one timed. Rows (ReLU rows: the activation after every layer, as `nn.Dense` + `nn.relu`):

| row | batch | widths | activation |
|---|---|---|---|
| W2 | 16384 | 8192 → 8192 → 8192 | ReLU after each |
| LIN | 16384 | 8192 → 8192 → 8192 | none (bias only: all a stock route can fuse) |
| TMLP | 8192 | 4096 → 16384 → 4096 | GELU (tanh) on the hidden layer, none after the last |
| N8K | 8192 | 4096 → 4 × 4096 | ReLU after each |
| M2 | 16384 | 1024 → 8 × 1024 | ReLU after each |
| M1 | 65536 | 4096 → 4 × 4096 | ReLU after each |

Reported per row and variant, both harnesses of benchmarks/README.md (careful: rotated inputs,
device-timed rounds, median, the variants' rounds interleaved; user: the same inputs every
call, wall-clock loop, one `block_until_ready`): ms, TFLOP/s, the ratios against flax_bf16
and flax_fp8_direct, the compiled step's temporaries (`memory_analysis().temp_size_in_bytes`),
where its GEMMs ran (as fp8_bench.py counts them), and the gradient error: per parameter leaf
max|g - g_bf16| / max|g_bf16| against flax_bf16's gradients after the same calibration (the
largest in the table, every leaf in the JSON). Then issue 24's targets, met or MISSED, and
issue 62's for the stock variants: each one's step speed >= 0.97x that of our layers on the
same recipe (stock_fp8: ours_fp8; stock_fp8_all: ours_fp8_all; stock_fp8_intercepted_all:
ours_fp8_current_all) and >= 1.0x flax_fp8_direct's.

    python benchmarks/fp8_peer.py --rows W2,TMLP,N8K,M1 --out benchmarks/results  # H200: ~4.5 min
    python benchmarks/fp8_peer.py --rows M1 --variants flax_fp8_direct,ours_fp8 --out /tmp/m1
    python benchmarks/fp8_peer.py --smoke --out /tmp/smoke     # tiny shapes, any CPU, ~25 s
    python benchmarks/fp8_peer.py --stock --out /tmp/stock     # issue 62's rows, ~2 min

`--stock` runs issue 62's comparison alone: rows LIN and TMLP, the variants its targets
read (`STOCK_VARIANTS`), a 30 s timing budget and a 115 s bound on the whole run.

`--max-s` (default 270) bounds the whole run, compilation included: a row that would start
too late for it (judged by the slowest row so far) is skipped and listed, so M1 (the slowest,
about two minutes of compilation and autotuning on the H200) comes last in the default order.
A row that fails (out of memory, say) is recorded and the next one runs; a variant that fails
is recorded in its row and the others are measured. The report is rewritten after every row:
`<out>/fp8_peer.json` and `<out>/fp8_peer.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
from flax import linen
from flax.linen import fp8_ops

import fp8_bench
import never_slower
import timing
from jax_epilog import Fp8
from jax_epilog import linen as epilog_linen
from jax_epilog.float8.recipe import as_fp8
from jax_epilog.planning import stack_plan
from jax_epilog.tools.grid import Workload

DTYPE = jnp.bfloat16
ROUNDS = 7
CALIBRATION_STEPS = 3
HARNESSES = fp8_bench.HARNESSES
BASES = ("flax_bf16", "flax_fp8_direct")  # the ratios' denominators
FP8_STATE = epilog_linen.FP8_COLLECTION  # Flax's "overwrite with gradient" collection

# Every row's step differentiates the variables, not x (grad_x False): a network's step.
ROWS = {"W2": Workload("W2", 16384, (8192,) * 3, "relu", "relu", False),
        "LIN": Workload("LIN", 16384, (8192,) * 3, None, None, False),
        "TMLP": Workload("TMLP", 8192, (4096, 16384, 4096), "gelu", None, False),
        "N8K": Workload("N8K", 8192, (4096,) * 5, "relu", "relu", False),
        "M2": Workload("M2", 16384, (1024,) * 9, "relu", "relu", False),
        "M1": Workload("M1", 65536, (4096,) * 5, "relu", "relu", False)}
#: `--stock`: issue 62's rows and the variants its targets read (flax_bf16 always runs).
STOCK_ROWS = ("LIN", "TMLP")
STOCK_VARIANTS = ("flax_fp8_direct", "ours_fp8", "ours_fp8_current_all", "stock_fp8",
                  "stock_fp8_intercepted_all")
SMOKE_ROWS = {"S1": Workload("S1", 64, (32, 48, 48), "relu", "relu", False),
              "S2": Workload("S2", 33, (24, 40, 24), "gelu", None, False)}

# --- the variants: name -> (row -> a linen module) -----------------------------------------


class FlaxStack(linen.Module):
    """What a Flax user writes: `nn.Dense` layers in bf16, each followed by its activation,
    with an optional `dot_general_cls` (Flax's FP8 ops). Named `layers_i`, as our MLP's."""

    features: tuple[int, ...]
    activation: Optional[str]
    final_activation: Optional[str]
    dot_general_cls: Any = None

    @linen.compact
    def __call__(self, x):
        extra = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
        for i, size in enumerate(self.features):
            x = linen.Dense(size, dtype=DTYPE, name=f"layers_{i}", **extra)(x)
            last = i == len(self.features) - 1
            x = never_slower.ACTIVATION[self.final_activation if last else self.activation](x)
        return x


def flax_variant(dot_general_cls=None) -> Callable[[Workload], linen.Module]:
    return lambda w: FlaxStack(w.widths[1:], w.activation, w.final_activation, dot_general_cls)


def stock_variant(fp8=None, intercepted: bool = False) -> Callable[[Workload], linen.Module]:
    """flax_bf16's stack with our FP8 dot_general_cls (`fp8` for it where given), or
    unchanged and intercepted by `fp8_training`."""
    op = epilog_linen.Fp8DotGeneral if fp8 is None else \
        functools.partial(epilog_linen.Fp8DotGeneral, fp8=fp8)
    if intercepted:
        return lambda w: epilog_linen.fp8_training(flax_variant()(w), fp8=fp8)
    return flax_variant(op)


def ours_variant(fp8=None) -> Callable[[Workload], linen.Module]:
    return lambda w: epilog_linen.MLP(features=w.widths[1:], activation=w.activation,
                                      final_activation=w.final_activation, dtype=DTYPE, fp8=fp8)


VARIANTS = {"flax_bf16": flax_variant(),
            "flax_fp8_direct": flax_variant(fp8_ops.Fp8DirectDotGeneralOp),
            "flax_fp8_qdq": flax_variant(fp8_ops.Fp8DotGeneralOp),
            "ours_bf16": ours_variant(),
            "ours_fp8": ours_variant(True),
            "ours_fp8_all": ours_variant(Fp8(layers="all")),
            "ours_fp8_current_all": ours_variant(Fp8(scaling="current", layers="all")),
            "ours_fp8_delayed_all": ours_variant(Fp8(scaling="delayed", layers="all")),
            # TransformerEngine's accumulation (fast in the forward GEMMs only), and fast
            # accumulation in every GEMM (what XLA, so Flax's FP8, does at DEFAULT precision)
            "ours_fp8_fast_forward": ours_variant(Fp8(scaling="delayed", layers="all",
                                                      fast_accumulation="forward")),
            "ours_fp8_fast_data": ours_variant(Fp8(scaling="delayed", layers="all",
                                                   fast_accumulation=("forward",
                                                                      "data gradient"))),
            "ours_fp8_fast_all": ours_variant(Fp8(scaling="delayed", layers="all",
                                                  fast_accumulation=True)),
            "ours_fp8_e4m3_grad": ours_variant(Fp8(scaling="delayed", layers="all",
                                                   gradient="float8_e4m3fn")),
            "ours_fp8_e4m3_grad_fast_data": ours_variant(Fp8(
                scaling="delayed", layers="all", gradient="float8_e4m3fn",
                fast_accumulation=("forward", "data gradient"))),
            "stock_fp8": stock_variant(),
            "stock_fp8_all": stock_variant(Fp8(layers="all")),
            "stock_fp8_intercepted_all": stock_variant(Fp8(scaling="current", layers="all"),
                                                       intercepted=True)}


def describe(model: linen.Module) -> str:
    """The variant's model as its user would write it (fp8= spelled out)."""
    if isinstance(model, FlaxStack):
        op = model.dot_general_cls
        if type(model) is not FlaxStack:  # `fp8_training`'s subclass
            return "jax_epilog.linen.fp8_training(nn.Dense stack)"
        if isinstance(op, functools.partial):
            return f"nn.Dense(dot_general_cls={op.func.__module__}.{op.func.__name__}" \
                   f"(fp8={op.keywords['fp8']!r}))"
        return "nn.Dense" + (f"(dot_general_cls={op.__module__}.{op.__name__})" if op else "")
    return f"jax_epilog.linen.MLP(fp8={as_fp8(model.fp8)!r})"


def _ours_program(w: Workload, model: linen.Module) -> Optional[tuple]:
    """What decides the program of one of our FP8 models on `w` (None for anything else):
    the config with `layers` set aside, and the layers it runs in FP8."""
    config = as_fp8(getattr(model, "fp8", None)) if isinstance(model, epilog_linen.MLP) \
        else None
    if config is None:
        return None
    # the modules always keep a state: "auto" scaling is delayed there
    return dataclasses.replace(config.resolved(has_state=True), layers="all"), \
        stack_plan.fp8_layers(config, w.batch, w.widths)


def row_variants(w: Workload, only=None) -> tuple[dict[str, linen.Module], dict[str, str]]:
    """({name: model} to measure on `w`, {name: the earlier variant it equals}): `only`'s
    variants (all by default) and flax_bf16 always, the ratios' base and the gradients'
    reference; one of ours that builds the same program as an earlier one is not measured
    twice."""
    models, same_as, programs = {}, {}, {}
    for name, build in VARIANTS.items():
        if only is not None and name not in only and name != "flax_bf16":
            continue
        model = build(w)
        program = _ours_program(w, model)
        if program is not None and program in programs:
            same_as[name] = programs[program]
            continue
        if program is not None:
            programs[program] = name
        models[name] = model
    return models, same_as


# --- measuring ---------------------------------------------------------------------------


def initial_variables(model: linen.Module, x, params=None) -> dict:
    """`model`'s variables initialised on one row of `x` (init runs the model eagerly, op by
    op; nothing in it depends on the batch), with `params` in place of its own where given:
    every variant starts from flax_bf16's parameters."""
    variables = model.init(jax.random.key(1), x[:1])
    return variables if params is None else {**variables, "params": params}


def make_step(model: linen.Module) -> Callable:
    """Flax's training step without the optimizer: loss and gradients w.r.t. every
    variable."""
    def loss(variables, x):
        return jnp.mean(model.apply(variables, x).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss)


def next_variables(variables: dict, grads: dict) -> dict:
    """The variables after a step, as `TrainState.apply_gradients` leaves them with no
    optimizer update: the FP8 collection replaced by its gradient, the rest unchanged."""
    return {**variables, **({FP8_STATE: grads[FP8_STATE]} if FP8_STATE in grads else {})}


def _leaf_name(path) -> str:
    """"layers_0/kernel" for the key path of params["layers_0"]["kernel"]."""
    return "/".join(str(getattr(key, "key", key)) for key in path)


def leaf_errors(reference, received) -> dict[str, dict[str, float]]:
    """Per parameter leaf (by its path): max|received - reference| / max|reference|, and
    max|reference| (the scale the error is relative to)."""
    paths, received_paths = ([_leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
                             for t in (reference, received))
    if paths != received_paths:
        raise ValueError(f"gradients: expected the leaves {paths}, got {received_paths}")
    errors = {}
    for path, a, b in zip(paths, jax.tree.leaves(reference), jax.tree.leaves(received)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(a)))
        errors[path] = {"error": float(jnp.max(jnp.abs(b - a))) / max(scale, 1e-30),
                        "reference_max": scale}
    return errors


def measure(w: Workload, only, budget: timing.Budget) -> dict[str, Any]:
    """One row: every variant initialised from the same parameters, compiled, calibrated,
    checked against flax_bf16's gradients, then timed in both harnesses."""
    models, same_as = row_variants(w, only)
    params_bytes = 4 * sum(k * n + n for k, n in zip(w.widths, w.widths[1:]))  # float32
    return {"same_as": same_as, **measure_models(w.name, models, (w.batch, w.widths[0]),
                                                 params_bytes, w.flops("step"), budget)}


def measure_models(row: str, models: dict[str, linen.Module], x_shape: tuple[int, int],
                   params_bytes: int, flops: float, budget: timing.Budget,
                   describe_model: Callable[[linen.Module], str] = describe) -> dict[str, Any]:
    """Every model of `models` (flax_bf16 first, whose parameters they all start from) on
    random inputs of `x_shape` (the row named `row`): compiled, calibrated, checked against
    flax_bf16's gradients, then timed in both harnesses. Also `benchmarks/swiglu_bench.py`'s."""
    copies = timing.input_copies(jnp.dtype(DTYPE).itemsize * math.prod(x_shape) + params_bytes)
    xs = [jax.random.normal(jax.random.fold_in(jax.random.key(0), i), x_shape, DTYPE)
          for i in range(copies)]
    params = initial_variables(models["flax_bf16"], xs[0])["params"]
    record: dict[str, Any] = {"variants": {}, "input_copies": copies, "variant_errors": {}}
    steps, arg_sets, reference = {}, {}, None
    for name, model in models.items():
        try:
            variables = initial_variables(model, xs[0], params)
            start = time.perf_counter()
            compiled, fallbacks = fp8_bench.compile_without_fallbacks(make_step(model),
                                                                      (variables, xs[0]))
            compile_seconds = time.perf_counter() - start
            for message in fallbacks:  # loud: this variant is not measuring the real path
                print(f"FALLBACK {row} {name}: {message}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            for i in range(CALIBRATION_STEPS):
                _, grads = compiled(variables, xs[0])
                variables = next_variables(variables, grads)
                if i == 0:  # our first call also plans (and autotunes) its cuBLASLt GEMMs
                    jax.block_until_ready(grads)
                    first_step_seconds = time.perf_counter() - start
            loss, grads = jax.block_until_ready(compiled(variables, xs[0]))
            if name == "flax_bf16":
                reference = grads["params"]
            errors = leaf_errors(reference, grads["params"])
            worst = max(errors, key=lambda p: errors[p]["error"])
            record["variants"][name] = {
                "model": describe_model(model),
                "compile_seconds": compile_seconds, "first_step_seconds": first_step_seconds,
                "loss": float(loss),
                "temp_mib": never_slower._temp_mib(compiled),
                "grad_error_max": errors[worst]["error"], "grad_error_leaf": worst,
                "grad_errors": errors, "gemms": fp8_bench.gemm_counts(compiled.as_text()),
                "fallbacks": fallbacks}
            del grads
            steps[name] = compiled
            # Copies of the variables for the rotated inputs: other buffers, the same values.
            arg_sets[name] = [(variables if i == 0 else jax.tree.map(jnp.copy, variables), x)
                              for i, x in enumerate(xs)]
        except Exception as e:  # noqa: BLE001  (one variant out of memory: time the others)
            if name == "flax_bf16":
                raise  # the base of every ratio and error
            record["variant_errors"][name] = f"{type(e).__name__}: {e}"
            print(f"{row} {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    for harness in HARNESSES:
        times = timing.time_interleaved(
            {name: (steps[name], sets if harness == "careful" else sets[:1])
             for name, sets in arg_sets.items()},
            rounds=ROUNDS, round_seconds=budget.round_seconds())
        for name, t in times.items():
            result = record["variants"][name].setdefault(harness, t.as_dict())
            result["tflops"] = timing.tflops(flops, t.seconds)
            for base in BASES:
                if base in times:
                    result[f"ratio_vs_{base}"] = times[base].seconds / t.seconds
    return record


# --- targets -----------------------------------------------------------------------------

FAST_ROWS = ("M1", "W2", "TMLP")  # >= 1.10x Flax's direct FP8 here
FAST_RATIO = 1.10
BEST_VARIANT_SLACK = 1.03  # ours_fp8 within 3% of our best FP8 variant
M1_TEMP_VS_BF16 = 0.6
MAX_GRAD_ERROR = 0.15
OURS_FP8 = [v for v in VARIANTS if v.startswith("ours_fp8")]
#: Issue 62: (stock variant, our layers on the same recipe); the stock step's speed >=
#: STOCK_VS_OURS x ours and >= STOCK_VS_FLAX x flax_fp8_direct's.
STOCK_PAIRS = (("stock_fp8", "ours_fp8"), ("stock_fp8_all", "ours_fp8_all"),
               ("stock_fp8_intercepted_all", "ours_fp8_current_all"))
STOCK_VS_OURS, STOCK_VS_FLAX = 0.97, 1.0


def _seconds(row: dict, name: str, harness: str) -> Optional[float]:
    return row["variants"].get(name, {}).get(harness, {}).get("seconds")


def _speedup(row: dict, name: str, against, harness: str) -> Optional[float]:
    """The fastest of `against`'s times / `name`'s (> 1: `name` is faster), in `harness`;
    None where one of them was not timed."""
    theirs = [t for t in (_seconds(row, a, harness) for a in against) if t is not None]
    ours = _seconds(row, name, harness)
    return min(theirs) / ours if theirs and ours else None


def targets(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """Issue 24's targets for `fp8=True` (ours_fp8) on the rows that measured what each needs.
    A speed target is met when both harnesses reach it (`value`: the careful harness's,
    `user`: the other's); a target read from a variant that fell back to the reference is
    missed."""
    found = []

    def add(row: dict, target: str, values, bound: float, reads, at_most: bool = False):
        value, user = values if isinstance(values, tuple) else (values, None)
        if value is None:
            return
        met = all(v <= bound if at_most else v >= bound for v in (value, user) if v is not None)
        fell_back = any(row["variants"][v].get("fallbacks") for v in reads)
        found.append({"target": target, "value": value,
                      **({"user": user} if user is not None else {}),
                      "met": met and not fell_back,
                      **({"note": "reference fallback"} if fell_back else {})})

    for name, row in rows.items():
        v = row["variants"]
        for stock, ours in STOCK_PAIRS:
            ours = row.get("same_as", {}).get(ours, ours)  # measured once, under that name
            if "careful" not in v.get(stock, {}):
                continue
            for against, bound in ((ours, STOCK_VS_OURS), ("flax_fp8_direct", STOCK_VS_FLAX)):
                if "careful" in v.get(against, {}):
                    add(row, f"{name} {stock} / {against} speed >= {bound} (issue 62)",
                        tuple(_speedup(row, stock, [against], h) for h in HARNESSES), bound,
                        (stock, against))
        if "careful" not in v.get("ours_fp8", {}):
            continue
        ours = v["ours_fp8"]
        speed = lambda against: tuple(_speedup(row, "ours_fp8", against, h) for h in HARNESSES)
        direct = ("ours_fp8", "flax_fp8_direct")
        flax_fp8_vs_bf16 = _speedup(row, "flax_fp8_direct", ["flax_bf16"], "careful")
        if name in FAST_ROWS:
            add(row, f"{name} ours_fp8 / flax_fp8_direct speed >= {FAST_RATIO}",
                speed(["flax_fp8_direct"]), FAST_RATIO, direct)
        elif flax_fp8_vs_bf16 is not None and flax_fp8_vs_bf16 > 1.0:
            add(row, f"{name} ours_fp8 / flax_fp8_direct speed >= 1.0 (Flax's FP8 beats bf16 "
                "here)", speed(["flax_fp8_direct"]), 1.0, direct)
        elif flax_fp8_vs_bf16 is not None:
            bf16 = [b for b in ("flax_bf16", "ours_bf16") if b in v]
            add(row, f"{name} ours_fp8 / best bf16 speed >= 1.0 (Flax's FP8 slower than bf16 "
                "here)", speed(bf16), 1.0, ("ours_fp8", *bf16))
        fp8_variants = [n for n in OURS_FP8 if "careful" in v.get(n, {})]
        if len(fp8_variants) > 1:
            slower = tuple(None if s is None else 1 / s for s in speed(fp8_variants))
            add(row, f"{name} ours_fp8 time / our best FP8 variant's <= {BEST_VARIANT_SLACK}",
                slower, BEST_VARIANT_SLACK, fp8_variants, at_most=True)
        for against, most, where in (("flax_fp8_direct", 1.0, None),
                                     ("flax_bf16", M1_TEMP_VS_BF16, "M1")):
            theirs = v.get(against, {}).get("temp_mib")
            if where in (None, name) and theirs and ours["temp_mib"] is not None:
                add(row, f"{name} ours_fp8 / {against} temporaries <= {most}",
                    ours["temp_mib"] / theirs, most, ("ours_fp8",), at_most=True)
        add(row, f"{name} ours_fp8 largest gradient error <= {MAX_GRAD_ERROR} "
            f"({ours['grad_error_leaf']})", ours["grad_error_max"], MAX_GRAD_ERROR,
            ("ours_fp8",), at_most=True)
    return found


# --- the run -----------------------------------------------------------------------------


def run(rows: dict[str, Workload], budget_seconds: float, out: Path,
        max_seconds: float = math.inf, only=None) -> dict[str, Any]:
    started = time.perf_counter()
    slowest = 0.0  # the longest row so far: what the next one may take
    budget = timing.Budget(budget_seconds, len(HARNESSES) * len(rows),
                           rounds=len(VARIANTS) * ROUNDS)
    report: dict[str, Any] = {
        "benchmark": "fp8_peer", "metadata": {**timing.run_metadata(), "flax": flax.__version__},
        "method": {"rounds": ROUNDS, "budget_seconds": budget_seconds,
                   "max_seconds": max_seconds,
                   "calibration_steps": CALIBRATION_STEPS, "dtype": jnp.dtype(DTYPE).name,
                   "tables": never_slower.tables_used(),
                   "step": "jax.jit(jax.value_and_grad(mean(y.astype(float32) ** 2))) over "
                           f"all variables; {FP8_STATE} replaced by its gradient after each "
                           "calibrating step; parameters from one init, shared",
                   "ratio": "the other variant's time / this variant's (> 1: faster)",
                   "grad_error": "per parameter leaf, max|g - g_flax_bf16| / max|g_flax_bf16|",
                   "careful": "rotated inputs, back-to-back calls, one block_until_ready per "
                              "round, median; variants interleaved round by round",
                   "user": "the same inputs every call, otherwise as careful"},
        "rows": {}, "errors": [], "skipped": [], "targets": []}
    with timing.progress_bar(len(rows), "fp8_peer") as bar:
        for name, w in rows.items():
            bar.set_postfix_str(name, refresh=False)
            row_started = time.perf_counter()
            if row_started - started + slowest > max_seconds:
                report["skipped"].append(name)
                print(f"skipped {name}: the run would pass --max-s {max_seconds:.0f}",
                      file=sys.stderr, flush=True)
                bar.update()
                continue
            try:
                report["rows"][name] = {
                    "batch": w.batch, "widths": list(w.widths), "activation": w.activation,
                    "final_activation": w.final_activation, "flops": w.flops("step"),
                    "ours_fp8_layers": list(stack_plan.fp8_layers(as_fp8(True), w.batch, w.widths)),
                    **measure(w, only, budget),
                    "wall_seconds": time.perf_counter() - row_started}
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: the next row may fit)
                report["errors"].append({"name": name, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc(limit=8)})
            slowest = max(slowest, time.perf_counter() - row_started)
            report["targets"] = targets(report["rows"])
            report["elapsed_seconds"] = time.perf_counter() - started
            write(report, out)
            bar.update()
    report["elapsed_seconds"] = time.perf_counter() - started
    write(report, out)  # also when every row was skipped
    return report


# --- report ------------------------------------------------------------------------------------


def _cell(value: Optional[float], fmt: str = ".3f") -> str:
    return "–" if value is None else format(value, fmt)


def _target_line(t: dict[str, Any]) -> str:
    user = f" ({t['user']:.3f})" if "user" in t else ""
    note = f" ({t['note']})" if t.get("note") else ""
    return f"{t['target']}: {t['value']:.3f}{user} {'met' if t['met'] else 'MISSED'}{note}"


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = [
        "# FP8 against the peer: Flax's fp8_ops and jax_epilog's fp8= from the same weights", "",
        timing.provenance(meta, f"flax {meta['flax']}",
                          f"{report.get('elapsed_seconds', 0):.0f} s"), "",
        "One training step: `value_and_grad` of mean(y²) over all variables (parameters and "
        f"the FP8 state), after {CALIBRATION_STEPS} calibrating steps. Ratios: the other "
        "variant's time / this one's (> 1: this one is faster), careful harness (user harness "
        "in brackets). temp MiB: `memory_analysis().temp_size_in_bytes`. grad error: the "
        "largest over parameter leaves of max|g − g_flax_bf16| / max|g_flax_bf16| (and its "
        "leaf; every leaf in the JSON). GEMMs: our cuBLASLt custom calls with FP8 / other "
        "operands · XLA's FP8 / other GEMMs in the compiled step. FALLBACK: a GEMM ran the "
        "plain-XLA reference, not cuBLASLt.", "",
        "| row | variant | ms | TFLOP/s | vs flax_bf16 | vs flax_fp8_direct | temp MiB | "
        "grad error (leaf) | GEMMs | compile s (1st step) |", "|---" * 10 + "|"]
    notes = []
    for row, r in report["rows"].items():
        for name, v in r["variants"].items():
            c, u = v.get("careful", {}), v.get("user", {})
            ratios = [f"{_cell(c.get(f'ratio_vs_{b}'))} ({_cell(u.get(f'ratio_vs_{b}'))})"
                      for b in BASES]
            lines.append(
                f"| {row} | {name} | {_cell(c.get('seconds') and c['seconds'] * 1e3)} | "
                f"{_cell(c.get('tflops'), '.0f')} | {ratios[0]} | {ratios[1]} | "
                f"{_cell(v['temp_mib'], '.0f')} | {v['grad_error_max']:.3f} "
                f"({v['grad_error_leaf']}) | {fp8_bench._gemm_cell(v)} | "
                f"{v['compile_seconds']:.1f} ({v['first_step_seconds']:.1f}) |")
        layers = "".join("8" if q else "b" for q in r["ours_fp8_layers"])
        notes.append(f"- {row}: {r['batch']} × {' → '.join(map(str, r['widths']))}, "
                     f"{r['activation']} / last {r['final_activation']}; ours_fp8 runs layers "
                     f"{layers} (8: FP8, b: bf16); the row took {r['wall_seconds']:.0f} s"
                     + "".join(f"; {a} is the same program as {b}"
                               for a, b in r["same_as"].items())
                     + "".join(f"; {a} FAILED: {e}" for a, e in r["variant_errors"].items()))
    lines += ["", "## Rows", ""] + notes
    if report["targets"]:
        lines += ["", "## Targets (issue 24, `fp8=True`; issue 62, the stock variants)", "",
                  "Speed: careful harness (user harness); met when both reach it.", "",
                  "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']:.3f}"
                  f"{' (' + format(t['user'], '.3f') + ')' if 'user' in t else ''} | "
                  f"{'yes' if t['met'] else 'MISSED'}"
                  f"{' (' + t['note'] + ')' if t.get('note') else ''} |"
                  for t in report["targets"]]
    if report["skipped"]:
        lines += ["", "Skipped (the run's --max-s): " + ", ".join(report["skipped"])]
    if report["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['name']}: {e['error']}"
                                          for e in report["errors"]]
    lines += timing.footnotes(meta, [])
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> None:
    timing.write_report(report, out, "fp8_peer", markdown)


def _names(text: Optional[str], known, what: str, parser) -> Optional[list[str]]:
    """A comma-separated option as a list (None where not given); unknown names fail."""
    if not text:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--{what}: unknown {unknown}; expected some of {', '.join(known)}")
    return names


def with_defaults(args):
    """`args` with what `--stock` implies (each only where not given) and `--max-s`'s
    default."""
    if args.stock:
        args.rows = args.rows or (None if args.smoke else ",".join(STOCK_ROWS))
        args.variants = args.variants or ",".join(STOCK_VARIANTS)
        args.budget_s = 30.0 if args.budget_s is None else args.budget_s
    args.max_s = args.max_s if args.max_s is not None else 115.0 if args.stock else 270.0
    return args


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", help=f"comma-separated, in the order to run: {', '.join(ROWS)} "
                                       f"(default: all, in that order; smoke: "
                                       f"{', '.join(SMOKE_ROWS)})")
    parser.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)} "
                        "(default: all; flax_bf16 is always measured)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds over which the timed rounds are spread (default 120; "
                             "smoke 20)")
    parser.add_argument("--max-s", type=float, default=None,
                        help="wall-clock bound of the whole run, compilation included: rows "
                             "that would end later are skipped (default 270; --stock 115)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    parser.add_argument("--stock", action="store_true",
                        help=f"issue 62's comparison alone: rows {','.join(STOCK_ROWS)} (smoke: "
                             f"all), variants {','.join(STOCK_VARIANTS)}, --budget-s 30, "
                             "--max-s 115 (each unless given)")
    args = with_defaults(parser.parse_args(argv))
    table = SMOKE_ROWS if args.smoke else ROWS
    wanted = _names(args.rows, list(table), "rows", parser) or list(table)
    only = _names(args.variants, list(VARIANTS), "variants", parser)
    budget = args.budget_s if args.budget_s is not None else (20.0 if args.smoke else 120.0)
    report = run({name: table[name] for name in wanted}, min(budget, args.max_s), args.out,
                 args.max_s, only)
    for t in report["targets"]:
        print(_target_line(t))
    if report["skipped"]:
        print(f"skipped (--max-s {args.max_s:.0f}): {', '.join(report['skipped'])}")
    print(f"wrote {args.out}/fp8_peer.json, fp8_peer.md ({len(report['errors'])} errors)")
    return report


if __name__ == "__main__":
    main()
