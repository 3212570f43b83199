"""Autotuning of cuBLASLt algorithms: what it costs on a problem's first call, what it gains after.

For G1, G3 and G6 (bf16), two problems each: the forward RELU_AUX_BIAS `x @ W + b` and the
backward DRELU_BGRAD `dy @ Wᵀ` (transpose_b). Each measurement runs in a fresh process (the
parent never touches the GPU), after a small unrelated warm-up call there that pays the one-time
costs (JAX start-up, library load, cuBLASLt handle):
  - first call, three processes: autotuning off; on with an empty autotune file (every problem
    is tuned); on with the file the previous process wrote (tuned algorithms read back). Each
    records the seconds of lowering + compilation (planning included) and of the first
    execution (the initialize stage, where tuning happens, included), host-timed.
  - steady state, one process: rounds alternate the heuristic's plan and the tuned one
    (`clear_plan_cache` + `set_autotune` between them, the tuned algorithm read from the file),
    device-timed median seconds per call of each, and their ratio.
The tuning log (each candidate's time, the choice) is kept. Results: `<out>/autotune.{json,md}`.

    python benchmarks/autotune_bench.py --out benchmarks/results
    python benchmarks/autotune_bench.py --smoke --out /tmp/smoke    # tiny shapes, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

import forward_bench
import jax_epilog
import timing
from jax_epilog import Epilog, config, relu_mask_bytes
from jax_epilog.runtime import library as cuda_library
from jax_epilog import matmul as epilog_matmul

ROWS = ("G1", "G3", "G6")
SMOKE_ROWS = ("S1", "S2")
# name: (epilog, transpose_b)
PROBLEMS = {"forward RELU_AUX_BIAS": (Epilog.RELU_AUX_BIAS, False),
            "backward DRELU_BGRAD": (Epilog.DRELU_BGRAD, True)}
FIRST_CALL_MODES = {  # mode: autotuning on, autotune file emptied first
    "off": (False, True), "on, cold file": (True, True), "on, warm file": (True, False)}
ALTERNATIONS = 5
ROUND_SECONDS = 0.05
RESULT_PREFIX = "RESULT "
TUNING_LOG_PREFIX = "jax_epilog autotune:"


# --- inside a child process ---------------------------------------------------------------

def problem(shape: tuple[int, int, int], name: str, seed: int = 0) -> tuple[Callable, list]:
    """The jitted call and its input sets (rotated through when they would sit in L2)."""
    epilog, transpose_b = PROBLEMS[name]
    batch, k, n = shape
    # Forward: x[B, K] @ W[K, N] + b. Backward: dy[B, N] @ W[K, N]ᵀ with the forward's mask.
    rows, inner, cols = (batch, k, n) if not transpose_b else (batch, n, k)
    bytes_per_call = 2 * (rows * inner + inner * cols + rows * cols)
    sets = []
    for key in jax.random.split(jax.random.key(seed), timing.input_copies(bytes_per_call)):
        ka, kb, ke = jax.random.split(key, 3)
        a = jax.random.normal(ka, (rows, inner), jnp.bfloat16)
        b_shape = (cols, inner) if transpose_b else (inner, cols)
        b = (jax.random.normal(kb, b_shape, jnp.float32) / inner ** 0.5).astype(jnp.bfloat16)
        if epilog == Epilog.RELU_AUX_BIAS:
            extra = {"bias": (0.1 * jax.random.normal(ke, (cols,))).astype(jnp.bfloat16)}
        else:
            extra = {"relu_aux": jax.random.randint(ke, (rows, relu_mask_bytes(cols)), 0, 256,
                                                    jnp.int32).astype(jnp.uint8)}
        sets.append((a, b, extra))

    def call(a, b, extra):
        return epilog_matmul(a, b, epilog=epilog, transpose_b=transpose_b, epilog_inputs=extra)

    return jax.jit(call), jax.block_until_ready(sets)


def warm_up() -> None:
    jitted, sets = problem((64, 48, 40), "forward RELU_AUX_BIAS", seed=1)
    jax.block_until_ready(jitted(*sets[0]))


def first_calls(grid: dict, rows: list[str]) -> list[dict[str, Any]]:
    records = []
    for row in rows:
        for name in PROBLEMS:
            jitted, sets = problem(grid[row], name)
            start = time.perf_counter()
            compiled = jitted.lower(*sets[0]).compile()
            compiled_at = time.perf_counter()
            jax.block_until_ready(compiled(*sets[0]))
            first_at = time.perf_counter()
            jax.block_until_ready(compiled(*sets[0]))
            records.append({
                "row": row, "problem": name, "compile_s": compiled_at - start,
                "first_execution_s": first_at - compiled_at,
                "second_execution_s": time.perf_counter() - first_at,
                "custom_call": timing.uses_custom_call(jitted, *sets[0])})
    return records


def steady_state(grid: dict, rows: list[str], alternations: int) -> list[dict[str, Any]]:
    records = []
    for row in rows:
        for name in PROBLEMS:
            jitted, sets = problem(grid[row], name)
            seconds = {"heuristic": [], "tuned": []}
            for _ in range(alternations):
                for mode, per_call in seconds.items():
                    cuda_library.clear_plan_cache()
                    config.set_autotune(mode == "tuned")
                    t = timing.time_calls(jitted, sets, rounds=3, round_seconds=ROUND_SECONDS)
                    per_call.extend(t.rounds)
            median = {mode: statistics.median(values) for mode, values in seconds.items()}
            records.append({
                "row": row, "problem": name, "seconds": seconds,
                "heuristic_us": median["heuristic"] * 1e6, "tuned_us": median["tuned"] * 1e6,
                "speedup": median["heuristic"] / median["tuned"],
                "tflops_tuned": timing.tflops(timing.gemm_flops(*grid[row]), median["tuned"])})
    return records


def child(args: argparse.Namespace) -> None:
    grid = forward_bench.SMOKE_GRID if args.smoke else forward_bench.GRID
    rows = args.rows.split(",")
    warm_up()
    if args.child == "first":
        records = first_calls(grid, rows)
    else:
        records = steady_state(grid, rows, 1 if args.smoke else ALTERNATIONS)
    result = {"records": records, "metadata": timing.run_metadata(),
              "autotune_enabled": config.autotune_enabled()}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --- the parent: one child per measurement ------------------------------------------------

def run_child(kind: str, rows: list[str], smoke: bool, env: dict[str, str]) -> dict[str, Any]:
    # The child imports the jax_epilog this process uses, however it was found.
    package_root = str(Path(jax_epilog.__file__).resolve().parents[1])
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                              env.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--child", kind, "--rows", ",".join(rows)]
    done = subprocess.run(command + (["--smoke"] if smoke else []), env=env, capture_output=True,
                          text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not results:
        raise SystemExit(f"{kind} child failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(results[-1][len(RESULT_PREFIX):])
    result["tuning_log"] = [line for line in done.stderr.splitlines()
                            if line.startswith(TUNING_LOG_PREFIX)]
    return result


def run(rows: list[str], smoke: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"rows": rows, "problems": list(PROBLEMS), "first_call": {},
                              "tuning_log": {}}
    with tempfile.TemporaryDirectory() as folder, timing.progress_bar(
            len(FIRST_CALL_MODES) + 1, "autotune") as bar:
        cache = Path(folder) / "autotune.txt"
        env = dict(os.environ, JAX_EPILOG_AUTOTUNE_CACHE=str(cache), JAX_EPILOG_AUTOTUNE_LOG="1")
        for mode, (enabled, empty_file) in FIRST_CALL_MODES.items():
            bar.set_postfix_str(f"first call, autotune {mode}", refresh=False)
            if empty_file:
                cache.unlink(missing_ok=True)
            result = run_child("first", rows, smoke, {**env, config.AUTOTUNE_ENV: str(int(enabled))})
            report["first_call"][mode] = result["records"]
            report["tuning_log"][mode] = result["tuning_log"]
            report["metadata"] = result["metadata"]
            bar.update()
        bar.set_postfix_str("steady state", refresh=False)
        result = run_child("steady", rows, smoke, {**env, config.AUTOTUNE_ENV: "0"})
        report["steady"] = result["records"]
        report["tuning_log"]["steady state"] = result["tuning_log"]
        report["autotune_file_lines"] = cache.read_text().count("\n") if cache.exists() else 0
        bar.update()
    return report


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    modes = list(FIRST_CALL_MODES)
    lines = [
        "# Autotuning: first-call cost and steady-state gain",
        "",
        f"{meta['date']}, {meta.get('gpu_name') or meta['device']}, driver "
        f"{meta.get('driver_version')}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, cuBLASLt "
        f"{meta['cublaslt_version']}, custom call active: {meta['custom_call_active']}. bf16.",
        "",
        "First call (host-timed seconds, fresh process after a warm-up call): lowering + "
        "compilation / first execution (initialize stage, where tuning runs, included).",
        "",
        "| row | problem | " + " | ".join(f"compile, {m}" for m in modes) + " | "
        + " | ".join(f"1st exec, {m}" for m in modes) + " | tuning cost (s) |",
        "|---|---|" + "---:|" * (2 * len(modes) + 1),
    ]
    by_mode = {m: {(r["row"], r["problem"]): r for r in report["first_call"][m]} for m in modes}
    for key, off in by_mode["off"].items():
        cells = [f"{by_mode[m][key]['compile_s']:.3f}" for m in modes]
        cells += [f"{by_mode[m][key]['first_execution_s']:.4f}" for m in modes]
        cost = (by_mode["on, cold file"][key]["first_execution_s"] + by_mode["on, cold file"][key][
            "compile_s"]) - (off["first_execution_s"] + off["compile_s"])
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {cost:+.3f} |")
    lines += [
        "",
        "Steady state (device-timed median µs per call over alternating rounds, one process):",
        "",
        "| row | problem | heuristic µs | tuned µs | speedup | tuned TFLOP/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report["steady"]:
        lines.append(f"| {r['row']} | {r['problem']} | {r['heuristic_us']:.1f} | "
                     f"{r['tuned_us']:.1f} | {r['speedup']:.3f}× | {r['tflops_tuned']:.0f} |")
    lines += ["", f"Autotune file: {report['autotune_file_lines']} lines. Tuning log of the "
              "cold-file process (ms per launch of each candidate in the heuristic's order, and "
              "the one chosen; the warm-up problem included):", ""]
    lines += [f"- `{line[len(TUNING_LOG_PREFIX):].strip()}`"
              for line in report["tuning_log"]["on, cold file"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    parser.add_argument("--rows", help="comma-separated grid ids (default: G1,G3,G6)")
    parser.add_argument("--child", choices=("first", "steady"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args)
    grid = forward_bench.SMOKE_GRID if args.smoke else forward_bench.GRID
    rows = forward_bench.choose(args.rows or ",".join(SMOKE_ROWS if args.smoke else ROWS), grid,
                                "rows")
    report = run(rows, args.smoke)
    timing.write_report(report, args.out, "autotune", markdown)


if __name__ == "__main__":
    main()
