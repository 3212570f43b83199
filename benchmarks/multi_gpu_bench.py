"""Two GPUs and more: data-parallel M1, a tensor-parallel MLP block, and whether the
all-reduces overlap jax-epilog's custom calls (issue 12 part 5).

- **Data parallel, M1** (benchmarks/README.md): a 4-layer ReLU MLP of width 4096, batch 65536, bf16,
  `value_and_grad` of a mean-squared loss. On n devices the batch is sharded over a 1-D mesh
  ("data") and the parameters replicated; jax-epilog's partitioning runs every GEMM on the local
  rows and XLA all-reduces the weight gradients.
- **Tensor parallel, one MLP block** (Megatron's): 16384 tokens × 4096 → 16384 → 4096, under
  `jax.shard_map` over a 1-D mesh ("model"): the up-projection's columns (W1, b1) and the
  down-projection's rows (W2) are split over the devices, so each device computes
  `relu(x @ W1_i + b1_i) @ W2_i` and one `psum` adds the partial results (then b2). The input
  is replicated. Timed: the training step (`value_and_grad` w.r.t. the parameters).

Each is timed with `timing.time_calls` for jax-epilog (`jax_epilog.mlp` / `jax_epilog.dense`,
their default backend, as a user calls them) and for XLA on the plain-JAX expression, on 1
device and on n; reported: ms per step, TFLOP/s (3 GEMMs per layer), the speed-up n-device /
1-device, and the collectives in the compiled program (data parallel: no all-gather).

`--profile DIR` also traces a few M1 steps on n devices with `jax.profiler` (one folder per
implementation, with the compiled HLO beside it) and summarises, for each implementation:
- from the scheduled HLO: the order of GEMMs (ours: the `jax_epilog_matmul` custom call; XLA's:
  cuBLAS custom calls, Triton GEMM fusions, dots) and collectives, and for each asynchronous
  all-reduce (start/done pair) the GEMMs scheduled between its start and its done, which are
  the ones it can overlap;
- from the trace: on each GPU, the time of the NCCL kernels and how much of it GEMM kernels on
  another stream ran alongside.

    python benchmarks/multi_gpu_bench.py                   # every visible GPU (needs >= 2)
    python benchmarks/multi_gpu_bench.py --profile /tmp/prof
    python benchmarks/multi_gpu_bench.py --smoke           # tiny shapes on 2 host CPU devices
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import gpu_trace

M1 = dict(batch=65536, widths=[4096] * 5)
TP = dict(tokens=16384, model=4096, hidden=16384)
SMOKE = dict(batch=256, widths=[128] * 5)
SMOKE_TP = dict(tokens=256, model=128, hidden=512)
PROFILE_STEPS = 3
IMPLEMENTATIONS = ("jax-epilog", "XLA")

OUR_TARGET = "jax_epilog_matmul"  # targets.MATMUL.name, here without importing JAX
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# XLA's own GEMMs in optimized HLO: cuBLAS(Lt) custom calls, Triton GEMM fusions, plain dots.
XLA_GEMM = re.compile(r'custom_call_target="__cublas|__triton_gemm|gemm_fusion|\bdot\(')


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 2 host CPU devices")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default="dp,tp",
                        help="comma-separated: dp (data-parallel M1), tp (tensor-parallel block)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help=f"trace {PROFILE_STEPS} M1 steps per implementation into DIR and "
                             "summarise how all-reduces overlap the GEMMs")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - {"dp", "tp"}:
        parser.error(f"--parts: expected names from dp, tp, got {args.parts!r}")
    if args.profile is not None and "dp" not in parts:
        parser.error("--profile traces the data-parallel M1 step: keep dp in --parts")
    if args.smoke:  # before jax is imported: the host platform's device count is read once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=2").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    report = run(parts, SMOKE if args.smoke else M1, SMOKE_TP if args.smoke else TP,
                 args.rounds, args.profile)
    import timing  # after XLA_FLAGS are set (above), like jax

    print(markdown(report))
    timing.write_report(report, args.out, "multi_gpu", markdown)


def run(parts: list[str], shape: dict, tp_shape: dict, rounds: int,
        profile: Optional[Path]) -> dict:
    import jax

    sys.path.insert(0, str(Path(__file__).parent))
    import timing

    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"multi_gpu_bench: needs at least 2 devices, sees {len(devices)} "
                         f"({devices[0].device_kind}); run it on a machine with 2 or more GPUs")
    report: dict[str, Any] = {"dtype": "bfloat16"}
    if "dp" in parts:
        report["data_parallel"] = data_parallel(shape, rounds, profile)
    if "tp" in parts:
        report["tensor_parallel"] = tensor_parallel(tp_shape, rounds)
    report["metadata"] = timing.run_metadata()
    return report


def _random(key, shape, dtype, scale=1.0):
    import jax
    import jax.numpy as jnp

    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _mse_step(forward):
    """`value_and_grad` w.r.t. the parameters of a mean-squared loss of `forward(x, params)`."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, target):
        error = forward(x, params).astype(jnp.float32) - target
        return 0.5 * jnp.mean(error * error)

    return jax.value_and_grad(loss)


def _row(timing, name: str, n_dev: int, compiled, args, flops: float, rounds: int) -> dict:
    text = compiled.as_text()
    t = timing.time_calls(compiled, [args], rounds=rounds)
    return {"implementation": name, "devices": n_dev, "ms": 1e3 * t.seconds,
            "tflops": timing.tflops(flops, t.seconds), "timing": t.as_dict(),
            "all_gathers": text.count("all-gather-start") + text.count(" all-gather("),
            "all_reduces": text.count("all-reduce-start") + text.count(" all-reduce("),
            "memory": timing.memory_analysis(compiled)}


def _add_speedups(rows: list[dict]) -> None:
    """Each implementation's n-device row gets its speed-up over its 1-device row."""
    for name in IMPLEMENTATIONS:
        mine = {row["devices"]: row for row in rows if row["implementation"] == name}
        if 1 in mine and len(mine) > 1:
            many = mine[max(mine)]
            many["speedup"] = mine[1]["ms"] / many["ms"]


def data_parallel(shape: dict, rounds: int, profile: Optional[Path]) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_epilog
    import timing

    devices = jax.devices()
    batch, widths = shape["batch"], shape["widths"]
    dtype = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(widths) + 2))
    x = _random(next(keys), (batch, widths[0]), dtype)
    target = _random(next(keys), (batch, widths[-1]), dtype)
    params = tuple((_random(next(keys), (k, n), dtype, 1 / np.sqrt(k)),
                    _random(next(keys), (n,), dtype, 0.1))
                   for k, n in zip(widths, widths[1:]))

    def xla_mlp(x, layers):
        for i, (w, b) in enumerate(layers):
            x = jnp.dot(x, w) + b
            x = jax.nn.relu(x) if i < len(layers) - 1 else x
        return x

    flops = 3 * sum(timing.gemm_flops(batch, k, n) for k, n in zip(widths, widths[1:]))
    rows, overlap = [], {}
    for name, mlp in zip(IMPLEMENTATIONS, (jax_epilog.mlp, xla_mlp)):
        for n_dev in (1, len(devices)):
            mesh = jax.sharding.Mesh(np.array(devices[:n_dev]), ("data",))
            data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
            args = jax.device_put((params, x, target), (replicated, data, data))
            compiled = jax.jit(_mse_step(mlp), in_shardings=(replicated, data, data)).lower(
                *args).compile()
            rows.append(_row(timing, name, n_dev, compiled, args, flops, rounds))
            if profile is not None and n_dev > 1:
                overlap[name] = profile_steps(compiled, args, profile / name.lower())
    _add_speedups(rows)
    result = {"shape": shape, "rows": rows}
    if profile is not None:
        result["overlap"] = overlap
    return result


def tensor_parallel(shape: dict, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_epilog
    import timing

    devices = jax.devices()
    tokens, model, hidden = shape["tokens"], shape["model"], shape["hidden"]
    dtype = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(1), 6))
    x = _random(next(keys), (tokens, model), dtype)
    target = _random(next(keys), (tokens, model), dtype)
    params = (_random(next(keys), (model, hidden), dtype, 1 / np.sqrt(model)),
              _random(next(keys), (hidden,), dtype, 0.1),
              _random(next(keys), (hidden, model), dtype, 1 / np.sqrt(hidden)),
              _random(next(keys), (model,), dtype, 0.1))
    specs = (P(None, "model"), P("model"), P("model", None), P())  # W1, b1, W2, b2
    layers = {
        "jax-epilog": (lambda x, w, b: jax_epilog.dense(x, w, b, activation="relu"),
                       lambda h, w: jax_epilog.dense(h, w)),
        "XLA": (lambda x, w, b: jax.nn.relu(x @ w + b), lambda h, w: h @ w),
    }
    flops = 3 * (timing.gemm_flops(tokens, model, hidden)
                 + timing.gemm_flops(tokens, hidden, model))
    rows = []
    for name in IMPLEMENTATIONS:
        up, down = layers[name]

        def local_block(x, w1, b1, w2, b2, up=up, down=down):
            return jax.lax.psum(down(up(x, w1, b1), w2), "model") + b2

        for n_dev in (1, len(devices)):
            mesh = jax.sharding.Mesh(np.array(devices[:n_dev]), ("model",))
            block = jax.shard_map(local_block, mesh=mesh, in_specs=(P(), *specs), out_specs=P())
            shardings = tuple(NamedSharding(mesh, spec) for spec in specs)
            replicated = NamedSharding(mesh, P())
            args = jax.device_put((params, x, target), (shardings, replicated, replicated))
            step = _mse_step(lambda x, params, block=block: block(x, *params))
            compiled = jax.jit(step, in_shardings=(shardings, replicated, replicated)).lower(
                *args).compile()
            rows.append(_row(timing, name, n_dev, compiled, args, flops, rounds))
    _add_speedups(rows)
    return {"shape": shape, "rows": rows}


def profile_steps(compiled, args, folder: Path) -> dict:
    """Traces PROFILE_STEPS calls of `compiled` into `folder` (with its HLO beside) and
    summarises how its collectives and GEMMs interleave in the schedule and in the trace."""
    import jax

    folder.mkdir(parents=True, exist_ok=True)
    text = compiled.as_text()
    (folder / "step.hlo.txt").write_text(text)
    jax.block_until_ready(compiled(*args))  # warm: the trace holds steady-state steps only
    summary = {"folder": str(folder), "schedule": schedule_summary(text)}
    try:  # a profiler that cannot start (no CUPTI) must not cost the run its timings
        with jax.profiler.trace(str(folder)):
            for _ in range(PROFILE_STEPS):
                result = compiled(*args)
            jax.block_until_ready(result)
    except Exception as e:  # noqa: BLE001  (reported in the summary instead)
        summary["trace"] = {"devices": [], "note": f"tracing failed: {type(e).__name__}: {e}"}
        return summary
    trace = gpu_trace.latest_trace(folder)
    summary["trace"] = (trace_overlap(trace) if trace else
                        {"devices": [], "note": f"jax.profiler wrote no .xplane.pb under {folder}"})
    return summary


# --- the scheduled HLO ------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\s([a-z][a-z\-]*)\(")
_CALLS = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")


def _computations(text: str) -> tuple[dict[str, list[str]], Optional[str]]:
    """Each computation's instruction lines, in order, and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            computations[current].append(line)
    return computations, entry


def _events(computations: dict[str, list[str]], name: str, depth: int = 0) -> list[tuple]:
    """(kind, instruction, collective, line) in schedule order, with `call`s (e.g. XLA's
    command buffers) expanded. Kinds: ours, xla_gemm, collective (synchronous), start, done."""
    events = []
    for line in computations.get(name, []):
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        instruction, op = match.groups()
        called = _CALLS.search(line)
        kind, collective = None, None
        if f'custom_call_target="{OUR_TARGET}"' in line:
            kind = "ours"
        elif XLA_GEMM.search(line) or (op == "fusion" and called and any(
                " dot(" in inner for inner in computations.get(called.group(1), []))):
            kind = "xla_gemm"  # a GEMM, or a fusion around a dot (the CPU's since jax 0.12)
        elif op in COLLECTIVES:
            kind, collective = "collective", op
        elif op.endswith("-start") and op[:-len("-start")] in COLLECTIVES:
            kind, collective = "start", op[:-len("-start")]
        elif op.endswith("-done") and op[:-len("-done")] in COLLECTIVES:
            kind, collective = "done", op[:-len("-done")]
        elif op == "async-start" and called:  # a collective XLA wrapped as async
            inner = [m.group(2) for m in map(_INSTRUCTION.match,
                                             computations.get(called.group(1), [])) if m]
            collective = next((op for op in inner if op in COLLECTIVES), None)
            kind = "start" if collective else None
        elif op == "async-done":
            kind = "done"
        elif op == "call" and called and depth < 8:
            events.extend(_events(computations, called.group(1), depth + 1))
        if kind is not None:
            events.append((kind, instruction, collective, line))
    return events


def schedule_summary(hlo_text: str) -> dict:
    """Where the collectives sit among the GEMMs in the compiled (scheduled) HLO: an order
    string (O: our custom call, X: XLA's GEMM, C: a synchronous collective, <i and >i: the
    start and done of asynchronous collective i) and, per asynchronous collective, the GEMMs
    scheduled between its start and done."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        return {"error": "no ENTRY computation in the HLO text"}
    tokens, pending, pairs = [], {}, []
    counts = {"ours": 0, "xla_gemm": 0, "collective": 0}
    starts = 0
    for kind, instruction, collective, line in _events(computations, entry):
        if kind in counts:
            counts[kind] += 1
            tokens.append({"ours": "O", "xla_gemm": "X", "collective": "C"}[kind])
            for pair in pending.values():
                if kind in pair:
                    pair[kind] += 1
        elif kind == "start":
            pending[instruction] = {"index": starts, "collective": collective, "ours": 0,
                                    "xla_gemm": 0}
            tokens.append(f"<{starts}")
            starts += 1
        else:  # a done's operand is the start it waits for
            operands = line.split("(", 1)[1] if "(" in line else ""
            started = next((s for s in pending
                            if re.search(rf"(^|[\s,%]){re.escape(s)}[\s,)]", operands)), None)
            if started is not None:
                pair = pending.pop(started)
                tokens.append(f">{pair['index']}")
                pairs.append(pair)
    pairs.sort(key=lambda pair: pair["index"])
    return {"scheduled": "is_scheduled=true" in hlo_text, "order": " ".join(tokens),
            "our_custom_calls": counts["ours"], "xla_gemms": counts["xla_gemm"],
            "synchronous_collectives": counts["collective"], "async_collectives": pairs,
            "async_overlapping_ours": sum(pair["ours"] > 0 for pair in pairs),
            "async_overlapping_any_gemm": sum(pair["ours"] + pair["xla_gemm"] > 0
                                              for pair in pairs)}


# --- the trace --------------------------------------------------------------------------------

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def overlap_ns(collectives: list[tuple[float, float, str]],
               gemms: list[tuple[float, float, str]]) -> float:
    """Nanoseconds of `collectives` (start, end, stream) during which a GEMM ran on another
    stream."""
    total = 0.0
    for start, end, stream in collectives:
        others = _union([(s, e) for s, e, gemm_stream in gemms if gemm_stream != stream])
        total += sum(max(0.0, min(end, e) - max(start, s)) for s, e in others)
    return total


def trace_overlap(xplane: Path) -> dict:
    """Per GPU in the trace: NCCL kernel time, GEMM kernel time, and the NCCL time during which
    a GEMM kernel ran on another stream."""
    devices = []
    for device, kernels in gpu_trace.gpu_kernels(xplane).items():
        collectives = [(k.start_ns, k.end_ns, k.stream) for k in kernels
                       if gpu_trace.NCCL_KERNEL.search(k.name)]
        gemms = [(k.start_ns, k.end_ns, k.stream) for k in kernels
                 if gpu_trace.GEMM_KERNEL.search(k.name)
                 and not gpu_trace.NCCL_KERNEL.search(k.name)]
        nccl_ns = sum(end - start for start, end, _ in collectives)
        devices.append({"device": device, "nccl_kernels": len(collectives),
                        "nccl_ms": nccl_ns / 1e6, "gemm_kernels": len(gemms),
                        "gemm_ms": sum(end - start for start, end, _ in gemms) / 1e6,
                        "nccl_overlapped_ms": overlap_ns(collectives, gemms) / 1e6})
    result: dict[str, Any] = {"file": str(xplane), "steps": PROFILE_STEPS, "devices": devices}
    if not devices:
        result["note"] = "no GPU streams in the trace (a CPU run, or no CUPTI)"
    return result


# --- the report -------------------------------------------------------------------------------

def _table(rows: list[dict]) -> list[str]:
    lines = ["| implementation | devices | ms / step | TFLOP/s (total) | speed-up vs 1 "
             "| all-gathers | all-reduces |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
        lines.append(f"| {row['implementation']} | {row['devices']} | {row['ms']:.2f} | "
                     f"{row['tflops']:.0f} | {speedup} | {row['all_gathers']} | "
                     f"{row['all_reduces']} |")
    return lines


def _overlap_lines(overlap: dict) -> list[str]:
    lines = ["", "### All-reduces and GEMMs in the data-parallel step (n devices)", "",
             "Schedule (compiled HLO): O our custom call, X XLA's GEMM, C synchronous "
             "collective, <i / >i start / done of asynchronous collective i. Trace: NCCL kernel "
             "time over the traced steps, and how much of it a GEMM kernel on another stream "
             "ran alongside.", ""]
    for name, summary in overlap.items():
        schedule, trace = summary["schedule"], summary["trace"]
        if "error" in schedule:
            lines.append(f"- **{name}**: schedule not read: {schedule['error']}")
            continue
        pairs = schedule["async_collectives"]
        lines.append(
            f"- **{name}**: {schedule['our_custom_calls']} of our custom calls, "
            f"{schedule['xla_gemms']} XLA GEMMs, {len(pairs)} asynchronous collectives "
            f"({schedule['async_overlapping_ours']} with at least one of our custom calls "
            f"between start and done, {schedule['async_overlapping_any_gemm']} with any GEMM), "
            f"{schedule['synchronous_collectives']} synchronous; order: `{schedule['order']}`")
        for device in trace["devices"]:
            share = (device["nccl_overlapped_ms"] / device["nccl_ms"]
                     if device["nccl_ms"] else 0.0)
            lines.append(f"  - trace {device['device']}: NCCL {device['nccl_kernels']} kernels, "
                         f"{device['nccl_ms']:.2f} ms, {share:.0%} alongside GEMMs "
                         f"({device['gemm_kernels']} GEMM kernels, {device['gemm_ms']:.2f} ms)")
        if "note" in trace:
            lines.append(f"  - trace: {trace['note']}")
        lines.append(f"  - files: {summary['folder']}")
    return lines


def markdown(report: dict) -> str:
    lines = []
    if "data_parallel" in report:
        dp = report["data_parallel"]
        shape = dp["shape"]
        lines += [f"# Data-parallel M1 step: batch {shape['batch']}, widths {shape['widths']}, "
                  f"{report['dtype']}", "", *_table(dp["rows"])]
        if "overlap" in dp:
            lines += _overlap_lines(dp["overlap"])
        lines.append("")
    if "tensor_parallel" in report:
        tp = report["tensor_parallel"]
        shape = tp["shape"]
        lines += [f"# Tensor-parallel MLP block, training step: {shape['tokens']} tokens × "
                  f"{shape['model']} → {shape['hidden']} → {shape['model']}, "
                  f"{report['dtype']} (W1 columns and W2 rows split; one psum)", "",
                  *_table(tp["rows"]), ""]
    meta = report["metadata"]
    lines += ["Run: " + ", ".join(f"{k}={v}" for k, v in meta.items()
                                  if isinstance(v, (str, int, float)))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
