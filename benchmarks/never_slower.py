"""Never slower than XLA (issue 12): plain JAX against jax_epilog with every choice on "auto".

Every grid row G1–G7 (a dense layer with ReLU; G4/G5 with GELU too) and network M1–M3 of
benchmarks/README.md, each as the inference forward and as a training step
(`jax.value_and_grad` of a squared error; a grid row also differentiates its input, as a layer
inside a network does), the same definitions `python -m jax_epilog.tune --grid` tunes. Both
sides are jitted and compiled once and timed in one process, in both harnesses:

- careful: inputs rotated through enough copies that they cannot stay in L2, rounds of
  back-to-back calls with one `jax.block_until_ready` each (the device's throughput), median
  (rows under half a millisecond per call take 21 longer rounds: their single rounds move by
  several percent); the min–max of the per-round ratios is reported beside each ratio;
- user: the same inputs every call, the same wall-clock loop: what someone swapping their
  layers for ours would measure.

The two sides' rounds are interleaved so the shared machine's drift hits both alike. Ratio =
XLA's time / ours (> 1: faster than XLA); per harness the minimum and the geometric mean over
rows, and the issue's targets. A row that fails is reported and the rest continue; the report
is rewritten after every row, so an interrupted run leaves its partial results.

    python benchmarks/never_slower.py --out benchmarks/results      # H200: about 2 minutes
    python benchmarks/never_slower.py --rows G3,G7,M3 --budget-s 60
    python benchmarks/never_slower.py --smoke --out /tmp/smoke       # tiny shapes, any CPU
    python benchmarks/never_slower.py --readme-table benchmarks/results/never_slower.json

Writes `<out>/never_slower.json` and `<out>/never_slower.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

import timing
from jax_epilog import Epilog, config, dense, matmul
from jax_epilog.runtime import targets
from jax_epilog.planning import decisions
from jax_epilog.tools.grid import GRID, NETWORKS, Workload, epilog_stack, forward_fn, grid_workloads, step_fn
from jax_epilog.tools.measurement import epilog_eqns

DTYPE = jnp.bfloat16
ROUNDS = 7
# Rows under SMALL_ROW_SECONDS per call (G3, G6, G7, M3, M2 forward on an H200) are a few
# kernels: launch jitter moves single rounds by several percent, so they take SMALL_ROUNDS
# rounds of at least SMALL_ROUND_SECONDS each (about 30 s more in all).
SMALL_ROW_SECONDS, SMALL_ROUNDS, SMALL_ROUND_SECONDS = 0.5e-3, 21, 0.05
MODES = {"forward": forward_fn, "step": step_fn}
HARNESSES = ("careful", "user")
# The targets: every row >= 0.98, geometric mean >= 1.05, and these rows.
MIN_RATIO, MIN_GEOMEAN = 0.98, 1.05
ROW_TARGETS = {"M3 step": 1.00, "M2 step": 1.15, "G3 step": 1.10,
               "T1 residual step": 1.00, "T2 residual step": 1.00}
ACTIVATION = {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=True),
              None: lambda z: z}


def xla_stack(x, params, activation, final_activation):
    """The plain-JAX stack a user writes today; XLA compiles it as it likes."""
    for i, (kernel, bias) in enumerate(params):
        x = ACTIVATION[activation if i < len(params) - 1 else final_activation](x @ kernel + bias)
    return x


def matmul_stack(x, params, activation, final_activation):
    """One layer as the op itself, `jax_epilog.matmul` with the BIAS, RELU_BIAS or GELU_BIAS
    epilog, differentiated by the op's own custom VJP (not the layers')."""
    (kernel, bias), = params
    return matmul(x, kernel, epilog=Epilog.find(final_activation, True),
                  epilog_inputs={"bias": bias})


def xla_residual_block(x, params, activation, final_activation):
    """A transformer MLP block as a user writes it: x + act(x W1 + b1) W2 + b2."""
    (w1, b1), (w2, b2) = params
    return x + (ACTIVATION[activation](x @ w1 + b1) @ w2 + b2)


def epilog_residual_block(x, params, activation, final_activation):
    """The same block with the residual added by the second GEMM, through `c`."""
    (w1, b1), (w2, b2) = params
    h = dense(x, w1, b1, activation=activation)
    return matmul(h, w2, x, beta=1.0, epilog="bias", epilog_inputs={"bias": b2})


class Row(NamedTuple):
    """What is measured: a workload, its modes, (XLA's side, ours), and the group that
    `--rows` can name."""

    workload: Workload
    modes: tuple[str, ...]
    stacks: tuple[Callable, Callable]
    group: str


MATMUL_ROWS = ("G1", "G3", "G6")  # `jax.grad` through `matmul` itself, per epilog
RESIDUAL_BLOCKS = {"T1": (8192, 4096, 16384), "T2": (16384, 1024, 4096)}  # T, D, F
GROUPS = ("grid", "matmul", "residual")
LAYER_STACKS = (xla_stack, epilog_stack)
MATMUL_STACKS = (xla_stack, matmul_stack)
RESIDUAL_STACKS = (xla_residual_block, epilog_residual_block)
SMOKE_ROWS = [Row(Workload("S1", 64, (48, 40), None, "relu", True), tuple(MODES), LAYER_STACKS,
                  "grid"),
              Row(Workload("S1 gelu", 64, (48, 40), None, "gelu", True), tuple(MODES),
                  LAYER_STACKS, "grid"),
              Row(Workload("T1", 33, (7, 129, 40, 10), "relu", None, False), tuple(MODES),
                  LAYER_STACKS, "grid"),
              Row(Workload("S3 matmul relu_bias", 64, (48, 40), None, "relu", True), ("step",),
                  MATMUL_STACKS, "matmul"),
              Row(Workload("S2 residual", 33, (40, 72, 40), "gelu", None, True), tuple(MODES),
                  RESIDUAL_STACKS, "residual")]


def benchmark_rows(rows: Optional[list[str]] = None) -> list[Row]:
    """The grid rows and networks (both modes, `mlp` against the plain stack), `jax.grad`
    through `matmul` with BIAS / RELU_BIAS / GELU_BIAS at G1, G3, G6, and the transformer MLP
    block with its residual through `c` (both modes). `rows` names ids (G1..G7, M1..M3, T1,
    T2) or groups (grid, matmul, residual); None: everything."""
    wanted = None if rows is None else set(rows)
    unknown = set() if wanted is None else \
        wanted - set(GRID) - set(NETWORKS) - set(RESIDUAL_BLOCKS) - set(GROUPS)
    if unknown:
        raise ValueError(f"rows: unknown ids {sorted(unknown)}; expected some of "
                         f"{', '.join([*GRID, *NETWORKS, *RESIDUAL_BLOCKS, *GROUPS])}")
    picked = lambda row_id, group: wanted is None or row_id in wanted or group in wanted
    selected = [Row(w, tuple(MODES), LAYER_STACKS, "grid") for w in grid_workloads()
                if picked(w.name.split()[0], "grid")]
    for row_id in MATMUL_ROWS:
        if picked(row_id, "matmul"):
            batch, k, n = GRID[row_id]
            selected += [Row(Workload(f"{row_id} matmul {Epilog.find(act, True).name.lower()}",
                                      batch, (k, n), None, act, True), ("step",), MATMUL_STACKS,
                             "matmul") for act in (None, "relu", "gelu")]
    for row_id, (t, d, f) in RESIDUAL_BLOCKS.items():
        if picked(row_id, "residual"):
            selected.append(Row(Workload(f"{row_id} residual", t, (d, f, d), "gelu", None, True),
                                tuple(MODES), RESIDUAL_STACKS, "residual"))
    return selected


def random_inputs(w: Workload, seed: int) -> tuple:
    """(params, x, target): normal x, W scaled by 1/sqrt(K), a small bias, a normal target."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(w.widths) + 2))
    params = tuple(
        ((jax.random.normal(next(keys), (k, n), jnp.float32) / math.sqrt(k)).astype(DTYPE),
         (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(DTYPE))
        for k, n in zip(w.widths, w.widths[1:]))
    x = jax.random.normal(next(keys), (w.batch, w.widths[0]), DTYPE)
    target = jax.random.normal(next(keys), (w.batch, w.widths[-1]), jnp.float32)
    return jax.block_until_ready((params, x, target))


def input_copies(w: Workload) -> int:
    size = jnp.dtype(DTYPE).itemsize
    per_call = size * (w.batch * (w.widths[0] + w.widths[-1])
                       + sum(k * n + n for k, n in zip(w.widths, w.widths[1:])))
    return timing.input_copies(per_call)


def _max_abs_diff(expected, received) -> float:
    """Largest |difference| over every output leaf (loss and gradients for a step)."""
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(received)))


def _temp_mib(compiled) -> Optional[float]:
    memory = timing.memory_analysis(compiled)
    return memory["temp_size_in_bytes"] / 2**20 if memory else None


def path_taken(fn, args: tuple) -> str:
    """"fused" where jax_epilog's side runs the layers' custom VJP (epilog GEMMs in its jaxpr,
    whichever backend each lowers to), "plain" where it is the plain expression."""
    return "fused" if any(True for _ in epilog_eqns(jax.make_jaxpr(fn)(*args).jaxpr)) \
        else "plain"


def measure_row(w: Workload, mode: str, arg_sets: list[tuple], budget: timing.Budget,
                stacks: tuple[Callable, Callable] = LAYER_STACKS):
    """Both sides of one row jitted (as a user calls them), then timed in both harnesses."""
    sides = {}
    record: dict[str, Any] = {}
    for side, stack in zip(("xla", "jax_epilog"), stacks):
        sides[side] = jax.jit(MODES[mode](w, stack))
        lowered = sides[side].lower(*arg_sets[0])
        start = time.perf_counter()
        compiled = lowered.compile()  # the jitted function's first call finds it compiled
        outputs = jax.block_until_ready(compiled(*arg_sets[0]))
        record[f"{side}_first_call_seconds"] = time.perf_counter() - start
        record[f"{side}_temp_mib"] = _temp_mib(compiled)
        record[f"{side}_outputs"] = outputs
        if side == "jax_epilog":
            record["cublaslt_calls"] = compiled.as_text().count(
                f'custom_call_target="{targets.MATMUL.name}"')
            record["path"] = path_taken(MODES[mode](w, stack), arg_sets[0])
    record["max_abs_diff"] = _max_abs_diff(record.pop("xla_outputs"),
                                           record.pop("jax_epilog_outputs"))
    # XLA's side, a few calls: is this a small row (more and longer rounds)?
    estimate = timing.time_calls(sides["xla"], arg_sets, rounds=1, round_seconds=0.005,
                                 warmup_calls=1).seconds
    small = estimate < SMALL_ROW_SECONDS
    record["rounds"] = SMALL_ROUNDS if small else ROUNDS
    for harness in HARNESSES:
        sets = arg_sets if harness == "careful" else arg_sets[:1]
        round_seconds = budget.round_seconds()
        if small:
            round_seconds = max(round_seconds, SMALL_ROUND_SECONDS)
        t = timing.time_interleaved({side: (fn, sets) for side, fn in sides.items()},
                                    rounds=record["rounds"], round_seconds=round_seconds)
        record[harness] = {side: timing_.as_dict() for side, timing_ in t.items()}
        record[harness]["ratio"] = t["xla"].seconds / t["jax_epilog"].seconds
        # Round i of each side ran back to back: their ratio, round by round, shows the noise.
        record[harness]["ratio_spread"] = list(timing.ratio_spread(t["xla"], t["jax_epilog"]))
    return record


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per harness: the minimum ratio (and its row), the geometric mean, the targets."""
    result = {}
    for harness in HARNESSES:
        ratios = {r["name"]: r[harness]["ratio"] for r in rows if harness in r}
        if not ratios:
            continue
        worst = min(ratios, key=ratios.get)
        geomean = math.exp(sum(math.log(v) for v in ratios.values()) / len(ratios))
        rows_met = {name: ratios[name] >= target for name, target in ROW_TARGETS.items()
                    if name in ratios}
        result[harness] = {"rows": len(ratios), "min": ratios[worst], "min_row": worst,
                           "geomean": geomean,
                           "every_row_at_least_0.98": ratios[worst] >= MIN_RATIO,
                           "geomean_at_least_1.05": geomean >= MIN_GEOMEAN,
                           "row_targets_met": rows_met}
    return result


def tables_used() -> dict[str, Any]:
    """Which decision tables `auto` read in this run."""
    device = decisions.device_identity()[0]
    user = config.decisions_path()
    shipped = decisions.shipped_table_path(device) if device else None
    return {"override": config.backend_override(),
            "user_table": str(user) if user and user.exists() else None,
            "shipped_table": shipped.name if shipped and shipped.exists() else None}


def run(rows: list[Row], budget_seconds: float, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    # One measurement per harness and row: two sides' rounds each.
    measurements = sum(len(row.modes) for row in rows)
    budget = timing.Budget(budget_seconds, len(HARNESSES) * measurements, rounds=2 * ROUNDS)
    report: dict[str, Any] = {
        "benchmark": "never_slower", "metadata": timing.run_metadata(),
        "method": {"dtype": jnp.dtype(DTYPE).name, "rounds": ROUNDS,
                   "budget_seconds": budget_seconds, "tables": tables_used(),
                   "ratio": "XLA time / jax_epilog time (> 1: faster than XLA)",
                   "careful": "rotated inputs, back-to-back calls, one block_until_ready per "
                              "round, median; sides interleaved round by round",
                   "user": "the same inputs every call, otherwise as careful",
                   "small_rows": f"under {SMALL_ROW_SECONDS * 1e3:g} ms per call: "
                                 f"{SMALL_ROUNDS} rounds of at least "
                                 f"{SMALL_ROUND_SECONDS * 1e3:g} ms",
                   "ratio_spread": "min and max over rounds of XLA's round time / ours (the "
                                   "two sides' rounds i run back to back)"},
        "rows": [], "errors": [], "skipped": []}
    with timing.progress_bar(measurements, "never_slower") as bar:
        for w, modes, stacks, _ in rows:
            if budget.remaining <= 0:
                report["skipped"] += [f"{w.name} {mode}" for mode in modes]
                bar.update(len(modes))
                continue
            try:
                arg_sets = [random_inputs(w, seed) for seed in range(input_copies(w))]
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: the next row may fit)
                report["errors"] += [{"name": f"{w.name} {mode}", "error": repr(e)}
                                     for mode in modes]
                bar.update(len(modes))
                continue
            for mode in modes:
                name = f"{w.name} {mode}"
                bar.set_postfix_str(name, refresh=False)
                try:
                    record = measure_row(w, mode, arg_sets, budget, stacks)
                    report["rows"].append({"name": name, "mode": mode, "batch": w.batch,
                                           "widths": list(w.widths), "flops": w.flops(mode),
                                           "input_copies": len(arg_sets), **record})
                except Exception as e:  # noqa: BLE001  (one failing row must not end the run)
                    report["errors"].append({"name": name, "error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc(limit=8)})
                bar.update()
                report["summary"] = summary(report["rows"])
                report["elapsed_seconds"] = time.perf_counter() - started
                write(report, out)
            del arg_sets
    report["summary"] = summary(report["rows"])
    report["elapsed_seconds"] = time.perf_counter() - started
    write(report, out)
    return report


# --- report ------------------------------------------------------------------------------------

def _ms(result: dict[str, Any]) -> str:
    return f"{result['seconds'] * 1e3:.3f}"


def _ratio(result: dict[str, Any]) -> str:
    """"0.964 (0.93–1.01)": the ratio of medians, and the spread of the per-round ratios."""
    spread = result.get("ratio_spread")
    text = f"{result['ratio']:.3f}"
    return f"{text} ({spread[0]:.2f}–{spread[1]:.2f})" if spread else text


def _mib(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.0f}"


def markdown(report: dict[str, Any]) -> str:
    meta, method = report["metadata"], report["method"]
    tables = method["tables"]
    lines = [
        "# Never slower than XLA: plain JAX vs jax_epilog (auto)",
        "",
        timing.provenance(meta, f"autotune: {meta['autotune']}", method["dtype"],
                          f"{report.get('elapsed_seconds', 0):.0f} s"),
        "",
        f"Tables read by `auto`: shipped {tables['shipped_table'] or 'none'}, user "
        f"{tables['user_table'] or 'none'}, override {tables['override'] or 'none'}.",
        "",
        "Ratio = XLA's time / jax_epilog's (> 1: faster than XLA). Times: median ms per call of "
        f"{method['rounds']} rounds ({SMALL_ROUNDS} of at least {SMALL_ROUND_SECONDS * 1e3:g} ms "
        f"for rows under {SMALL_ROW_SECONDS * 1e3:g} ms), the two sides interleaved; in "
        "parentheses, the min–max over rounds of the per-round ratio (a row whose range spans "
        "1 is within noise). careful: rotated inputs; user: "
        "the same inputs every call. Step: `jax.value_and_grad` of a squared error (grid rows "
        "also differentiate x). path: the layer as the plain expression or as the fused stack "
        "(its custom VJP; per stack from the table's stack entries, else per GEMM). cuBLASLt "
        "calls: custom calls in jax_epilog's compiled module (the rest ran XLA's lowering); "
        "temp MiB: `memory_analysis().temp_size_in_bytes`.",
        "",
        "| row | B × widths | careful XLA ms | careful ours ms | careful ratio | user XLA ms "
        "| user ours ms | user ratio | path | cuBLASLt calls | temp MiB XLA / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        c, u = r["careful"], r["user"]
        lines.append(
            f"| {r['name']} | {r['batch']} × {'→'.join(map(str, r['widths']))} | "
            f"{_ms(c['xla'])} | {_ms(c['jax_epilog'])} | {_ratio(c)} | {_ms(u['xla'])} | "
            f"{_ms(u['jax_epilog'])} | {_ratio(u)} | {r['path']} | {r['cublaslt_calls']} | "
            f"{_mib(r['xla_temp_mib'])} / {_mib(r['jax_epilog_temp_mib'])} |")
    lines += ["", "## Summary", "",
              "| harness | rows | min ratio (row) | geomean | every row ≥ 0.98 | geomean ≥ 1.05 "
              "| row targets (M3 step ≥ 1.00, M2 step ≥ 1.15, G3 step ≥ 1.10) |",
              "|---|---|---|---|---|---|---|"]
    for harness, s in report.get("summary", {}).items():
        targets = ", ".join(f"{name} {'met' if ok else 'MISSED'}"
                            for name, ok in s["row_targets_met"].items()) or "–"
        lines.append(f"| {harness} | {s['rows']} | {s['min']:.3f} ({s['min_row']}) | "
                     f"{s['geomean']:.3f} | {'yes' if s['every_row_at_least_0.98'] else 'NO'} | "
                     f"{'yes' if s['geomean_at_least_1.05'] else 'NO'} | {targets} |")
    if report["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['name']}: {e['error']}"
                                          for e in report["errors"]]
    lines += timing.footnotes(meta, report["skipped"])
    return "\n".join(lines) + "\n"


def readme_table(report: dict[str, Any]) -> str:
    """The compact table for the project README: one line per grid row or network, the ratio of
    each mode in each harness, then the minimum and geometric mean per harness."""
    ratios: dict[str, dict[str, float]] = {}
    for r in report["rows"]:
        row = r["name"].rsplit(" ", 1)[0]
        for harness in HARNESSES:
            ratios.setdefault(row, {})[f"{r['mode']} {harness}"] = r[harness]["ratio"]
    columns = [f"{mode} {harness}" for mode in MODES for harness in HARNESSES]
    meta = report["metadata"]
    lines = [f"XLA time / jax_epilog time, {meta['gpu_name'] or meta['device']}, jax "
             f"{meta['jax']}, cuBLASLt {meta['cublaslt_version']}, {meta['date'][:10]} "
             "(`benchmarks/results/never_slower.md`):", "",
             "| row | " + " | ".join(c.replace(" ", ", ") for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row, values in ratios.items():
        cells = [f"{values[c]:.3f}" if c in values else "–" for c in columns]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    for harness, s in report.get("summary", {}).items():
        lines.append(f"\n{harness}: min {s['min']:.3f} ({s['min_row']}), geomean "
                     f"{s['geomean']:.3f} over {s['rows']} rows.")
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> None:
    timing.write_report(report, out, "never_slower", markdown)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", help="comma-separated ids (G1..G7, M1..M3, T1, T2) or groups "
                                       "(grid, matmul, residual); default: all. 'G4' includes "
                                       "'G4 gelu', 'G1' its matmul rows")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock seconds for the whole run; rows still waiting when it "
                             "is spent are skipped (default 240; smoke 30)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    parser.add_argument("--readme-table", type=Path, metavar="JSON",
                        help="print the README's table from a saved report and exit")
    args = parser.parse_args(argv)
    if args.readme_table:
        report = json.loads(args.readme_table.read_text())
        print(readme_table(report), end="")
        return report
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
    if args.smoke:
        selected = [r for r in SMOKE_ROWS
                    if rows is None or r.workload.name.split()[0] in rows or r.group in rows]
    else:
        try:
            selected = benchmark_rows(rows)
        except ValueError as e:
            parser.error(str(e))
    budget = args.budget_s if args.budget_s is not None else (30.0 if args.smoke else 300.0)
    report = run(selected, budget, args.out)
    for harness, s in report["summary"].items():
        print(f"{harness}: min {s['min']:.3f} ({s['min_row']}), geomean {s['geomean']:.3f} "
              f"over {s['rows']} rows")
    print(f"wrote {args.out}/never_slower.json, never_slower.md "
          f"({len(report['errors'])} errors, {len(report['skipped'])} skipped)")
    return report


if __name__ == "__main__":
    main()
