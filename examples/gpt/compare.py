"""The four GPT variants side by side, in one process: speed, memory, time to the first step and
validation loss, for either arch of `model.py` (GPT-2's `tiny`/`small`/`large`, Llama's
`llama_tiny`/`llama_small`/`llama_large`).

    python examples/gpt/compare.py --config tiny --steps 8 --out /tmp/gpt_compare     # CPU
    python examples/gpt/compare.py --config small large --budget-s 360 --out examples/gpt/results
    python examples/gpt/compare.py --config llama_large --steps 300 --budget-s 900 --out /tmp/llama

Variants, in the compute dtype (bfloat16 on a GPU, float32 elsewhere): `stock` (`nnx.Linear`),
`flax_fp8` (Flax's own FP8, `Fp8DirectDotGeneralOp`), `epilog` (jax-epilog's layers) and
`epilog_fp8` (with `train.FP8_RECIPE`), all from the same initial weights (checked by a
fingerprint of the parameters) and trained on the same batches in the same order.
`--variants` picks among them and `epilog_fp8_block` (jax-epilog's layers with the
block-scaled recipe, `train.FP8_BLOCK_RECIPE`) and `stock_fp8` (the `stock` model, its code
unchanged, trained on jax-epilog's FP8 GEMMs by one call, `jax_epilog.nnx.fp8_training(model,
fp8=train.FP8_RECIPE)`: docs/stock_models.md), which run only when named:

    python examples/gpt/compare.py --config large --variants epilog,epilog_fp8,epilog_fp8_block \
        --steps 300 --budget-s 540 --out /tmp/block

Per config:
1. Build and compile each variant's train step (compile time; `memory_analysis()`), and run
   its first step alone, on a copy of the initial state: the time to the first step is the
   two together (compilation, XLA's autotuning, whatever the first call does besides).
2. Train each variant `--steps` steps (fewer if the budget would not hold them, the same number
   for every variant; the learning-rate schedule spans `--steps`) from the shared initial
   weights, with the validation loss every `eval_every` steps and at the end. This is also
   the *user* harness: a plain loop with the host making each batch, timed by the wall clock
   over back-to-back steps (one `block_until_ready` per stretch between evaluations), the
   first steps left out as warm-up.
3. The *careful* harness on the trained states: warm-up, then rounds of back-to-back steps
   with one `block_until_ready` per round, the variants' rounds interleaved so drift on a
   shared machine hits them alike; the median round (`benchmarks/timing.py`).

Writes `gpt_compare.json` (everything, with versions) and `gpt_compare.md` to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: `gpt` (this folder) and the benchmark helpers
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import jax
import numpy as np

import timing
from gpt import configs, data, model, train

#: (name, impl, jax-epilog's FP8 recipe: None or a `train.FP8_SCALINGS` name): the first is
#: the baseline every ratio divides by.
VARIANTS = (("stock", "stock", None), ("flax_fp8", "flax_fp8", None),
            ("epilog", "epilog", None), ("epilog_fp8", "epilog", "per-tensor"),
            ("epilog_fp8_block", "epilog", "block"), ("stock_fp8", "stock", "per-tensor"))
#: What runs without `--variants`: all but the block-scaled recipe (`--variants` adds it).
DEFAULT_VARIANTS = ("stock", "flax_fp8", "epilog", "epilog_fp8")
#: Issue 25's targets: (config, variant, baseline, minimum speed-up).
SPEED_TARGETS = (("large", "epilog_fp8", "stock", 1.25),
                 ("small", "epilog_fp8", "stock", 1.15),
                 ("large", "epilog_fp8", "flax_fp8", 1.05),
                 ("small", "epilog_fp8", "flax_fp8", 1.05),
                 ("large", "epilog", "stock", 0.98),
                 ("small", "epilog", "stock", 0.98),
                 # issue 38's, on the Llama arch
                 ("llama_large", "epilog_fp8", "stock", 1.5),
                 ("llama_large", "epilog_fp8", "flax_fp8", 1.08),
                 # issue 39's, the block-scaled recipe
                 ("large", "epilog_fp8_block", "stock", 1.3),
                 # issue 62's: the stock model by one call, against our layers and Flax's FP8
                 ("large", "stock_fp8", "epilog_fp8", 0.97),
                 ("large", "stock_fp8", "flax_fp8", 1.0),
                 ("llama_large", "stock_fp8", "epilog_fp8", 0.97),
                 ("llama_large", "stock_fp8", "flax_fp8", 1.0))
#: Issue 38's: (config, variant, peer, the most the variant's time to the first step may be as
#: a fraction of the peer's).
FIRST_STEP_TARGETS = (("llama_large", "epilog_fp8", "flax_fp8", 0.2),)
LOSS_TOLERANCE = 0.01  # FP8's final validation loss within 1% of the same layers' without FP8
WARMUP_STEPS = 2       # left out of the user harness
CAREFUL_ROUNDS = 5
GEMM_CALLS = {"jax_epilog": "jax_epilog_matmul", "jax_epilog_block": "jax_epilog_matmul_block",
              "xla_fp8": "__cublas$lt$matmul$f8"}


def fingerprint(params) -> str:
    """SHA-256 of every parameter's path, dtype, shape and bytes: equal iff the weights are."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        value = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


_FP8_TYPE = re.compile(r"\bf8e(?:4m3fn|5m2)\[")
# `%name = TYPE opcode(operands...`: an instruction of HLO text (ROOT or not).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*?)\s([a-z][a-z0-9-]*)\(([^)]*)")
_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(matmul|gemm)', re.IGNORECASE)


def fp8_gemms(hlo: str) -> int:
    """The GEMMs of a compiled program that read FP8 operands: dots (also those inside a
    Triton or cuDNN GEMM fusion) and custom calls to a GEMM (XLA's `__cublas$lt$matmul$f8`,
    jax-epilog's `jax_epilog_matmul`). Operand types are read inline where HLO text prints
    them, else from the operand's own instruction. On a CPU there are none: XLA converts FP8
    values back to the compute dtype before its dots, so an FP8 layer there rounds like one but
    multiplies in float32."""
    types, gemm_operands = {}, []
    for line in hlo.splitlines():
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        name, type_, opcode, operands = found.groups()
        types[name] = type_
        if opcode == "dot" or (opcode == "custom-call" and _GEMM_TARGET.search(line)):
            gemm_operands.append(operands)
    return sum(1 for operands in gemm_operands
               if _FP8_TYPE.search(operands) or any(
                   _FP8_TYPE.search(types.get(name, ""))
                   for name in re.findall(r"%([^\s,]+)", operands)))


@dataclasses.dataclass
class Variant:
    name: str
    trainer: train.Trainer
    compiled: Any
    state: Any
    record: dict


def build(config: configs.TrainConfig, name: str, impl: str, fp8, dtype,
          attention: str, batch) -> Variant:
    """One variant's model and compiled step; `fp8`: its recipe's `train.FP8_SCALINGS` name,
    or None (True and False, as `train.build_model` takes them, also work)."""
    start = time.perf_counter()
    scaling = fp8 if isinstance(fp8, str) else "per-tensor"
    # stock_fp8: the stock model's code unchanged, switched by one call (train.build_model)
    model = train.build_model(config, impl, fp8=bool(fp8), dtype=dtype,
                              attention=attention, fp8_scaling=scaling)
    trainer = train.Trainer(model, train.make_optimizer(config))
    compiled, memory = trainer.compile(trainer.initial, batch)
    compile_s = time.perf_counter() - start
    # The compiled step's first call, on a copy of the start (the step donates its state).
    first = time.perf_counter()
    _, metrics = compiled(jax.tree.map(lambda a: a.copy(), trainer.initial), *batch)
    jax.block_until_ready(metrics)
    first_step_s = time.perf_counter() - first
    hlo = compiled.as_text() or ""
    record = {
        "impl": impl, "fp8": bool(fp8),
        "fp8_recipe": repr(train.fp8_recipe(scaling)) if fp8 else None,
        "attention": model.blocks[0].attention.implementation,
        "initial_params_sha256": fingerprint(trainer.initial.params),
        "build_and_compile_s": compile_s, "first_step_s": first_step_s,
        "time_to_first_step_s": compile_s + first_step_s, "memory": memory,
        "gemm_custom_calls": {k: hlo.count(f'custom_call_target="{v}"')
                              for k, v in GEMM_CALLS.items()},
        # FP8 values in the compiled step (none: no layer is FP8, e.g. `Fp8()`'s rule keeps a
        # small model's layers 16-bit) and the GEMMs on FP8 operands (none: FP8 targets do
        # not apply; on a CPU XLA converts FP8 values back before its dots).
        "fp8_in_program": bool(re.search(r"\bf8e(4m3fn|5m2)\b", hlo)),
        "fp8_gemms": fp8_gemms(hlo),
    }
    return Variant(name, trainer, compiled, trainer.initial, record)


def train_and_evaluate(variant: Variant, config: configs.TrainConfig, corpus: data.Corpus,
                       steps: int, validation) -> None:
    """`steps` training steps from the shared start, the user harness timing them (module
    docstring); `variant.state` ends trained, `variant.record` gets the losses and times."""
    batches = data.Batches(corpus.train, config.batch_size, config.model.seq_len, config.seed)
    state, losses, validation_losses = variant.state, [], []
    timed_seconds, timed_steps = 0.0, 0
    done = 0
    while done < steps:
        stop = min(steps, (done // config.eval_every + 1) * config.eval_every)
        if done < WARMUP_STEPS:
            stop = min(stop, WARMUP_STEPS)
        start = time.perf_counter()
        metrics = []
        for _ in range(done, stop):
            state, step_metrics = variant.compiled(state, *next(batches))
            metrics.append(step_metrics["loss"])
        jax.block_until_ready(state)
        if done >= WARMUP_STEPS:
            timed_seconds += time.perf_counter() - start
            timed_steps += stop - done
        losses += [float(loss) for loss in metrics]
        done = stop
        if done % config.eval_every == 0 or done == steps:
            validation_losses.append((done, variant.trainer.validation_loss(state, validation)))
    variant.state = state
    step_time = timed_seconds / timed_steps if timed_steps else None
    variant.record.update(
        train_loss=losses, validation_loss=validation_losses,
        user_harness={"step_s": step_time, "steps_timed": timed_steps,
                      "tokens_per_s": config.tokens_per_step / step_time if step_time else None})


def time_careful(variants: list[Variant], config: configs.TrainConfig, corpus: data.Corpus,
                 round_seconds: float) -> None:
    """The careful harness (module docstring), continuing each variant's trained state on a
    few fixed batches; the states are consumed."""
    timing_batches = data.Batches(corpus.train, config.batch_size, config.model.seq_len,
                                  seed=config.seed + 1)
    arg_sets = [tuple(jax.device_put(a) for a in timing_batches.batch(i)) for i in range(3)]

    def stepper(variant: Variant):
        def step(inputs, targets):
            variant.state, metrics = variant.compiled(variant.state, inputs, targets)
            return metrics["loss"]  # ready only once every earlier step of the chain is
        return step

    times = timing.time_interleaved({v.name: (stepper(v), arg_sets) for v in variants},
                                    rounds=CAREFUL_ROUNDS, round_seconds=round_seconds,
                                    warmup_calls=WARMUP_STEPS)
    for v in variants:
        t = times[v.name]
        v.record["careful_harness"] = {**t.as_dict(), "step_s": t.seconds,
                                       "tokens_per_s": config.tokens_per_step / t.seconds}


def _failure(config_name: str, name: str, stage: str, error: Exception) -> str:
    """An error that stops one variant, as recorded (the other variants go on)."""
    message = f"{stage}: {type(error).__name__}: {error}"[:2000]
    print(f"{config_name} {name}: FAILED in {message}", file=sys.stderr, flush=True)
    return message


def compare_config(config_name: str, config: configs.TrainConfig, corpus: data.Corpus,
                   steps: int, budget_s: float, dtype, attention: str,
                   names=DEFAULT_VARIANTS) -> dict[str, Any]:
    deadline = time.perf_counter() + budget_s
    # The learning-rate schedule spans the measured steps, so the run ends decayed, where one
    # validation loss is a fair comparison: cut at the config's 400-step schedule's step 150,
    # the rate was still near its peak, and the validation losses of two FP8 variants moved by
    # 3% between evaluations while their training losses agreed within 1%.
    config = config.replace(steps=steps, warmup_steps=min(config.warmup_steps, steps // 2))
    validation = data.validation_batches(corpus.validation, config.batch_size,
                                         config.model.seq_len, config.eval_batches)
    first_batch = data.Batches(corpus.train, config.batch_size, config.model.seq_len,
                               config.seed).batch(0)
    variants, failed = [], {}
    for name, impl, fp8 in (v for v in VARIANTS if v[0] in names):
        try:
            variants.append(build(config, name, impl, fp8, dtype, attention, first_batch))
        except Exception as error:  # noqa: BLE001 -- recorded; the other variants still run
            failed[name] = _failure(config_name, name, "build and compile", error)
            continue
        print(f"{config_name} {name}: built and compiled in "
              f"{variants[-1].record['build_and_compile_s']:.1f} s", flush=True)
    if not variants:
        raise RuntimeError(f"{config_name}: every variant failed: {failed}")
    fingerprints = {v.record["initial_params_sha256"] for v in variants}
    if len(fingerprints) != 1:
        raise AssertionError(f"the variants start from different weights: {fingerprints}")

    # A step of the first variant after a warm-up one estimates a step, to fit the steps into
    # the budget (the careful harness keeps about a quarter of what is left).
    estimate_state = jax.tree.map(lambda a: a.copy(), variants[0].state)
    step_estimate = 0.0
    for _ in range(2):
        probe = time.perf_counter()
        estimate_state, metrics = variants[0].compiled(estimate_state, *first_batch)
        jax.block_until_ready(metrics)
        step_estimate = time.perf_counter() - probe
    del estimate_state
    room = 0.75 * (deadline - time.perf_counter())
    evals = steps // config.eval_every + 1
    eval_estimate = config.eval_batches * step_estimate / 3 * evals  # a forward: ~1/3 step
    fitting = int((room / len(variants) - eval_estimate) / (1.25 * step_estimate))
    run_steps = max(WARMUP_STEPS + 1, min(steps, fitting))
    for v in list(variants):
        try:
            train_and_evaluate(v, config, corpus, run_steps, validation)
        except Exception as error:  # noqa: BLE001 -- recorded; the other variants still run
            failed[v.name] = _failure(config_name, v.name, "training", error)
            variants.remove(v)
            continue
        print(f"{config_name} {v.name}: {run_steps} steps, validation loss "
              f"{v.record['validation_loss'][-1][1]:.4f}", flush=True)
    left = max(0.0, deadline - time.perf_counter())
    round_seconds = min(2.0, max(3 * step_estimate, left / (CAREFUL_ROUNDS + 3) / len(variants)))
    time_careful(variants, config, corpus, round_seconds)
    return {"config": dataclasses.asdict(config), "steps": run_steps,
            "steps_requested": steps, "tokens_per_step": config.tokens_per_step,
            "budget_s": budget_s, "elapsed_s": budget_s - (deadline - time.perf_counter()),
            "variants": {v.name: v.record for v in variants}, "failed": failed}


def speedups(result: dict, baseline: str) -> dict[str, dict[str, Optional[float]]]:
    """Each variant's tokens/s over `baseline`'s, per harness."""
    out, base = {}, result["variants"].get(baseline)
    for name, record in result["variants"].items():
        out[name] = {}
        for harness in ("careful_harness", "user_harness"):
            ours, theirs = record[harness]["step_s"], base and base[harness]["step_s"]
            out[name][harness] = theirs / ours if ours and theirs else None
    return out


def targets(results: dict[str, dict]) -> list[dict]:
    """Issue 25's targets for the configs that ran; a speed target is met when both harnesses
    reach it. A target about an FP8 variant in which no FP8 GEMM ran (`idle_fp8`) is not
    applicable: `met` None, `not_applicable` says why."""
    rows = []
    for config_name, variant, baseline, minimum in SPEED_TARGETS:
        ran = results.get(config_name, {"variants": {}})
        if not {variant, baseline} <= {*ran["variants"], *ran.get("failed", {})}:
            continue  # not asked for (`--variants`)
        ratio = speedups(results[config_name], baseline).get(
            variant, {"careful_harness": None, "user_harness": None})
        rows.append(_unless_idle_fp8(results[config_name], (variant, baseline), {
            "target": f"{config_name}: {variant} >= {minimum}x {baseline} tokens/s",
            "careful": ratio["careful_harness"], "user": ratio["user_harness"],
            "met": all(r is not None and r >= minimum for r in ratio.values())}))
    for config_name, variant, peer, most in FIRST_STEP_TARGETS:
        found = results.get(config_name, {"variants": {}})["variants"]
        if variant not in found or peer not in found:
            continue
        fraction = found[variant]["time_to_first_step_s"] / found[peer]["time_to_first_step_s"]
        rows.append({"target": f"{config_name}: {variant}'s time to the first step <= {most}x "
                               f"{peer}'s", "fraction": fraction, "met": fraction <= most})
    for config_name, result in results.items():
        final = {n: r["validation_loss"][-1][1] for n, r in result["variants"].items()}
        for fp8_name, bf16_name in (("epilog_fp8", "epilog"), ("epilog_fp8_block", "epilog"),
                                    ("flax_fp8", "stock"), ("stock_fp8", "stock")):
            if fp8_name not in final or bf16_name not in final:
                continue
            relative = final[fp8_name] / final[bf16_name] - 1
            rows.append(_unless_idle_fp8(result, (fp8_name,), {
                "target": f"{config_name}: {fp8_name} validation loss within "
                          f"{LOSS_TOLERANCE:.0%} of {bf16_name}'s",
                "relative_difference": relative, "met": abs(relative) <= LOSS_TOLERANCE}))
    return rows


def idle_fp8(result: dict) -> dict[str, str]:
    """The FP8 variants (Flax's or jax-epilog's) of one config's result in which no FP8 GEMM
    ran, each with why. A record from before `fp8_gemms` was counted is taken as FP8."""
    idle = {}
    for name, record in result["variants"].items():
        if not (record["fp8"] or record["impl"] == "flax_fp8") or \
                record.get("fp8_gemms", 1) > 0:
            continue
        idle[name] = ("its FP8 values are converted back to the compute dtype before every "
                      "GEMM: FP8's rounding without FP8 GEMMs" if record.get("fp8_in_program")
                      else "no layer is FP8: `Fp8()` found none whose GEMMs are large enough "
                           "to gain from it")
    return idle


def _unless_idle_fp8(result: dict, names, row: dict) -> dict:
    idle = [n for n in names if n in idle_fp8(result)]
    if idle:
        row.update(met=None, not_applicable=f"no FP8 GEMM ran in {' or '.join(idle)}")
    return row


def _mib(memory: Optional[dict]) -> str:
    return f"{memory['temp_size_in_bytes'] / 2**20:,.0f}" if memory else "n/a"


def render(report: dict) -> str:
    meta = report["metadata"]
    lines = ["# GPT training step: the variants side by side", "",
             f"{meta['date']}, {meta['device']} ({meta['platform']}), jax {meta['jax']}, "
             f"flax {report['versions']['flax']}, optax {report['versions']['optax']}, "
             f"cuBLASLt {meta['cublaslt_version']}, driver {meta['driver_version']}. "
             f"Compute dtype {report['dtype']}. Method: examples/gpt/compare.py's docstring. "
             "Speed-ups are the baseline's step time over the variant's, careful harness (user "
             "harness in brackets).", ""]
    if meta["platform"] != "gpu":
        lines += ["Not a GPU: every variant runs plain XLA, so the speeds measure only this "
                  "machine; the losses are the comparison.", ""]
    for config_name, result in report["results"].items():
        idle = idle_fp8(result)
        if idle:
            lines += [f"{config_name}: no FP8 GEMM ran in " + " nor in ".join(
                f"{name} ({why})" for name, why in idle.items()) +
                ", so the FP8 targets about them are not applicable.", ""]
    for config_name, result in report["results"].items():
        model = result["config"]["model"]
        ratios = speedups(result, "stock")
        over_flax = speedups(result, "flax_fp8")
        lines += [f"## {config_name}: {_shape(model)}, "
                  f"{result['tokens_per_step']} tokens per step, {result['steps']} steps", "",
                  "| variant | tokens/s | step ms | vs stock | vs flax_fp8 | temporaries MiB "
                  "| compile s | first step s | validation loss | training loss, last 10 steps "
                  "| cuBLASLt calls (ours / XLA FP8) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in result["variants"].items():
            careful, user = r["careful_harness"], r["user_harness"]
            user_ms = f"{user['step_s'] * 1e3:.1f}" if user["step_s"] else "n/a"
            calls = r["gemm_custom_calls"]
            lines.append(
                f"| {name} | {careful['tokens_per_s']:,.0f} | {careful['step_s'] * 1e3:.1f} "
                f"({user_ms}) | {_ratio(ratios[name])} | {_ratio(over_flax[name])} | "
                f"{_mib(r['memory'])} | {r['build_and_compile_s']:.1f} | "
                f"{_seconds(r.get('time_to_first_step_s'))} | "
                f"{r['validation_loss'][-1][1]:.4f} | "
                f"{statistics.fmean(r['train_loss'][-10:]):.4f} | "
                f"{calls['jax_epilog'] + calls.get('jax_epilog_block', 0)} / {calls['xla_fp8']} |")
        lines += [f"| {name} | failed: {error} | | | | | | | | | |"
                  for name, error in result["failed"].items()]
        lines.append("")
    lines += ["## Targets", "", "| target | value | met |", "|---|---|---|"]
    for row in report["targets"]:
        if "relative_difference" in row:
            value = f"{row['relative_difference']:+.2%}"
        elif "fraction" in row:
            value = f"{row['fraction']:.3f}x"
        else:
            value = _ratio({"careful_harness": row["careful"], "user_harness": row["user"]})
        met = ("yes" if row["met"] else "no") if row["met"] is not None else \
            f"not applicable ({row['not_applicable']})"
        lines.append(f"| {row['target']} | {value} | {met} |")
    lines += timing.footnotes(meta, [])
    return "\n".join(lines) + "\n"


def _seconds(value: Optional[float]) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def _shape(model: dict) -> str:
    """The table heading's architecture (records from before `arch` are GPT-2's)."""
    shape = f"d_model {model['d_model']}, {model['n_layers']} layers"
    if model.get("arch", "gpt") == "gpt":
        return shape
    return (f"{model['arch']}: {shape}, {model['n_heads']} query / "
            f"{model['n_kv_heads'] or model['n_heads']} key-value heads, SwiGLU hidden "
            f"{model['mlp_hidden'] or model['mlp_ratio'] * model['d_model']}")


def _ratio(pair: dict) -> str:
    careful, user = pair["careful_harness"], pair["user_harness"]
    return (f"{careful:.3f}" if careful else "n/a") + (f" ({user:.3f})" if user else "")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["tiny"], choices=tuple(configs.CONFIGS))
    parser.add_argument("--steps", type=int, default=150,
                        help="training steps per variant for the loss comparison (fewer if "
                             "the budget cannot hold them)")
    parser.add_argument("--eval-every", type=int, help="override the configs' eval_every")
    parser.add_argument("--layers", type=int, help="override the configs' n_layers")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="seconds for the whole run, split evenly between the configs")
    parser.add_argument("--dtype", default="auto", choices=tuple(train.DTYPES))
    parser.add_argument("--attention", default="auto", choices=model.ATTENTION)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and .md")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of: {', '.join(v[0] for v in VARIANTS)} "
                             f"(default: {','.join(DEFAULT_VARIANTS)}; stock always runs, the "
                             "ratios' baseline)")
    args = parser.parse_args(argv)
    names = {"stock", *(n.strip() for n in args.variants.split(",") if n.strip())}
    unknown = sorted(names - {v[0] for v in VARIANTS})
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected names of "
                     f"{[v[0] for v in VARIANTS]}")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps: expected more than the {WARMUP_STEPS} warm-up steps")
    corpus = data.load_corpus()
    dtype = train.compute_dtype(args.dtype)
    start = time.perf_counter()
    report = {"benchmark": "gpt_compare", "metadata": timing.run_metadata(),
              "versions": train.versions(), "dtype": np.dtype(dtype).name,
              "corpus": {"root": corpus.root, "train_bytes": len(corpus.train),
                         "validation_bytes": len(corpus.validation),
                         "train_files": len(corpus.train_files),
                         "validation_files": len(corpus.validation_files)},
              "results": {}}
    for i, name in enumerate(args.config):
        budget = (args.budget_s - (time.perf_counter() - start)) / (len(args.config) - i)
        overrides = {"eval_every": args.eval_every, "n_layers": args.layers}
        config = configs.get(name).replace(**{k: v for k, v in overrides.items() if v})
        report["results"][name] = compare_config(name, config, corpus, args.steps, budget,
                                                 dtype, args.attention, names)
        report["targets"] = targets(report["results"])
        # Written after every config, so a run stopped later keeps what it finished.
        timing.write_report(report, args.out, "gpt_compare", render)
    return report


if __name__ == "__main__":
    main()
