"""Layer benchmark: `jax_epilog.dense` / `jax_epilog.mlp` forward, backward and training step.

Method: benchmarks/README.md (timing in `timing.py`). Two parts, with every backend choice
of `auto` read from the tables `jax_epilog.planning.decisions` finds (tune first: `python -m
jax_epilog.tune --grid`):

1. Training steps M1–M3 (`jax.value_and_grad` of a squared-error loss over the whole MLP):
   time and peak memory (`compiled.memory_analysis()`) against XLA on the plain-JAX network.
2. Per grid row (bf16; ReLU everywhere, GELU too on the transformer rows G4, G5), for `dense`
   (x[B,K] @ W[K,N] + b) and `mlp` (the block K -> N -> K, activation after the first layer):
   forward, backward (fused and unfused) and step (forward + backward, `auto`), against XLA on
   the plain-JAX expression and against the plain-GEMM floor (the same GEMMs without epilogs:
   1 / 2 / 3 per layer for forward / backward / step, jitted together).

    python benchmarks/layers_bench.py --out benchmarks/results        # H200: < 6 minutes
    python benchmarks/layers_bench.py --smoke --out /tmp/smoke        # tiny shapes, any CPU

`--budget` is the whole run's wall-clock budget: timed rounds shrink to fit, and the grid rows
still waiting when it is spent are skipped (the report lists them).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

import forward_bench
import timing
from jax_epilog import dense, mlp
from jax_epilog.tools.grid import GELU_ROWS, NETWORKS

DTYPE = jnp.bfloat16
ROUNDS = forward_bench.ROUNDS
SMOKE_NETWORKS = {"T1": (64, (48, 40, 40, 8)), "T2": (33, (7, 129, 1, 10))}
ACTIVATION = {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=True),
              None: lambda z: z}


# --- the functions compared ----------------------------------------------------------------

def xla_stack(activation: str):
    """The plain-JAX stack (`activation` between layers, none after the last)."""
    def stack(x, params):
        for i, (kernel, bias) in enumerate(params):
            x = x @ kernel + bias
            x = ACTIVATION[activation](x) if i < len(params) - 1 else x
        return x
    return stack


def xla_dense(activation: str):
    return lambda x, params: ACTIVATION[activation](x @ params[0][0] + params[0][1])


def ours_dense(activation: str, backward: str = "auto"):
    return lambda x, params: dense(x, *params[0], activation=activation, backward=backward)


def ours_stack(activation: str, backward: str = "auto"):
    return lambda x, params: mlp(x, params, activation=activation, backward=backward)


def gemm_floor(part: str):
    """The GEMMs of `part` of a stack, without epilogs or elementwise work: per layer,
    h_i @ W_i forward; dZ_i @ W_iᵀ and h_iᵀ @ dZ_i backward (stand-in operands of the right
    shapes, so no GEMM waits for another)."""
    def floor(hs, dzs, kernels):
        outputs = []
        for h, dz, kernel in zip(hs, dzs, kernels):
            if part in ("forward", "step"):
                outputs.append(h @ kernel)
            if part in ("backward", "step"):
                outputs += [dz @ kernel.T, h.T @ dz]
        return outputs
    return floor


def floor_inputs(arg_sets: list[tuple]) -> list[tuple]:
    """(layer inputs, pre-activation gradients, kernels) shaped as in the stack of `arg_sets`."""
    floor_sets = []
    for x, params, _ in arg_sets:
        kernels = [kernel for kernel, _ in params]
        keys = jax.random.split(jax.random.key(len(floor_sets)), 2 * len(kernels))
        hs = [jax.random.normal(key, (x.shape[0], kernel.shape[0]), DTYPE)
              for key, kernel in zip(keys, kernels)]
        dzs = [jax.random.normal(key, (x.shape[0], kernel.shape[1]), DTYPE)
               for key, kernel in zip(keys[len(kernels):], kernels)]
        floor_sets.append(jax.block_until_ready((hs, dzs, kernels)))
    return floor_sets


def forward_of(fn):
    return lambda x, params, dy: fn(x, params)


def step_of(fn):
    """Forward and backward with the cotangent `dy` (a layer's share of a training step)."""
    def step(x, params, dy):
        y, vjp = jax.vjp(fn, x, params)
        return y, vjp(dy)
    return step


def backward_alone(fn, arg_sets: list[tuple]):
    """(function, argument sets) applying `fn`'s VJP to `dy`: the residuals are computed once,
    outside, and passed as arrays (every set's residuals in the first set's structure)."""
    pullbacks = [jax.vjp(fn, x, params)[1] for x, params, _ in arg_sets]
    structure = jax.tree.structure(pullbacks[0])
    apply = lambda residuals, dy: jax.tree.unflatten(structure, residuals)(dy)  # noqa: E731
    return apply, [(jax.tree.leaves(p), dy) for p, (_, _, dy) in zip(pullbacks, arg_sets)]


def network_step(fn):
    def loss(params, x, target):
        error = fn(x, params).astype(jnp.float32) - target
        return 0.5 * jnp.mean(error * error)
    return jax.value_and_grad(loss)


# --- inputs ----------------------------------------------------------------------------------

def random_stack(batch: int, widths, seed: int = 0):
    """x, ((kernel, bias), ...) and a cotangent for the output: normal, W scaled by 1/sqrt(K)."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(widths) + 2))
    x = jax.random.normal(next(keys), (batch, widths[0]), DTYPE)
    params = tuple(
        ((jax.random.normal(next(keys), (k, n), jnp.float32) / math.sqrt(k)).astype(DTYPE),
         (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(DTYPE))
        for k, n in zip(widths, widths[1:]))
    dy = jax.random.normal(next(keys), (batch, widths[-1]), DTYPE)
    return jax.block_until_ready((x, params, dy))


def input_sets(batch: int, widths) -> list[tuple]:
    """Enough independent copies that small problems read their inputs from HBM."""
    size = jnp.dtype(DTYPE).itemsize
    per_call = size * (batch * (widths[0] + widths[-1]) + sum(
        k * n for k, n in zip(widths, widths[1:])))
    return [random_stack(batch, widths, seed) for seed in range(timing.input_copies(per_call))]


# --- measuring ----------------------------------------------------------------------------------

class Clock:
    """The run's wall-clock budget: each timed round gets a share of what is left."""

    def __init__(self, seconds: float, measurements: int):
        self.budget = timing.Budget(seconds, measurements, rounds=ROUNDS)

    @property
    def spent(self) -> bool:
        return time.perf_counter() > self.budget.deadline

    def measure(self, fn: Callable, arg_sets: list[tuple], flops: int) -> dict[str, Any]:
        """Time `fn` jitted (compiled once), with its memory and whether it ran cuBLASLt."""
        lowered = jax.jit(fn).lower(*arg_sets[0])
        compiled = lowered.compile()
        result = timing.time_calls(compiled, arg_sets, rounds=ROUNDS,
                                   round_seconds=self.budget.round_seconds()).as_dict()
        result["tflops"] = timing.tflops(flops, result["seconds"])
        result["memory"] = timing.memory_analysis(compiled)
        result["custom_call"] = "jax_epilog_matmul" in lowered.as_text()
        return result


def stack_flops(batch: int, widths, part: str) -> int:
    """1 / 2 / 3 GEMMs per layer (a network step's first-layer dX is counted too, as in the
    reference figures of benchmarks/README.md)."""
    gemms = {"forward": 1, "backward": 2, "step": 3}[part]
    return gemms * sum(timing.gemm_flops(batch, k, n) for k, n in zip(widths, widths[1:]))


# --- 1. and 2.: networks and grid rows ----------------------------------------------------------

def measure_network(batch: int, widths, clock: Clock) -> dict[str, Any]:
    x, params, _ = random_stack(batch, widths)
    target = jax.random.normal(jax.random.key(1), (batch, widths[-1]), jnp.float32)
    flops = stack_flops(batch, widths, "step")
    results = {name: clock.measure(network_step(fn), [(params, x, target)], flops)
               for name, fn in (("xla", xla_stack("relu")), ("jax_epilog", ours_stack("relu")))}
    results["jax_epilog"]["speedup_vs_xla"] = (results["xla"]["seconds"]
                                               / results["jax_epilog"]["seconds"])
    return {"batch": batch, "widths": list(widths), "flops": flops, "results": results}


def layer_cases(grid: dict, activation: str):
    """(name, widths, XLA fn, ours(backward) fn) for `dense` and the `mlp` block of a row."""
    batch, k, n = grid
    return [("dense", (k, n), xla_dense(activation), lambda b: ours_dense(activation, b)),
            ("mlp", (k, n, k), xla_stack(activation), lambda b: ours_stack(activation, b))]


def measure_layer(batch: int, widths, xla_fn, ours, clock: Clock) -> dict[str, Any]:
    arg_sets = input_sets(batch, widths)
    floor_sets = floor_inputs(arg_sets)
    results: dict[str, Any] = {}
    for part in ("forward", "backward", "step"):
        flops = stack_flops(batch, widths, part)
        floor = clock.measure(gemm_floor(part), floor_sets, flops)
        if part == "backward":  # the backward alone: residuals made once, outside the timing
            # "unfused": our layers with the backward GEMMs in XLA's way (`backward="xla"`)
            candidates = {"xla": xla_fn, "fused": ours("fused"), "unfused": ours("xla")}
            measured = {name: clock.measure(*backward_alone(fn, arg_sets), flops)
                        for name, fn in candidates.items()}
        else:
            wrap = forward_of if part == "forward" else step_of
            measured = {name: clock.measure(wrap(fn), arg_sets, flops)
                        for name, fn in (("xla", xla_fn), ("auto", ours("auto")))}
        for result in measured.values():
            result["pct_of_gemm"] = 100.0 * floor["seconds"] / result["seconds"]
            result["speedup_vs_xla"] = measured["xla"]["seconds"] / result["seconds"]
        results[part] = {"gemm_floor": floor, **measured}
    return results


def run(grid: dict, networks: dict, budget: float) -> dict[str, Any]:
    started = time.perf_counter()
    cases = [(row, activation) for row in grid
             for activation in (("relu", "gelu") if row in GELU_ROWS else ("relu",))]
    # Measurements: 2 per network, 2 x (3 + 7) per grid case.
    clock = Clock(budget, 2 * len(networks) + 20 * len(cases))
    device = jax.devices()[0].device_kind
    network_rows = {name: measure_network(*net, clock) for name, net in networks.items()}
    layer_rows, skipped = [], []
    for row, activation in cases:
        if clock.spent:
            skipped.append(f"{row} {activation}")
            continue
        batch, k, n = grid[row]
        for name, widths, xla_fn, ours in layer_cases(grid[row], activation):
            layer_rows.append({"row": row, "activation": activation, "layer": name,
                               "batch": batch, "widths": list(widths),
                               "results": measure_layer(batch, widths, xla_fn, ours, clock)})
    return {"benchmark": "layers", "metadata": timing.run_metadata(), "device": device,
            "method": {"rounds": ROUNDS, "budget_seconds": budget, "dtype": jnp.dtype(DTYPE).name,
                       "timing": "median over rounds of back-to-back calls, one sync per round",
                       "speedup_vs_xla": "XLA time / this time (> 1: faster than XLA)"},
            "elapsed_seconds": time.perf_counter() - started, "skipped": skipped,
            "networks": network_rows, "layers": layer_rows}


# --- report ------------------------------------------------------------------------------------

def _mib(result) -> str:
    memory = result.get("memory")
    return f"{memory['temp_size_in_bytes'] / 2**20:.0f}" if memory else "–"


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = [
        "# Layer benchmark: dense and mlp, forward, backward, training step",
        "",
        timing.provenance(meta, report["method"]["dtype"],
                          f"{report['elapsed_seconds']:.0f} s"),
        "",
        "Times are medians of back-to-back calls (ms); TFLOP/s count 2·B·K·N per GEMM; "
        "'vs XLA' is XLA's time / this time (> 1: faster); '% floor' is the plain GEMMs' time "
        "for the same part / this time; temp MiB is `memory_analysis().temp_size_in_bytes`.",
        "",
        "## Training steps (value_and_grad of the whole MLP)",
        "",
        "| net | batch × widths | XLA ms | XLA TFLOP/s | XLA temp MiB | jax_epilog ms | TFLOP/s "
        "| temp MiB | vs XLA |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, net in report["networks"].items():
        xla, ours = net["results"]["xla"], net["results"]["jax_epilog"]
        lines.append(
            f"| {name} | {net['batch']} × {'→'.join(map(str, net['widths']))} | "
            f"{xla['seconds'] * 1e3:.3f} | {xla['tflops']:.4g} | {_mib(xla)} | "
            f"{ours['seconds'] * 1e3:.3f} | {ours['tflops']:.4g} | {_mib(ours)} | "
            f"{ours['speedup_vs_xla']:.3f} |")
    lines += ["", "## Grid rows", "",
              "| row | act | layer | part | floor ms | XLA ms | XLA % floor | jax_epilog ms "
              "| TFLOP/s | % floor | vs XLA | unfused ms | unfused vs XLA | temp MiB XLA / ours |",
              "|" + "---|" * 14]
    for r in report["layers"]:
        for part, res in r["results"].items():
            ours = res["auto"] if "auto" in res else res["fused"]
            label = "backward (fused)" if part == "backward" else part
            unfused = res.get("unfused")
            lines.append(
                f"| {r['row']} | {r['activation']} | {r['layer']} | {label} | "
                f"{res['gemm_floor']['seconds'] * 1e3:.3f} | {res['xla']['seconds'] * 1e3:.3f} | "
                f"{res['xla']['pct_of_gemm']:.1f} | {ours['seconds'] * 1e3:.3f} | "
                f"{ours['tflops']:.4g} | {ours['pct_of_gemm']:.1f} | "
                f"{ours['speedup_vs_xla']:.3f} | "
                + (f"{unfused['seconds'] * 1e3:.3f} | {unfused['speedup_vs_xla']:.3f} | "
                   if unfused else "– | – | ")
                + f"{_mib(res['xla'])} / {_mib(ours)} |")
    lines += timing.footnotes(meta, report["skipped"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    parser.add_argument("--rows", help="comma-separated grid ids (default: all)")
    parser.add_argument("--networks", help="comma-separated network ids (default: all)")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall-clock seconds for the whole run (default 280; smoke 60)")
    args = parser.parse_args(argv)
    grid = forward_bench.SMOKE_GRID if args.smoke else forward_bench.GRID
    networks = SMOKE_NETWORKS if args.smoke else NETWORKS
    grid = {row: grid[row] for row in forward_bench.choose(args.rows, grid, "rows")}
    networks = {name: networks[name]
                for name in forward_bench.choose(args.networks, networks, "networks")}
    budget = args.budget if args.budget is not None else (60.0 if args.smoke else 280.0)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(grid, networks, budget)
    timing.write_report(report, args.out, "layers", markdown)


if __name__ == "__main__":
    main()
