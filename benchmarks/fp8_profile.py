"""Where an FP8 training step's time goes (issue 13): the GPU kernels of a few traced steps.

For one row of fp8_bench.py (default M1) and some of its variants, each step is compiled,
warmed, and `--steps` calls are traced with `jax.profiler`. From the trace's GPU kernels, per
step: the kernel time (the sum of kernel durations), how much of it is GEMMs (cuBLAS/cuBLASLt
kernels, ours and XLA's) and how much everything else (XLA's fusions: quantization, amax,
transposes, ReLU derivatives, bias gradients, the loss), the gaps (step wall time in the trace
minus kernel time), each GEMM's duration in launch order, and the kernels that took longest.

    python benchmarks/fp8_profile.py --out benchmarks/results/fp8_profile      # H200
    python benchmarks/fp8_profile.py --peer --row W2,TMLP --out /tmp/peer      # H200, ~2 min
    python benchmarks/fp8_profile.py --smoke --out /tmp/fp8_profile            # any CPU

`--peer` profiles fp8_peer.py's rows and variants instead (default Flax's
`Fp8DirectDotGeneralOp` and our `fp8=True`), from the same parameters after fp8_peer's
calibrating steps: where Flax's FP8 step and ours differ, kernel by kind. `--swiglu` does the
same for swiglu_bench.py's SwiGLU block (default row EX, Flax's FP8 and `SwiGLU(fp8=True)`):

    python benchmarks/fp8_profile.py --swiglu --row EX --out /tmp/swiglu_profile  # H200

On a CPU the trace has no GPU kernels: the report then says so (the smoke run checks the
plumbing only). Writes `<out>/fp8_profile.json`, `.md`, each variant's optimized HLO
(`<variant>.hlo.txt`, where the trace's fusion names are defined) and the traces under
`<out>/traces/`.
"""

from __future__ import annotations

import argparse
import collections
import functools
from pathlib import Path
from typing import Any

import jax

import fp8_bench
import fp8_peer
import gpu_trace
import never_slower
import timing

DEFAULT_VARIANTS = ("xla_bf16", "ours_fp8", "ours_fp8_delayed", "xla_fp8", "xla_fp8_precise")
TOP_KERNELS = 20


def kernel_breakdown(kernels: list[gpu_trace.Kernel], steps: int) -> dict[str, Any]:
    """Per-step figures of the traced kernels of `steps` identical steps."""
    if not kernels:
        return {"note": "no GPU kernels in the trace (a CPU run, or no CUPTI)"}
    gemms = [k for k in kernels if gpu_trace.GEMM_KERNEL.search(k.name)]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for k in kernels:
        by_name[k.name].append(k.duration_ns)
    per_step = len(gemms) // steps if steps else 0
    kernel_ns = sum(k.duration_ns for k in kernels)
    gemm_ns = sum(k.duration_ns for k in gemms)
    span_ns = max(k.end_ns for k in kernels) - min(k.start_ns for k in kernels)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms": kernel_ns / steps / 1e6,
        "gemm_ms": gemm_ns / steps / 1e6,
        "other_ms": (kernel_ns - gemm_ns) / steps / 1e6,
        "span_ms": span_ns / steps / 1e6,
        "gemms_per_step": per_step,
        # The last traced step's GEMMs in launch order (steady state), with what launched them.
        "gemm_sequence": [{"ms": k.duration_ns / 1e6, "kernel": k.name[:90],
                           "hlo_op": k.hlo_op} for k in gemms[-per_step:]] if per_step else [],
        "top_kernels": [{"name": name[:90], "calls_per_step": len(d) / steps,
                         "ms_per_step": sum(d) / steps / 1e6,
                         "gemm": bool(gpu_trace.GEMM_KERNEL.search(name))} for name, d in top],
    }


def profile_variant(w, name: str, steps: int, folder: Path, table=None) -> dict[str, Any]:
    """A variant of fp8_bench.py (or of `table`, in its form) on its row `w`."""
    args = never_slower.random_inputs(w, 0)
    step, extra = fp8_bench.variant_step(w, name, args, table)
    args = (*args, *extra)
    compiled, fallbacks = fp8_bench.compile_without_fallbacks(step, args)
    return {**profile_compiled(compiled, args, name, steps, folder), "fallbacks": fallbacks}


def profile_peer_variant(w, name: str, steps: int, folder: Path) -> dict[str, Any]:
    """A variant of fp8_peer.py (Flax's FP8 or one of our linen recipes) on its row `w`,
    from the same parameters as every other, after fp8_peer's calibrating steps."""
    return _profile_linen(fp8_peer.VARIANTS[name](w), fp8_peer.VARIANTS["flax_bf16"](w),
                          (w.batch, w.widths[0]), name, steps, folder, fp8_peer.describe)


def profile_swiglu_variant(row: tuple[int, int, int], name: str, steps: int,
                           folder: Path) -> dict[str, Any]:
    """A variant of swiglu_bench.py (the RMSNorm + SwiGLU + residual step) on its row
    `(tokens, D, F)`, from flax_bf16's parameters, after fp8_peer's calibrating steps."""
    import swiglu_bench  # only here: it imports Flax's FP8 ops

    tokens, d, f = row
    return _profile_linen(swiglu_bench.VARIANTS[name](f), swiglu_bench.VARIANTS["flax_bf16"](f),
                          (tokens, d), name, steps, folder, swiglu_bench.describe)


def _profile_linen(model, bf16_model, x_shape, name: str, steps: int, folder: Path,
                   describe) -> dict[str, Any]:
    """fp8_peer's training step of the linen `model`, from `bf16_model`'s parameters, traced
    after fp8_peer's calibrating steps."""
    x = jax.random.normal(jax.random.key(0), x_shape, fp8_peer.DTYPE)
    params = fp8_peer.initial_variables(bf16_model, x)["params"]
    variables = fp8_peer.initial_variables(model, x, params)
    compiled, fallbacks = fp8_bench.compile_without_fallbacks(fp8_peer.make_step(model),
                                                              (variables, x))
    for _ in range(fp8_peer.CALIBRATION_STEPS):
        variables = fp8_peer.next_variables(variables, compiled(variables, x)[1])
    return {**profile_compiled(compiled, (variables, x), name, steps, folder),
            "model": describe(model), "fallbacks": fallbacks}


def profile_compiled(compiled, args, name: str, steps: int, folder: Path) -> dict[str, Any]:
    """Time `compiled(*args)`, then trace `steps` calls of it and break the kernels down."""
    folder.mkdir(parents=True, exist_ok=True)
    # The optimized HLO beside the trace: the trace names XLA's kernels by fusion only.
    (folder.parent.parent / f"{name}.hlo.txt").write_text(compiled.as_text())
    jax.block_until_ready(compiled(*args))  # warm: the trace holds steady-state steps only
    timed = timing.time_calls(compiled, [args], rounds=5, round_seconds=0.5)
    with jax.profiler.trace(str(folder)):
        for _ in range(steps):
            result = compiled(*args)
        jax.block_until_ready(result)
    trace = gpu_trace.latest_trace(folder)
    devices = gpu_trace.gpu_kernels(trace) if trace else {}
    kernels = next(iter(devices.values()), [])
    return {"step_ms": timed.seconds * 1e3, "temp_mib": never_slower._temp_mib(compiled),
            "gemms": fp8_bench.gemm_counts(compiled.as_text()),
            "trace": str(trace) if trace else None, **kernel_breakdown(kernels, steps)}


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = [f"# Where the FP8 step's time goes: {report['row']}", "",
             f"{meta['date']} · {meta['gpu_name'] or meta['device']} · jax {meta['jax']} · "
             f"cuBLASLt {meta['cublaslt_version']} · {report['steps']} traced steps per variant",
             "", "Per step. step ms: timed outside the trace (median of 5 rounds). kernel ms: "
             "the sum of GPU kernel durations in the trace; GEMM ms: the cuBLAS/cuBLASLt "
             "kernels of it (ours and XLA's); other ms: everything else (XLA's fusions: "
             "quantization, amax, transposes, derivatives, bias gradients, the loss); span: "
             "first kernel start to last kernel end, per step.", "",
             "| variant | step ms | kernel ms | GEMM ms | other ms | span ms | GEMMs | "
             "kernels | temp MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | {v['error']} |||||||")
            continue
        cells = [fp8_bench._cell(v.get(k)) for k in ("step_ms", "kernel_ms", "gemm_ms",
                                                      "other_ms", "span_ms")]
        lines.append(f"| {name} | {' | '.join(cells)} | {v.get('gemms_per_step', '–')} | "
                     f"{fp8_bench._cell(v.get('kernels_per_step'), '.0f')} | "
                     f"{fp8_bench._cell(v.get('temp_mib'), '.0f')} |")
    for name, v in report["variants"].items():
        if v.get("note"):
            lines += ["", f"{name}: {v['note']}"]
        if v.get("gemm_sequence"):
            lines += ["", f"## {name}: GEMMs in launch order (ms)", "",
                      ", ".join(f"{g['ms']:.3f}" for g in v["gemm_sequence"]), "",
                      "| kernel | calls | ms per step |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['calls_per_step']:.0f} | {k['ms_per_step']:.3f} |"
                      for k in v["top_kernels"]]
    lines += timing.footnotes(meta, [])
    return "\n".join(lines) + "\n"


PEER_VARIANTS = ("flax_fp8_direct", "ours_fp8")
SWIGLU_VARIANTS = ("flax_fp8_direct", "ours_swiglu_fp8")
BLOCK_VARIANTS = ("ours_fp8", "ours_fp8_block")


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_profile"))
    parser.add_argument("--row", default=None,
                        help="rows of fp8_bench, of fp8_peer with --peer or of swiglu_bench "
                             "with --swiglu, comma-separated (default M1, --swiglu EX; smoke "
                             "S1, T1); with several, each goes to <out>/<row>")
    parser.add_argument("--peer", action="store_true",
                        help=f"fp8_peer's rows and variants (default {','.join(PEER_VARIANTS)}): "
                             "Flax's FP8 beside ours")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of: {', '.join(fp8_bench.VARIANTS)} (default "
                             f"{','.join(DEFAULT_VARIANTS)}); with --peer of "
                             f"{', '.join(fp8_peer.VARIANTS)}")
    parser.add_argument("--block", action="store_true",
                        help="block_fp8_bench.py's step variants (default "
                             f"{','.join(BLOCK_VARIANTS)}): block-scaled training beside "
                             "per-tensor")
    parser.add_argument("--swiglu", action="store_true",
                        help="swiglu_bench.py's rows (default EX; smoke T1) and variants "
                             f"(default {','.join(SWIGLU_VARIANTS)}): the SwiGLU block's step, "
                             "Flax's FP8 beside ours")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    args = parser.parse_args(argv)
    if sum((args.peer, args.block, args.swiglu)) > 1:
        parser.error("--peer, --block and --swiglu: at most one")
    if args.swiglu:
        import swiglu_bench  # only here: it imports Flax's FP8 ops

        source, default_row, defaults = swiglu_bench, ("T1", "EX"), SWIGLU_VARIANTS
    elif args.peer:
        source, default_row, defaults = fp8_peer, ("S1", "M1"), PEER_VARIANTS
    else:
        source, default_row = fp8_bench, ("S1", "M1")
        defaults = BLOCK_VARIANTS if args.block else DEFAULT_VARIANTS
    table = source.SMOKE_ROWS if args.smoke else source.ROWS
    rows = [r.strip() for r in (args.row or default_row[0 if args.smoke else 1]).split(",")]
    variants = [v.strip() for v in (args.variants or ",".join(defaults)).split(",") if v.strip()]
    known = source.VARIANTS
    profile = (profile_swiglu_variant if args.swiglu else profile_peer_variant if args.peer
               else profile_variant)
    if args.block:
        import block_fp8_bench  # only here: it builds its variants when imported

        known = block_fp8_bench.STEP_VARIANTS
        profile = functools.partial(profile_variant, table=known)
    unknown = sorted(set(variants) - set(known)) + [r for r in rows if r not in table]
    if unknown:
        parser.error(f"unknown rows or variants: {unknown}")
    for row in rows:
        out = args.out / row if len(rows) > 1 else args.out
        report = {"benchmark": "fp8_profile", "metadata": timing.run_metadata(), "row": row,
                  "peer": args.peer, "swiglu": args.swiglu, "steps": args.steps,
                  "variants": {}}
        for name in variants:
            try:
                report["variants"][name] = profile(table[row], name, args.steps,
                                                   out / "traces" / name)
            except Exception as e:  # noqa: BLE001  (one variant failing must not end the run)
                report["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
            timing.write_report(report, out, "fp8_profile", markdown)
            v = report["variants"][name]
            ms = {k: v.get(k, float("nan")) for k in ("step_ms", "gemm_ms", "other_ms")}
            print(f"{row} {name}: step {ms['step_ms']:.3f} ms, GEMM {ms['gemm_ms']:.3f} ms, "
                  f"other {ms['other_ms']:.3f} ms {v.get('error', v.get('note', ''))}",
                  flush=True)
    return report


if __name__ == "__main__":
    main()
