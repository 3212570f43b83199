"""FP8 training steps (issue 13 part 2): jax_epilog's `fp8=` layers against XLA, bf16 and FP8.

For M1 (4 ReLU layers 4096 wide, batch 65536), G1 (one dense ReLU layer 65536×4096→4096, its
input differentiated too) and M2 (8 layers 1024 wide, batch 16384) of benchmarks/README.md,
one training step (`jax.value_and_grad` of a squared error, `grid.step_fn`) of:

- xla_bf16: the plain-JAX expression `relu(x @ W + b)` in bf16 (what users have);
- ours_bf16: `jax_epilog.mlp` in bf16, every choice on "auto";
- ours_fp8: `jax_epilog.mlp(..., fp8=True)`: FP8 where `jax_epilog.float8.scaling.fp8_pays` says so;
- ours_fp8_all: `fp8=Fp8(layers="all")`: FP8 in every layer (left out of a row where ours_fp8
  already is, as in M1);
- ours_fp8_fused: the same with `backward="fused"`: the ReLU mask kept and cuBLASLt's FP8
  DRELU_BGRAD for the data gradients, where "auto" keeps no mask and runs a plain FP8 GEMM,
  the derivative (from the next layer's h8 > 0, `stack_plan.relu_from_next_input`) and the bias
  gradient as XLA fusions;
- ours_fp8_xla_fwd: ours_fp8 with `forward="xla"`: the forward FP8 GEMMs XLA's f8 dot with
  the bias and ReLU fused by XLA, where "auto" runs cuBLASLt's FP8 RELU_BIAS;
- ours_fp8_fast: ours_fp8 with `Fp8(fast_accumulation="forward")`: cuBLASLt's FP8 fast
  accumulation in the forward GEMMs (TransformerEngine's recipe), float32 in the gradients;
- ours_fp8_stateful: `fp8=True` with `fp8_state=`, as the Flax modules run it: "auto" scaling
  with a state is delayed scaling, ours_fp8_delayed's program;
- ours_fp8_delayed: `fp8=Fp8(scaling="delayed")`: the activations' and gradients' scales from
  an amax history (the state, an argument of the step whose next value the step returns as
  its gradient); each forward GEMM followed by an FP8 layer writes that layer's e4m3 input
  and amax itself. The state timed is the one an untimed first step from a fresh state
  returned (that step calibrates itself), so the timed steps run warm;
- ours_fp8_delayed_uncalibrated: the same traced without calibration (`fp8.uncalibrated`),
  the program before delayed scaling calibrated itself: against ours_fp8_delayed, what
  calibration costs a warm step (its own amax pass and bounds);
- ours_fp8_delayed_fast: ours_fp8_delayed with `fast_accumulation="forward"`;
- xla_fp8: what a user writes for FP8 under XLA (Flax's fp8_ops style): per layer a
  `custom_vjp` dot with per-tensor current scaling, a direct FP8 `dot_general` with
  `preferred_element_type`, e5m2 gradients; bias and ReLU by JAX's autodiff. At its DEFAULT
  precision XLA runs every FP8 GEMM, the weight gradients' K = batch sums included, with
  fast accumulation;
- xla_fp8_precise: the same with precision HIGHEST in the backward GEMMs (XLA then accumulates
  the gradients in float32): the user's step with ours_fp8_fast's accumulation.

All variants are compiled and timed in one process on the same inputs, in both harnesses of
benchmarks/README.md (careful: rotated inputs; user: the same inputs every call), their rounds
interleaved. Reported per row: ms, TFLOP/s, the ratios against xla_bf16 and xla_fp8, the
compiled step's temporaries (`memory_analysis().temp_size_in_bytes`), and how far each
variant's loss and gradients are from xla_bf16's (FP8 rounding), and which GEMMs of the
compiled step ran where: our cuBLASLt custom calls (FP8 or not), XLA's FP8 GEMMs, XLA's other
GEMMs. A variant whose compilation warned that cuBLASLt "runs no FP8 kernel" (a GEMM fell back
to the plain-XLA reference) is marked FALLBACK in the table and on stdout, and a target read
from it counts as missed. Then the issue's targets, printed met/MISSED.

`--sweep` also times the training step of 4-layer ReLU stacks of a few widths and batches
(M1's form, rows × n wide × layers) for xla_bf16, ours_bf16, ours_fp8_all and
ours_fp8_delayed_all (`Fp8(scaling="delayed", layers="all")`): the FLOPs per GEMM from which
FP8 pays, for `stack_plan.FP8_MIN_FLOPS`.

    python benchmarks/fp8_bench.py --rows M1 --out benchmarks/results  # H200: ~2.5 minutes
    python benchmarks/fp8_bench.py --rows G1,M2 --out /tmp/g1_m2       # H200: ~2.5 minutes
    python benchmarks/fp8_bench.py --sweep --out benchmarks/results    # plus the sweep

`--max-s` (default 270) bounds the whole run, compilation included: a row or sweep size that
would start too late for it (judged by the slowest one so far) is skipped and listed. With
every variant, all three rows take longer than that on the H200 (2026-12-01: G1 139 s, the
first row paying the process's warm-up too, M2 18 s, M1 156 s): run M1 on its own.
    python benchmarks/fp8_bench.py --smoke --sweep --out /tmp/smoke    # tiny shapes, any CPU

Writes `<out>/fp8.json` and `<out>/fp8.md`.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp

import never_slower
import timing
from jax_epilog import Fp8, mlp
from jax_epilog.runtime.targets import MATMUL
from jax_epilog.float8 import scaling as fp8
from jax_epilog.planning import stack_plan
from jax_epilog.tools import grid
from jax_epilog.tools.grid import GRID, NETWORKS, Workload, step_fn

ROUNDS = 7
HARNESSES = ("careful", "user")
# G1 and M2 first, M1 (the slowest: ~2.5 minutes on the H200, compilation and autotuning
# included) last: a row is skipped when the slowest row so far says it would pass --max-s, so
# a cut run keeps the quick rows.
ROWS = {"G1": Workload("G1", GRID["G1"][0], GRID["G1"][1:], None, "relu", True),
        "M2": Workload("M2", *NETWORKS["M2"], "relu", None, False),
        "M1": Workload("M1", *NETWORKS["M1"], "relu", None, False)}
SMOKE_ROWS = {"S1": Workload("S1", 64, (32, 48, 48, 16), "relu", None, False),
              "S2": Workload("S2", 33, (48, 32), None, "relu", True)}
# (rows, n, layers): a stack of `layers` ReLU layers n wide (M1's form), 2·rows·n² FLOPs a GEMM.
SWEEP = [(8192, 1024, 4), (16384, 1024, 4), (8192, 2048, 4), (4096, 4096, 4), (16384, 2048, 4),
         (32768, 2048, 4), (8192, 4096, 4), (16384, 4096, 4)]
SMOKE_SWEEP = [(32, 16, 2), (64, 32, 2)]
# The issue's targets: (row, variant, against, at least) on the careful harness's ratios.
TARGETS = [(row, variant, against, least)
           for variant in ("ours_fp8", "ours_fp8_delayed", "ours_fp8_delayed_fast")
           for row, against, least in (("M1", "xla_bf16", 1.5), ("M1", "xla_fp8", 1.05),
                                       ("G1", "xla_bf16", 1.45), ("M2", "xla_bf16", 0.98))]
MAX_TEMP_RATIOS = [("M1", variant, "xla_bf16", 0.6)  # temporaries at most this share
                   for variant in ("ours_fp8", "ours_fp8_delayed", "ours_fp8_delayed_fast")]


# --- the user's FP8 step under XLA -----------------------------------------------------------

def _user_quantize(x, dtype):
    """(x in FP8, dequantization scale) with the scale from x's own amax."""
    largest = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, largest / amax, 1.0)
    return jnp.clip(x.astype(jnp.float32) * scale, -largest, largest).astype(dtype), 1.0 / scale


def _f8_dot(a8, b8, contract, scale, dtype, precision=None):
    """A direct FP8 dot_general (XLA rewrites it to its cuBLASLt FP8 GEMM), dequantized as
    Flax's fp8_ops does: the result times the scale cast to the result's dtype. At DEFAULT
    precision XLA turns on cuBLASLt's FP8 fast accumulation; at HIGHEST it does not."""
    y = jax.lax.dot_general(a8, b8, (contract, ((), ())), precision=precision,
                            preferred_element_type=dtype)
    return y * scale.astype(dtype)


def user_fp8_dot(backward_precision=None):
    """The user's FP8 dot as a `custom_vjp`; its backward GEMMs at `backward_precision`
    (None: XLA's default, fast accumulation in every GEMM, as most users write it; HIGHEST:
    float32 accumulation in the gradients, TransformerEngine's recipe)."""
    @jax.custom_vjp
    def dot(x, kernel):
        return forward(x, kernel)[0]

    def forward(x, kernel):
        x8, sx = _user_quantize(x, jnp.float8_e4m3fn)
        w8, sw = _user_quantize(kernel, jnp.float8_e4m3fn)
        return _f8_dot(x8, w8, ((1,), (0,)), sx * sw, x.dtype), (x8, sx, w8, sw)

    def backward(saved, dy):
        x8, sx, w8, sw = saved
        g8, sg = _user_quantize(dy, jnp.float8_e5m2)
        dx = _f8_dot(g8, w8, ((1,), (1,)), sg * sw, dy.dtype, backward_precision)
        dw = _f8_dot(x8, g8, ((0,), (0,)), sx * sg, dy.dtype, backward_precision)
        return dx, dw

    dot.defvjp(forward, backward)
    return dot


def xla_fp8_stack(dot):
    def stack(x, params, activation, final_activation):
        for i, (kernel, bias) in enumerate(params):
            act = activation if i < len(params) - 1 else final_activation
            x = never_slower.ACTIVATION[act](dot(x, kernel) + bias)
        return x
    return stack


def epilog_stack(fp8_config, backward="auto", forward="auto"):
    def stack(x, params, activation, final_activation):
        return mlp(x, params, activation=activation, final_activation=final_activation,
                   fp8=fp8_config, forward=forward, backward=backward)
    return stack


VARIANTS = {"xla_bf16": never_slower.xla_stack, "ours_bf16": epilog_stack(None),
            "ours_fp8": epilog_stack(True), "ours_fp8_all": epilog_stack(Fp8(layers="all")),
            "ours_fp8_fused": epilog_stack(Fp8(layers="all"), backward="fused"),
            "ours_fp8_xla_fwd": epilog_stack(True, forward="xla"),
            "ours_fp8_fast": epilog_stack(Fp8(fast_accumulation="forward")),
            # with fp8_state=, as the Flax modules run fp8=True: delayed scaling (timed warm)
            "ours_fp8_stateful": Fp8(),
            "ours_fp8_delayed": Fp8(scaling="delayed"),
            "ours_fp8_delayed_uncalibrated": Fp8(scaling="delayed"),
            "ours_fp8_delayed_fast": Fp8(scaling="delayed", fast_accumulation="forward"),
            "ours_fp8_delayed_all": Fp8(scaling="delayed", layers="all"),
            "xla_fp8": xla_fp8_stack(user_fp8_dot()),
            "xla_fp8_precise": xla_fp8_stack(user_fp8_dot(jax.lax.Precision.HIGHEST))}
UNCALIBRATED = ("ours_fp8_delayed_uncalibrated",)  # traced without calibration
SWEEP_VARIANTS = ("xla_bf16", "ours_bf16", "ours_fp8_all", "ours_fp8_delayed_all")
SWEEP_FP8 = ("ours_fp8_all", "ours_fp8_delayed_all")  # each against the faster bf16 step


def stateful_step(w: Workload, config: Fp8, args) -> tuple[Any, tuple]:
    """(step, (state,)): the training step of `mlp(..., fp8=config, fp8_state=state)`, as a
    Flax module runs it, `step_fn`'s with the state a fourth argument, (params, x, target,
    state) -> (loss, grads), the state's gradient (the next state) among the grads; and the
    state it is timed with: the one the first step on `args` returned from a fresh state.
    That step calibrates itself, so the timed steps run warm: the delayed program, with its
    calibration on the state's histories (an argument, as in training, so XLA cannot fold
    it away)."""
    def loss(params, x, target, state):
        y = mlp(x, params, activation=w.activation, final_activation=w.final_activation,
                fp8=config, fp8_state=state)
        return grid.squared_error(y, target)

    step = jax.value_and_grad(loss, argnums=(0, 1, 3) if w.grad_x else (0, 3))
    state = jax.block_until_ready(
        jax.jit(step)(*args, config.init_state(len(w.widths) - 1))[1][-1])
    return step, (state,)


def uncalibrated(step):
    """`step`, traced without calibration (`fp8.uncalibrated`): the delayed program as it was
    before delayed scaling calibrated itself, to measure what calibration costs."""
    def traced(*args):
        with fp8.uncalibrated():
            return step(*args)
    return traced


def variant_step(w: Workload, name: str, args, table=None) -> tuple[Any, tuple]:
    """(the variant's step, the arguments it takes after `args`: the state of a stateful
    one); `table`: where the variant is defined (default `VARIANTS`)."""
    variant = (VARIANTS if table is None else table)[name]
    if not isinstance(variant, Fp8):
        return step_fn(w, variant), ()
    step, state = stateful_step(w, variant, args)
    return (uncalibrated(step) if name in UNCALIBRATED else step), state


def row_variants(w: Workload, only=None) -> tuple[str, ...]:
    """The variants of a row (of `only`, if given; xla_bf16 always, the ratios' base):
    ours_fp8_all is left out where `fp8=True` already runs every layer FP8 (M1: the same
    program, compiled and timed twice for nothing)."""
    rows, widths = w.batch, list(w.widths)
    same = stack_plan.fp8_layers(Fp8(), rows, widths) == \
        stack_plan.fp8_layers(Fp8(layers="all"), rows, widths)
    return tuple(v for v in VARIANTS if not (same and v == "ours_fp8_all")
                 and (only is None or v in only or v == "xla_bf16"))


# --- measuring ---------------------------------------------------------------------------

def _relative_diff(expected, received) -> float:
    """Largest |difference| over the loss and every gradient, relative to that leaf's largest
    value in `expected`."""
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                     / max(float(jnp.max(jnp.abs(a.astype(jnp.float32)))), 1e-30))
               for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(received)))


FALLBACK_MESSAGE = "runs no FP8 kernel"  # lowering's RuntimeWarning for a reference fallback


def gemm_counts(hlo: str) -> dict[str, int]:
    """Where the GEMMs of a compiled module run: our cuBLASLt custom calls (with FP8 operands
    or not), XLA's FP8 GEMMs (`__cublas$lt$matmul$f8`) and XLA's other GEMMs."""
    ours = [line for line in hlo.splitlines()
            if f'custom_call_target="{MATMUL.name}' in line]
    ours_fp8 = sum(1 for line in ours if "f8e" in line)
    xla_fp8 = hlo.count('custom_call_target="__cublas$lt$matmul$f8"')
    xla_other = hlo.count('custom_call_target="__cublas$gemm"') + \
        hlo.count('custom_call_target="__cublas$lt$matmul"')
    return {"ours_fp8": ours_fp8, "ours_other": len(ours) - ours_fp8, "xla_fp8": xla_fp8,
            "xla_other": xla_other}


def compile_without_fallbacks(fn, args) -> tuple[Any, list[str]]:
    """(compiled fn, the messages of every reference fallback its lowering warned of)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, sorted({str(w.message) for w in caught
                             if issubclass(w.category, RuntimeWarning)
                             and FALLBACK_MESSAGE in str(w.message)})


def measure(w: Workload, variants, budget: timing.Budget, table=None) -> dict[str, Any]:
    """One row: every variant's step compiled, checked against xla_bf16, timed; `table` as
    for `variant_step` (another benchmark's variants in the same form)."""
    arg_sets = [never_slower.random_inputs(w, seed)
                for seed in range(never_slower.input_copies(w))]
    compiled, sets, record = {}, {}, {"variants": {}}
    for name in variants:
        step, extra = variant_step(w, name, arg_sets[0], table)
        sets[name] = [(*args, *extra) for args in arg_sets]
        compiled[name], fallbacks = compile_without_fallbacks(step, sets[name][0])
        for message in fallbacks:  # loud: this variant is not measuring the real path
            print(f"FALLBACK {w.name} {name}: {message}", file=sys.stderr, flush=True)
        hlo = compiled[name].as_text()
        outputs = jax.block_until_ready(compiled[name](*sets[name][0]))
        if name == "xla_bf16":
            reference = outputs
        record["variants"][name] = {
            "temp_mib": never_slower._temp_mib(compiled[name]),
            "relative_diff_vs_xla_bf16": _relative_diff(reference, outputs),
            "gemms": gemm_counts(hlo), "fallbacks": fallbacks}
        del outputs
    flops = w.flops("step")
    for harness in HARNESSES:
        runs = {name: (compiled[name], sets[name] if harness == "careful" else sets[name][:1])
                for name in variants}
        times = timing.time_interleaved(runs,
                                        rounds=ROUNDS, round_seconds=budget.round_seconds())
        for name, t in times.items():
            result = record["variants"][name].setdefault(harness, t.as_dict())
            result["tflops"] = timing.tflops(flops, t.seconds)
            for base in ("xla_bf16", "xla_fp8", "ours_bf16"):
                if base in times:
                    result[f"ratio_vs_{base}"] = times[base].seconds / t.seconds
    return record


def targets(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """The issue's targets where the rows were measured: a speed target is met when the
    ratio reaches it in both harnesses (`value`: the careful one's, `user`: the other's)."""
    found = []
    for row, variant, against, least in TARGETS:
        if row in rows and "careful" in rows[row]["variants"].get(variant, {}):
            variants = rows[row]["variants"]
            value = variants[variant]["careful"][f"ratio_vs_{against}"]
            user = variants[variant].get("user", {}).get(f"ratio_vs_{against}", value)
            fell_back = bool(variants[variant].get("fallbacks") or
                             variants[against].get("fallbacks"))
            found.append({"target": f"{row} {variant} / {against} speed >= {least}",
                          "value": value, "user": user,
                          "met": min(value, user) >= least and not fell_back,
                          **({"note": "reference fallback"} if fell_back else {})})
    for row, variant, against, most in MAX_TEMP_RATIOS:
        if row not in rows or variant not in rows[row]["variants"]:
            continue
        temps = {v: rows[row]["variants"][v]["temp_mib"] for v in (variant, against)}
        if None not in temps.values() and temps[against]:
            value = temps[variant] / temps[against]
            found.append({"target": f"{row} {variant} / {against} temporaries <= {most}",
                          "value": value, "met": value <= most})
    return found


def crossover(sweep: list[dict[str, Any]], variant: str = "ours_fp8_all") -> Optional[float]:
    """The smallest FLOPs per layer GEMM from which `variant` beat the faster bf16 step at
    every larger measured size (None if it never did)."""
    wins = sorted((r["gemm_flops"], r["fp8_vs_best_bf16"][variant] > 1.0) for r in sweep
                  if variant in r.get("fp8_vs_best_bf16", {}))
    smallest = None
    for flops, won in reversed(wins):
        if not won:
            break
        smallest = flops
    return smallest


def sweep_name(rows: int, n: int, layers: int) -> str:
    return f"{rows}x{n}x{layers}"


def sweep_record(rows: int, n: int, layers: int, budget: timing.Budget) -> dict[str, Any]:
    """The training step of `layers` ReLU layers n wide on `rows` rows: FP8 in every layer
    (current and delayed scaling) against the faster bf16."""
    w = Workload(sweep_name(rows, n, layers), rows, (n,) * (layers + 1), "relu", None, False)
    record = {"rows": rows, "n": n, "layers": layers,
              "gemm_flops": timing.gemm_flops(rows, n, n), "fp8_pays": stack_plan.fp8_pays(rows, n, n)}
    try:
        measured = measure(w, SWEEP_VARIANTS, budget)["variants"]
        seconds = {v: measured[v]["careful"]["seconds"] for v in SWEEP_VARIANTS}
        record["fallbacks"] = sorted({m for v in SWEEP_VARIANTS
                                      for m in measured[v]["fallbacks"]})
        record["ms"] = {v: s * 1e3 for v, s in seconds.items()}
        best_bf16 = min(seconds["xla_bf16"], seconds["ours_bf16"])
        record["fp8_vs_best_bf16"] = {v: best_bf16 / seconds[v] for v in SWEEP_FP8}
    except Exception as e:  # noqa: BLE001  (one size failing must not end the sweep)
        record["error"] = f"{type(e).__name__}: {e}"
    return record


def run(rows: dict[str, Workload], sweep_sizes, budget_seconds: float,
        out: Path, max_seconds: float = float("inf"), only=None) -> dict[str, Any]:
    started = time.perf_counter()
    slowest = 0.0  # the longest row or sweep size so far: what the next one may take

    def skip(what: str) -> bool:
        """Whether `what` would start too late to end within max_seconds (then it is listed)."""
        if time.perf_counter() - started + slowest <= max_seconds:
            return False
        report["skipped"].append(what)
        print(f"skipped {what}: the run would pass --max-s {max_seconds:.0f}",
              file=sys.stderr, flush=True)
        return True

    budget = timing.Budget(budget_seconds, len(HARNESSES) * (len(rows) + len(sweep_sizes)),
                           rounds=len(VARIANTS) * ROUNDS)
    report: dict[str, Any] = {
        "benchmark": "fp8", "metadata": timing.run_metadata(),
        "method": {"rounds": ROUNDS, "budget_seconds": budget_seconds,
                   "fp8_min_flops": stack_plan.FP8_MIN_FLOPS, "tables": never_slower.tables_used(),
                   "step": "jax.value_and_grad of a squared error (grid.step_fn)",
                   "ratio": "the other variant's time / this variant's (> 1: faster)",
                   "careful": "rotated inputs, back-to-back calls, one block_until_ready per "
                              "round, median; variants interleaved round by round",
                   "user": "the same inputs every call, otherwise as careful"},
        "rows": {}, "errors": [], "sweep": [], "skipped": []}
    with timing.progress_bar(len(rows) + len(sweep_sizes), "fp8") as bar:
        for name, w in rows.items():
            bar.set_postfix_str(name, refresh=False)
            item_started = time.perf_counter()
            if skip(name):
                bar.update()
                continue
            try:
                report["rows"][name] = {"batch": w.batch, "widths": list(w.widths),
                                        "flops": w.flops("step"),
                                        **measure(w, row_variants(w, only), budget)}
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: the next row may fit)
                report["errors"].append({"name": name, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc(limit=8)})
            report["targets"] = targets(report["rows"])
            report["elapsed_seconds"] = time.perf_counter() - started
            slowest = max(slowest, time.perf_counter() - item_started)
            write(report, out)
            bar.update()
        for rows_, n, layers in sweep_sizes:  # the report is rewritten after every size too
            bar.set_postfix_str(f"sweep {sweep_name(rows_, n, layers)}", refresh=False)
            item_started = time.perf_counter()
            if skip(f"sweep {sweep_name(rows_, n, layers)}"):
                bar.update()
                continue
            report["sweep"].append(sweep_record(rows_, n, layers, budget))
            slowest = max(slowest, time.perf_counter() - item_started)
            report["crossover_gemm_flops"] = {v: crossover(report["sweep"], v)
                                              for v in SWEEP_FP8}
            report["elapsed_seconds"] = time.perf_counter() - started
            write(report, out)
            bar.update()
    report["targets"] = targets(report["rows"])
    report["elapsed_seconds"] = time.perf_counter() - started
    write(report, out)
    return report


# --- report ------------------------------------------------------------------------------------

def _cell(value: Optional[float], fmt: str = ".3f") -> str:
    return "–" if value is None else format(value, fmt)


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = [
        "# FP8 training steps: jax_epilog fp8= against XLA (bf16 and a user's FP8)", "",
        timing.provenance(meta, f"{report.get('elapsed_seconds', 0):.0f} s",
                          f"FP8_MIN_FLOPS {report['method']['fp8_min_flops']:.3g}"), "",
        "One training step (`value_and_grad` of a squared error). Ratios: the other variant's "
        "time / this one's (> 1: this one is faster), careful harness (user harness in "
        "brackets). temp MiB: `memory_analysis().temp_size_in_bytes`. diff: largest |Δ| over "
        "loss and gradients against xla_bf16, relative to each leaf's largest value. FP8 "
        "GEMMs, where each GEMM of the compiled step ran: our cuBLASLt custom calls with FP8 / "
        "other operands, XLA's FP8 GEMMs / XLA's other GEMMs. FALLBACK: the lowering warned "
        "that cuBLASLt runs no FP8 kernel for a GEMM (it ran the plain-XLA reference: not the "
        "real path; listed below).", "",
        "| row | variant | ms | TFLOP/s | vs xla_bf16 | vs xla_fp8 | temp MiB | diff | "
        "GEMMs cuBLASLt FP8/other · XLA FP8/other |", "|---|---|---|---|---|---|---|---|---|"]
    fallbacks = []
    for row, r in report["rows"].items():
        for name, v in r["variants"].items():
            c, u = v.get("careful", {}), v.get("user", {})
            ratios = [f"{_cell(c.get(k))} ({_cell(u.get(k))})"
                      for k in ("ratio_vs_xla_bf16", "ratio_vs_xla_fp8")]
            lines.append(f"| {row} | {name} | {_cell(c.get('seconds', 0) * 1e3)} | "
                         f"{_cell(c.get('tflops'), '.0f')} | {ratios[0]} | {ratios[1]} | "
                         f"{_cell(v['temp_mib'], '.0f')} | {v['relative_diff_vs_xla_bf16']:.3g} "
                         f"| {_gemm_cell(v)} |")
            fallbacks += [f"- {row} {name}: {m}" for m in v.get("fallbacks", [])]
    if fallbacks:
        lines += ["", "## FALLBACK: GEMMs that ran the reference", ""] + fallbacks
    if report.get("targets"):
        lines += ["", "## Targets", "", "Speed: careful harness (user harness); met when both "
                  "reach it.", "", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']:.3f}"
                  f"{' (' + format(t['user'], '.3f') + ')' if 'user' in t else ''} | "
                  f"{'yes' if t['met'] else 'NO'}"
                  f"{' (' + t['note'] + ')' if t.get('note') else ''} |"
                  for t in report["targets"]]
    if report.get("sweep"):
        lines += ["", "## Sweep: training steps of ReLU stacks, rows × n wide × layers", "",
                  "| rows × n × layers | GEMM FLOPs | fp8_pays | "
                  f"ms {' / '.join(SWEEP_VARIANTS)} "
                  f"| {' / '.join(SWEEP_FP8)} vs best bf16 |", "|---|---|---|---|---|"]
        for s in report["sweep"]:
            ms = " / ".join(_cell(s["ms"][v]) for v in SWEEP_VARIANTS) if "ms" in s \
                else s.get("error", "–")
            ratios = " / ".join(_cell(s.get("fp8_vs_best_bf16", {}).get(v)) for v in SWEEP_FP8)
            flag = " FALLBACK" if s.get("fallbacks") else ""
            lines.append(f"| {s['rows']} × {s['n']} × {s['layers']} | {s['gemm_flops']:.3g} | "
                         f"{s['fp8_pays']} | {ms} | {ratios}{flag} |")
        for v, flops in report.get("crossover_gemm_flops", {}).items():
            lines += ["", f"{v} faster than the best bf16 from {_cell(flops, '.3g')} GEMM "
                      "FLOPs up (at every larger measured size)."]
    if report.get("skipped"):
        lines += ["", "Skipped (the run's --max-s): " + ", ".join(report["skipped"])]
    if report["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['name']}: {e['error']}"
                                          for e in report["errors"]]
    lines += timing.footnotes(meta, [])
    return "\n".join(lines) + "\n"


def _gemm_cell(v: dict[str, Any]) -> str:
    g = v["gemms"]
    cell = f"{g['ours_fp8']}/{g['ours_other']} · {g['xla_fp8']}/{g['xla_other']}"
    return cell + (" **FALLBACK**" if v.get("fallbacks") else "")


def write(report: dict[str, Any], out: Path) -> None:
    timing.write_report(report, out, "fp8", markdown)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", help="comma-separated: M1,G1,M2 (default: all; smoke: S1,S2)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time square dense layers to find FP8's crossover")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds over which the timed rounds are spread (default 120; "
                             "smoke 20)")
    parser.add_argument("--max-s", type=float, default=270.0,
                        help="wall-clock bound of the whole run, compilation included: rows "
                             "and sweep sizes that would end later are skipped (default 270)")
    parser.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)} "
                        "(default: all; xla_bf16 is always measured)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    args = parser.parse_args(argv)
    table = SMOKE_ROWS if args.smoke else ROWS
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else list(table)
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; expected some of {', '.join(table)}")
    sweep = (SMOKE_SWEEP if args.smoke else SWEEP) if args.sweep else []
    budget = args.budget_s if args.budget_s is not None else (20.0 if args.smoke else 120.0)
    only = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants \
        else None
    if only and sorted(set(only) - set(VARIANTS)):
        parser.error(f"--variants: unknown {sorted(set(only) - set(VARIANTS))}")
    report = run({name: table[name] for name in wanted}, sweep, min(budget, args.max_s),
                 args.out, args.max_s, only)
    for row, r in report["rows"].items():
        for name, v in r["variants"].items():
            print(f"{row} {name}: GEMMs cuBLASLt FP8/other · XLA FP8/other {_gemm_cell(v)}")
    for t in report["targets"]:
        print(f"{t['target']}: {t['value']:.3f}"
              f"{' (' + format(t['user'], '.3f') + ')' if 'user' in t else ''} "
              f"{'met' if t['met'] else 'MISSED'}"
              f"{' (' + t['note'] + ')' if t.get('note') else ''}")
    if report["skipped"]:
        print(f"skipped (--max-s {args.max_s:.0f}): {', '.join(report['skipped'])}")
    if args.sweep:
        print(f"FP8 crossover: {report.get('crossover_gemm_flops')} GEMM FLOPs "
              f"(FP8_MIN_FLOPS is {stack_plan.FP8_MIN_FLOPS:.3g})")
    print(f"wrote {args.out}/fp8.json, fp8.md ({len(report['errors'])} errors)")
    return report


if __name__ == "__main__":
    main()
