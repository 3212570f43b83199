"""Forward epilog benchmark: grid G1–G7 (benchmarks/README.md), one process, one run.

For each shape and dtype, the plain GEMM `x @ W` is timed once, then for each forward epilog:
  - XLA on the plain-JAX expression (the inference form `act(x @ W + b)`; for the *_AUX_*
    epilogs the training forward, which also returns the pre-activation `z = x @ W + b`),
  - `jax_epilog.matmul` with that epilog,
  - nvmath-python's `Matmul` with the same epilog, where nvmath-python and a CUDA torch are
    importable (planned once per problem, like the jitted functions; only `execute` is timed).
Every row reports time, TFLOP/s (2·B·K·N), % of the plain GEMM's rate and the ratio against
XLA (> 1: faster than XLA). Results go to `<out>/forward.{json,md,png}`.

    python benchmarks/forward_bench.py --out benchmarks/results          # the full grid
    python benchmarks/forward_bench.py --smoke --out /tmp/smoke          # tiny shapes, any CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

import plot
import timing
from jax_epilog import Epilog, gelu_aux_columns, relu_mask_bytes
from jax_epilog import matmul as epilog_matmul
from jax_epilog.tools.grid import GRID

# Odd, tiny shapes that run in seconds on a CPU (and exercise cuBLASLt's ragged edges on a GPU).
SMOKE_GRID = {"S1": (64, 48, 40), "S2": (129, 7, 127)}

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
# bf16 on every row; fp16 and fp32 (TF32: precision DEFAULT) on G1–G3 only.
EXTRA_DTYPE_ROWS = ("G1", "G2", "G3")
EPILOGS = (Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS,
           Epilog.BIAS)
ROUNDS = 5


# --- what is compared ---------------------------------------------------------------------

def plain_gemm(x, w):
    return x @ w


def xla_layer(epilog: Epilog) -> Callable:
    """The plain-JAX expression XLA compiles for `epilog` (its training form for *_AUX_*)."""
    activation = {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=True),
                  None: lambda z: z}[epilog.activation]

    def layer(x, w, b):
        z = x @ w + b
        return (activation(z), z) if epilog.aux_output else activation(z)

    return layer


def epilog_layer(epilog: Epilog) -> Callable:
    def layer(x, w, b):
        return epilog_matmul(x, w, epilog=epilog, epilog_inputs={"bias": b})

    return layer


def random_inputs(shape: tuple[int, int, int], dtype, copies: int, seed: int = 0):
    """`copies` independent (x, W, b): normal x, W scaled by 1/sqrt(K), a small normal bias."""
    batch, k, n = shape
    sets = []
    for key in jax.random.split(jax.random.key(seed), copies):
        kx, kw, kb = jax.random.split(key, 3)
        sets.append((jax.random.normal(kx, (batch, k), dtype),
                     (jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)).astype(dtype),
                     (0.1 * jax.random.normal(kb, (n,), jnp.float32)).astype(dtype)))
    return jax.block_until_ready(sets)


def bytes_moved(shape: tuple[int, int, int], dtype, epilog: Optional[Epilog] = None) -> int:
    """The least traffic of one call: x, W (and b) read once, y (and the aux) written once."""
    batch, k, n = shape
    size = jnp.dtype(dtype).itemsize
    total = (batch * k + k * n + batch * n) * size
    if epilog is not None and epilog.has_bias:
        total += n * size
    if epilog is not None and epilog.aux_output == "relu_aux":
        total += batch * relu_mask_bytes(n)
    elif epilog is not None and epilog.aux_output == "gelu_aux":
        total += batch * gelu_aux_columns(n) * size
    return total


def measure_bandwidth(megabytes: int = 1024) -> float:
    """Bytes per second of an elementwise pass over a large array (one read, one write):
    the rate that bounds the epilog's extra traffic."""
    x = jax.block_until_ready(jnp.ones((megabytes * 2**20 // 4,), jnp.float32))
    t = timing.time_calls(jax.jit(lambda a: a * 2), [(x,)], rounds=ROUNDS)
    return 2 * x.nbytes / t.seconds


# --- nvmath-python, where it can run ------------------------------------------------------

class NvmathRunner:
    """nvmath-python's stateful `Matmul` on torch views of the same JAX buffers.

    cuBLASLt is column-major and nvmath's bias runs along the result's rows, so the layer
    `x @ W + b` is planned as its transpose `W.T @ x.T + b`: the same GEMM cuBLASLt runs for a
    row-major `x @ W`, no copies.
    """

    def __init__(self):
        self.error: Optional[str] = None
        self.version: Optional[str] = None
        # An optional dependency that fails to import, for whatever reason (a missing wheel, a
        # mismatched cuda-bindings), only costs its column.
        try:
            import nvmath
            import nvmath.linalg.advanced  # noqa: F401
            import torch
            if not torch.cuda.is_available():
                raise ImportError("torch sees no CUDA device")
        except Exception as e:  # noqa: BLE001
            self.error = f"nvmath-python unavailable: {type(e).__name__}: {e}"
            return
        self.nvmath, self.torch = nvmath, torch
        self.version = f"nvmath-python {nvmath.__version__}, torch {torch.__version__}"

    @property
    def available(self) -> bool:
        return self.error is None

    def plan(self, epilog: Epilog, x, w, b):
        """A planned `Matmul` for one input set; `execute()` runs it."""
        nvmath, torch = self.nvmath, self.torch
        x_t, w_t, b_t = (torch.from_dlpack(v) for v in (x, w, b))
        options = None
        if x.dtype == jnp.float32:  # match XLA's and jax_epilog's DEFAULT precision: TF32
            options = {"compute_type": nvmath.linalg.ComputeType.COMPUTE_32F_FAST_TF32}
        mm = nvmath.linalg.advanced.Matmul(w_t.T, x_t.T, options=options)
        mm.plan(epilog=nvmath.linalg.advanced.MatmulEpilog[epilog.name],
                epilog_inputs={"bias": b_t})
        return mm

    def sync(self, _result) -> None:
        self.torch.cuda.synchronize()


# --- the run ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    row: str
    shape: tuple[int, int, int]
    dtype: str


def cases(grid: dict, rows: list[str], dtypes: list[str]) -> list[Case]:
    """bf16 everywhere, the other dtypes on G1–G3 (every requested dtype in smoke mode)."""
    return [Case(row, grid[row], dtype) for row in rows for dtype in dtypes
            if dtype == "bf16" or row in EXTRA_DTYPE_ROWS or row in SMOKE_GRID]


def measure_jax(jitted: Callable, arg_sets: list[tuple],
                budget: timing.Budget) -> dict[str, Any]:
    # The first call's time includes compiling, and any planning or algorithm search the
    # lowering or the first execution does: the one-off cost a user pays per problem.
    start = time.perf_counter()
    jax.block_until_ready(jitted(*arg_sets[0]))
    first_call = time.perf_counter() - start
    lowering = "custom call" if timing.uses_custom_call(jitted, *arg_sets[0]) \
        else "reference lowering"
    t = timing.time_calls(jitted, arg_sets, rounds=ROUNDS, round_seconds=budget.round_seconds())
    return {**t.as_dict(), "first_call_seconds": first_call, "lowering": lowering}


def max_abs_difference(expected, received) -> float:
    """Largest |difference| of y (the first output): a timed variant must compute the layer."""
    y_expected, y_received = jax.tree.leaves(expected)[0], jax.tree.leaves(received)[0]
    return float(jnp.max(jnp.abs(y_expected.astype(jnp.float32)
                                 - y_received.astype(jnp.float32))))


def measure_nvmath(nv: NvmathRunner, epilog: Epilog, arg_sets: list[tuple],
                   budget: timing.Budget) -> dict[str, Any]:
    plans = []
    try:
        plans = [nv.plan(epilog, *args) for args in arg_sets]
        t = timing.time_calls(lambda mm: mm.execute(), [(mm,) for mm in plans], sync=nv.sync,
                              rounds=ROUNDS, round_seconds=budget.round_seconds())
        return t.as_dict()
    except Exception as e:  # one unsupported problem must not end the run: record why
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for mm in plans:
            mm.free()


def summarise(record: dict[str, Any], flops: int, gemm_seconds: float) -> None:
    """Adds TFLOP/s, % of the plain GEMM's rate and the ratio against XLA to each result."""
    xla = record["results"].get("xla", {}).get("seconds")
    for result in record["results"].values():
        if "seconds" not in result:
            continue
        result["tflops"] = timing.tflops(flops, result["seconds"])
        result["pct_of_gemm"] = 100.0 * gemm_seconds / result["seconds"]
        if xla is not None:
            result["speedup_vs_xla"] = xla / result["seconds"]


def run(selected: list[Case], epilogs: list[Epilog], budget_seconds: float,
        use_nvmath: bool = True) -> dict[str, Any]:
    nv = NvmathRunner() if use_nvmath else None
    nv_ok = nv is not None and nv.available
    per_case = 1 + len(epilogs) * (3 if nv_ok else 2)
    started = time.perf_counter()
    bandwidth = measure_bandwidth(megabytes=1024 if selected[0].row in GRID else 16)
    budget = timing.Budget(budget_seconds, per_case * len(selected), rounds=ROUNDS)
    records = []
    with timing.progress_bar(per_case * len(selected), "forward") as bar:
        for case in selected:
            dtype = DTYPES[case.dtype]
            copies = timing.input_copies(bytes_moved(case.shape, dtype, Epilog.BIAS))
            arg_sets = random_inputs(case.shape, dtype, copies)
            flops = timing.gemm_flops(*case.shape)
            bar.set_postfix_str(f"{case.row} {case.dtype} gemm", refresh=False)
            gemm = measure_jax(jax.jit(plain_gemm), [args[:2] for args in arg_sets], budget)
            gemm["tflops"] = timing.tflops(flops, gemm["seconds"])
            bar.update()
            for epilog in epilogs:
                moved = bytes_moved(case.shape, dtype, epilog)
                record = {"row": case.row, "shape": list(case.shape), "dtype": case.dtype,
                          "epilog": epilog.name, "input_copies": copies, "flops": flops,
                          "bytes": moved, "bytes_floor_seconds": moved / bandwidth,
                          "gemm": gemm, "results": {}}
                bar.set_postfix_str(f"{case.row} {case.dtype} {epilog.name}", refresh=False)
                xla, ours = jax.jit(xla_layer(epilog)), jax.jit(epilog_layer(epilog))
                record["results"]["xla"] = measure_jax(xla, arg_sets, budget)
                bar.update()
                record["results"]["jax_epilog"] = measure_jax(ours, arg_sets, budget)
                record["results"]["jax_epilog"]["max_abs_diff_vs_xla"] = max_abs_difference(
                    xla(*arg_sets[0]), ours(*arg_sets[0]))
                bar.update()
                if nv_ok:
                    record["results"]["nvmath"] = measure_nvmath(nv, epilog, arg_sets, budget)
                    bar.update()
                summarise(record, flops, gemm["seconds"])
                records.append(record)
            del arg_sets
    notes = []
    if not nv_ok:
        notes.append("nvmath-python column omitted: "
                      + (nv.error if nv is not None else "disabled with --no-nvmath"))
    if any(r["results"]["jax_epilog"]["lowering"] != "custom call" for r in records):
        notes.append("jax_epilog rows marked 'reference lowering' ran the plain-JAX reference, "
                     "not cuBLASLt (no CUDA custom call on this platform/problem).")
    metadata = {**timing.run_metadata(), "nvmath": nv.version if nv_ok else None}
    return {"benchmark": "forward", "metadata": metadata,
            "method": {"rounds": ROUNDS, "budget_seconds": budget_seconds,
                       "timing": "median over rounds of back-to-back calls, one sync per round",
                       "speedup_vs_xla": "XLA time / this time (> 1: faster than XLA)"},
            "bandwidth_bytes_per_second": bandwidth,
            "elapsed_seconds": time.perf_counter() - started,
            "notes": notes, "records": records}


# --- report --------------------------------------------------------------------------------

def _cell(result: dict[str, Any], key: str, fmt: str) -> str:
    return format(result[key], fmt) if key in result else "–"


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    has_nvmath = any("nvmath" in r["results"] for r in report["records"])
    lines = [
        "# Forward epilog benchmark",
        "",
        timing.provenance(meta, *([meta["nvmath"]] if meta.get("nvmath") else [])),
        "",
        "Time per call (µs, median of rounds), TFLOP/s (2·B·K·N), % of the plain GEMM's rate "
        "for the same shape and dtype, and speed-up against XLA on the plain-JAX expression "
        "(XLA time / time; > 1 is faster). Floors: FLOPs at the measured GEMM rate is the GEMM's "
        "own time; 'bytes floor' is the least traffic of the call (x, W, b read once; y and the "
        "aux written once) at the measured elementwise bandwidth, "
        f"{report['bandwidth_bytes_per_second'] / 1e9:.0f} GB/s (read + write).",
        "",
    ]
    lines += [f"- {note}" for note in report["notes"]]
    header = ["row", "dtype", "M×K×N", "epilog", "bytes floor µs", "GEMM µs", "GEMM TFLOP/s", "XLA µs",
              "XLA % GEMM", "jax_epilog µs", "TFLOP/s", "% GEMM", "vs XLA", "max |Δy| vs XLA"]
    if has_nvmath:
        header += ["nvmath µs", "nvmath % GEMM", "nvmath vs XLA"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in report["records"]:
        res = r["results"]
        ours = res["jax_epilog"]
        epilog = r["epilog"] + ("" if ours["lowering"] == "custom call"
                                else " (reference lowering)")
        cells = [r["row"], r["dtype"], "×".join(map(str, r["shape"])), epilog,
                 f"{r['bytes_floor_seconds'] * 1e6:.1f}",
                 f"{r['gemm']['seconds'] * 1e6:.1f}", f"{r['gemm']['tflops']:.4g}",
                 f"{res['xla']['seconds'] * 1e6:.1f}", _cell(res["xla"], "pct_of_gemm", ".1f"),
                 f"{ours['seconds'] * 1e6:.1f}", _cell(ours, "tflops", ".4g"),
                 _cell(ours, "pct_of_gemm", ".1f"), _cell(ours, "speedup_vs_xla", ".3f"),
                 _cell(ours, "max_abs_diff_vs_xla", ".3g")]
        if has_nvmath:
            nvm = res.get("nvmath", {})
            cells += ["error" if "error" in nvm else
                      (f"{nvm['seconds'] * 1e6:.1f}" if "seconds" in nvm else "–"),
                      _cell(nvm, "pct_of_gemm", ".1f"), _cell(nvm, "speedup_vs_xla", ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [(r["row"], r["dtype"], r["epilog"], r["results"]["nvmath"]["error"])
              for r in report["records"] if "error" in r["results"].get("nvmath", {})]
    if errors:
        lines += ["", "nvmath-python errors:"]
        lines += [f"- {row} {dtype} {epilog}: {error}" for row, dtype, epilog, error in errors]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    parser.add_argument("--rows", help="comma-separated grid ids (default: all)")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32",
                        help="comma-separated from bf16, fp16, fp32 (fp16/fp32 on G1–G3 only)")
    parser.add_argument("--epilogs", default=",".join(e.name for e in EPILOGS),
                        help="comma-separated forward epilog names")
    parser.add_argument("--budget", type=float, default=None,
                        help="total seconds for the run, compilation included (default 240; "
                             "smoke 10): sets how long each timed round lasts (10–50 ms)")
    parser.add_argument("--no-nvmath", action="store_true", help="skip nvmath-python")
    return parser.parse_args(argv)


def choose(given: Optional[str], allowed, what: str) -> list[str]:
    names = list(allowed) if not given else [s.strip() for s in given.split(",") if s.strip()]
    unknown = [s for s in names if s not in allowed]
    if unknown:
        raise SystemExit(f"--{what}: expected names from {', '.join(allowed)}, got {unknown}")
    return names


def main(argv=None) -> None:
    args = parse_args(argv)
    grid = SMOKE_GRID if args.smoke else GRID
    rows = choose(args.rows, grid, "rows")
    dtypes = choose(args.dtypes, DTYPES, "dtypes")
    epilogs = [Epilog[name] for name in choose(args.epilogs.upper(),
                                                [e.name for e in EPILOGS], "epilogs")]
    budget = args.budget if args.budget is not None else (10.0 if args.smoke else 240.0)
    report = run(cases(grid, rows, dtypes), epilogs, budget,
                 use_nvmath=not args.no_nvmath)
    timing.write_report(report, args.out, "forward", markdown, plot.plot_forward)


if __name__ == "__main__":
    main()
