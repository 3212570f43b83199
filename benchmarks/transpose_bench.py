"""The FP8 weight gradient's one-byte transposes: XLA's `x.T` against `fp8.transpose_bytes`.

The FP8 weight gradient dW = h8ᵀ dZ8 needs both operands K-major (cuBLASLt's FP8 GEMMs take
only "TN"), so the layers transpose h8 and dZ8, one byte per element. This times, for the
shapes of the benchmark stacks and the GPT example:

- xla: `x.T`, one byte per element, as XLA emits it;
- words: `jax_epilog.fp8.transpose_bytes(x)`, the same bytes moved as 4-byte words;
- quantize_xla / quantize_words: a bf16 tensor quantized to e5m2 and its transposed copy
  written from the same jitted expression (what a pass that quantizes could give the weight
  gradient), with either transpose.

Careful harness (rotated inputs, device-timed rounds, median, the variants interleaved), GB/s
counted as bytes read + written by the transpose alone (2 bytes per element; the quantizing
variants 4: bf16 read, two FP8 copies written). Each result is checked bit for bit against
NumPy's transpose first.

    python benchmarks/transpose_bench.py --out benchmarks/results          # H200: ~30 s
    python benchmarks/transpose_bench.py --smoke --out /tmp/transpose      # any CPU
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import timing
from jax_epilog.fp8 import quantize, transpose_bytes

SHAPES = ((16384, 16384), (65536, 4096), (16384, 4096), (4096, 16384), (16384, 12288),
          (8192, 8192))
SMOKE_SHAPES = ((64, 96), (36, 128), (127, 129))
GRADIENT = "float8_e5m2"


def _variants() -> dict[str, Any]:
    def quantized(transpose):
        def call(x):
            x8, _ = quantize(x, jnp.float32(4.0), GRADIENT, 0)
            return x8, transpose(x8)
        return call
    return {"xla": (jax.jit(lambda x: x.T), "fp8"),
            "words": (jax.jit(transpose_bytes), "fp8"),
            "quantize_xla": (jax.jit(quantized(lambda x8: x8.T)), "bf16"),
            "quantize_words": (jax.jit(quantized(transpose_bytes)), "bf16")}


def _bytes(x) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def kernels(call, x) -> list[str]:
    """The ops of the compiled program's entry computation (its kernels, on a GPU)."""
    text = call.lower(x).compile().as_text()
    entry = text[text.index("ENTRY"):]
    ops = (re.search(r"= \S+ ([\w-]+)\(", line) for line in entry.splitlines())
    return [op.group(1) for op in ops if op and op.group(1) not in ("parameter", "tuple")]


def measure(shape: tuple[int, int], rounds: int) -> dict[str, Any]:
    rows, cols = shape
    key = jax.random.key(rows * 7 + cols)
    source = (jax.random.normal(key, shape, jnp.float32) * 3).astype(jnp.bfloat16)
    source8 = source.astype(GRADIENT)
    copies = timing.input_copies(rows * cols)
    sets = {"bf16": [(source + i,) for i in range(copies)],
            "fp8": [((source + i).astype(GRADIENT),) for i in range(copies)]}
    calls, result = {}, {"shape": list(shape), "variants": {}}
    for name, (call, kind) in _variants().items():
        out = call(source if kind == "bf16" else source8)
        transposed = out[1] if isinstance(out, tuple) else out
        expected = _bytes(quantize(source, jnp.float32(4.0), GRADIENT, 0)[0]
                          if kind == "bf16" else source8).T
        if not np.array_equal(_bytes(transposed), expected):
            raise AssertionError(f"{name} at {shape}: the transposed bytes differ from NumPy's")
        calls[name] = (call, sets[kind])
        result["variants"][name] = {"ops": kernels(call, source if kind == "bf16" else source8)}
    timings = timing.time_interleaved(calls, rounds=rounds, round_seconds=0.05)
    for name, (_, kind) in _variants().items():
        moved = rows * cols * (4 if kind == "bf16" else 2)
        result["variants"][name] |= {"ms": timings[name].seconds * 1e3,
                                    "gb_per_s": moved / timings[name].seconds / 1e9,
                                    "timing": timings[name].as_dict()}
    return result


def markdown(report: dict[str, Any]) -> str:
    names = list(_variants())
    lines = ["# One-byte transposes: XLA's `x.T` against `transpose_bytes`", "",
             "ms per call (GB/s moved), careful harness; `words` / `xla`: speed-up of the word "
             "transpose.", "",
             "| shape | " + " | ".join(names) + " | words / xla | quantize_words / quantize_xla |",
             "|---|" + "---|" * (len(names) + 2)]
    for row in report["rows"]:
        v = row["variants"]
        cells = [f"{v[n]['ms']:.3f} ({v[n]['gb_per_s']:.0f})" for n in names]
        lines.append(f"| {row['shape'][0]} × {row['shape'][1]} | " + " | ".join(cells) +
                     f" | {v['xla']['ms'] / v['words']['ms']:.2f} | "
                     f"{v['quantize_xla']['ms'] / v['quantize_words']['ms']:.2f} |")
    lines += timing.footnotes(report["metadata"], [])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    report = {"benchmark": "transpose", "metadata": timing.run_metadata(), "rows": []}
    for shape in shapes:
        report["rows"].append(measure(shape, rounds=3 if args.smoke else 7))
        v = report["rows"][-1]["variants"]
        print(f"{shape}: " + ", ".join(f"{n} {r['ms']:.3f} ms {r['ops']}" for n, r in v.items()),
              flush=True)
    timing.write_report(report, args.out, "transpose", markdown)
    return report


if __name__ == "__main__":
    main()
