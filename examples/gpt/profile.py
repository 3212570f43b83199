"""Where a GPT training step's time goes: the GPU kernels of a few traced steps per variant.

    python examples/gpt/profile.py --config large --variants flax_fp8,epilog_fp8 --out /tmp/p
    python examples/gpt/profile.py --config tiny --out /tmp/p                   # CPU: plumbing

Each variant (compare.py's names) is built from the same initial weights, compiled, warmed with
two steps, timed over `--steps` back-to-back steps (the wall clock: kernel time below it is
time the GPU waited) and traced for as many with `jax.profiler`. Per step, from the trace: the
kernel time, its GEMMs (cuBLAS/cuBLASLt kernels, ours and XLA's), attention (cuDNN's fused
kernels) and everything else (XLA's fusions: LayerNorm, quantization, amax, transposes,
derivatives, the optimizer), and the kernels that took longest, each with the HLO
instruction that launched it and, for a fusion, the operations inside it (read from the
optimized HLO), so a fusion can be told from a transpose or a cast. Writes `gpt_profile.json`
and `gpt_profile.md`.

Run as a script, it turns XLA's command buffers (CUDA graphs) off unless XLA_FLAGS sets
them: inside a graph every kernel is named after the graph, not its HLO op. Kernel times
stay comparable; the wall time then includes one launch per kernel, so it reads high for a
step of many small kernels.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import jax

import gpu_trace
import timing
from gpt import compare, configs, data, train

ATTENTION_KERNEL = re.compile(r"cudnn|fmha|flash|sdpa", re.IGNORECASE)
#: How many of the longest kernels the report lists, per kind: GEMMs are few and alike, while
#: the fusions are where two FP8 steps with the same GEMMs differ.
TOP_KERNELS = {"gemm": 10, "attention": 5, "other": 40}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"= \S+ ([a-z][\w\-]*)\(")


def hlo_index(hlo: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name -> its line, computation name -> the opcodes in its body)."""
    lines, bodies, current = {}, {}, None
    for line in hlo.splitlines():
        header = re.match(r"^\s*(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and "=" not in line.split("{", 1)[0]:
            current = header.group(1)
            bodies[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            lines[match.group(1)] = line.strip()
            opcode = _OPCODE.search(line)
            if current is not None and opcode:
                bodies[current].append(opcode.group(1))
    return lines, bodies


def describe_op(hlo_op: str, lines: dict[str, str], bodies: dict[str, list[str]]) -> str:
    """The launching instruction's result shape and, for a fusion, its distinct opcodes."""
    line = lines.get(hlo_op or "")
    if line is None:
        return ""
    shape = line.split(" = ", 1)[1].split(" ", 1)[0][:60]
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if not called or called.group(1) not in bodies:
        return shape
    ops = collections.Counter(o for o in bodies[called.group(1)] if o not in ("parameter",))
    return f"{shape}: " + ", ".join(f"{op}×{n}" if n > 1 else op for op, n in ops.most_common(8))


def training_kind(kernel: gpu_trace.Kernel, line: str) -> str:
    """A training step's kinds, by kernel name: GEMMs, cuDNN's attention, the rest."""
    return ("gemm" if gpu_trace.GEMM_KERNEL.search(kernel.name) else
            "attention" if ATTENTION_KERNEL.search(kernel.name) else "other")


def breakdown(kernels: list[gpu_trace.Kernel], steps: int, hlo: str,
              kind_of: Callable[[gpu_trace.Kernel, str], str] = training_kind,
              top_kernels: dict[str, int] = TOP_KERNELS) -> dict[str, Any]:
    """Per step: the kernel time of each kind (`kind_of(kernel, its launching HLO line)`, one
    of `top_kernels`' keys) and the longest kernels of each, `top_kernels[kind]` of them."""
    if not kernels:
        return {"note": "no GPU kernels in the trace (a CPU run, or no CUPTI)"}
    lines, bodies = hlo_index(hlo)
    kind = lambda k: kind_of(k, lines.get(k.hlo_op or "", ""))
    per_kind: dict[str, float] = collections.defaultdict(float)
    by_op: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for k in kernels:
        per_kind[kind(k)] += k.duration_ns
        by_op[(kind(k), k.hlo_op or k.name)].append(k.duration_ns)
    longest = sorted(by_op.items(), key=lambda item: -sum(item[1]))
    top = [item for name, n in top_kernels.items()
           for item in [item for item in longest if item[0][0] == name][:n]]
    return {
        "kernels_per_step": len(kernels) / steps,
        **{f"{name}_ms": per_kind.get(name, 0.0) / steps / 1e6 for name in top_kernels},
        "kernel_ms": sum(per_kind.values()) / steps / 1e6,
        "top": [{"kind": k, "op": op[:80], "calls_per_step": len(d) / steps,
                 "ms_per_step": sum(d) / steps / 1e6, "what": describe_op(op, lines, bodies)}
                for (k, op), d in top],
    }


def profile(config: configs.TrainConfig, name: str, steps: int, attention: str) -> dict:
    impl, fp8 = next((impl, fp8) for n, impl, fp8 in compare.VARIANTS if n == name)
    batches = data.Batches(data.load_corpus().train, config.batch_size, config.model.seq_len,
                           config.seed)
    batch = tuple(jax.device_put(a) for a in next(batches))
    variant = compare.build(config, name, impl, fp8, train.compute_dtype(), attention, batch)
    state = variant.state
    for _ in range(2):
        state, _ = variant.compiled(state, *batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = variant.compiled(state, *batch)
    jax.block_until_ready(state)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                state, _ = variant.compiled(state, *batch)
            jax.block_until_ready(state)
        trace = gpu_trace.latest_trace(Path(folder))
        devices = gpu_trace.gpu_kernels(trace) if trace else {}
        host = gpu_trace.host_events(trace) if trace else []
    kernels = next(iter(devices.values()), [])
    recorded = ("memory", "gemm_custom_calls", "fp8_recipe")
    return {"step_ms": step_ms, "record": {k: variant.record[k] for k in recorded},
            **breakdown(kernels, steps, variant.compiled.as_text() or ""),
            "host": [{"plane": h["plane"], "name": h["name"], "count": h["count"],
                      "ms_per_step": h["total_ns"] / steps / 1e6} for h in host]}


def markdown(report: dict) -> str:
    meta = report["metadata"]
    lines = [f"# Where the GPT step's time goes: {report['config']}", "",
             f"{meta['date']} · {meta['gpu_name'] or meta['device']} · jax {meta['jax']} · "
             f"cuBLASLt {meta['cublaslt_version']} · {report['steps']} traced steps per variant",
             f"XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(none)'}", "",
             "Per step, ms: the wall time of back-to-back steps (not traced), then the GPU "
             "kernel time of the traced steps (examples/gpt/profile.py's docstring).", "",
             "| variant | step (wall) | kernels | GEMM | attention | other | kernel count |",
             "|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        if "kernel_ms" not in v:
            lines.append(f"| {name} | {v.get('note') or v.get('error')} | | | | | |")
            continue
        lines.append(f"| {name} | {v['step_ms']:.2f} | {v['kernel_ms']:.2f} | {v['gemm_ms']:.2f} | "
                     f"{v['attention_ms']:.2f} | {v['other_ms']:.2f} | "
                     f"{v['kernels_per_step']:.0f} |")
    for name, v in report["variants"].items():
        if v.get("top"):
            lines += ["", f"## {name}: the longest kernels (by launching HLO op)", "",
                      "| kind | op | calls | ms per step | what |", "|---|---|---|---|---|"]
            lines += [f"| {t['kind']} | `{t['op']}` | {t['calls_per_step']:.0f} | "
                      f"{t['ms_per_step']:.3f} | {t['what']} |" for t in v["top"]]
    for name, v in report["variants"].items():
        if v.get("host"):
            lines += ["", f"## {name}: the host's longest events (off the Python line)", "",
                      "| plane | name | calls per step | ms per step |",
                      "|---|---|---|---|"]
            lines += [f"| {h['plane']} | `{h['name']}` | "
                      f"{h['count'] / report['steps']:.1f} | {h['ms_per_step']:.3f} |"
                      for h in v["host"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=tuple(configs.CONFIGS))
    parser.add_argument("--variants", default="flax_fp8,epilog_fp8",
                        help=f"comma-separated, of: {', '.join(v[0] for v in compare.VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = [v[0] for v in compare.VARIANTS]
    if not names or set(names) - set(known):
        parser.error(f"--variants: expected names of {known}, got {args.variants!r}")
    config = configs.get(args.config)
    report = {"benchmark": "gpt_profile", "metadata": timing.run_metadata(),
              "config": args.config, "steps": args.steps, "variants": {}}
    for name in names:
        try:
            report["variants"][name] = profile(config, name, args.steps, args.attention)
        except Exception as error:  # noqa: BLE001  (one variant's failure is reported)
            report["variants"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(f"{name}: {report['variants'][name].get('kernel_ms', 'n/a')} ms of kernels",
              flush=True)
        timing.write_report(report, args.out, "gpt_profile", markdown)
    return report


if __name__ == "__main__":
    # XLA's command buffers (CUDA graphs) launch a step's kernels as one graph, and the trace
    # then names the graph, not the HLO op, as every kernel's launcher: off for the profile
    # (read when jax starts its backend, in main), so each kernel is attributed.
    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    main()
