"""generate.py with its experiment switches: how a run is timed and what it serves, beyond
the user's options (which this takes too).

    python examples/gpt/generate_bench.py --random-init --config tiny --compare \\
        --fp8-min-features 64 --repeats 1 --out /tmp/gpt_generate_cpu      # CPU, tiny in FP8
    python examples/gpt/generate_bench.py --random-init --config large --compare \\
        --variants stock,epilog_fp8 --batch 1 64 --fp8-cache-layout heads_major_rows \\
        --profile /tmp/decode --out /tmp/decode_layout

Everything else (the variants, the report, what is printed) is generate.py's; its docstring
has the method. The switches:

- `--repeats`, `--eval-batches`: timed runs per variant and batch size (their median), and
  validation batches for the quality columns (0: none, no quality pass: a speed-only run).
- `--dtype`, `--attention`: the compute dtype (auto: bfloat16 on a GPU, float32 elsewhere)
  and the full forward's attention (the cached one is XLA's).
- `--fp8-min-features`, `--static-scales`, `--weight-scales`: which kernels `epilog_fp8` and
  `stock_fp8` store in FP8 (both dims at least this; default `quantize_params`' rule, 512, so
  `tiny`'s stay 16-bit without it), static input scales calibrated on the validation batches
  (`jax_epilog.calibrate`), and one weight scale per tensor or per output channel.
- `--fp8-attention`, `--fp8-cache-layout`: how a decode step reads an FP8 KV cache and how
  the cache is stored (the library's `decode_attention(read=)` and `init_kv_cache(layout=)`;
  auto: its measured rule, docs/kv_cache.md).
- `--steps-per-call`: decode steps per dispatch (one device loop; 1: one per token).
- `--prefill-command-buffers`: compile the prefill with XLA's command buffers (CUDA graphs),
  off by default (GPU only).
- `--profile DIR`: trace a few decode steps and prefills of each variant and batch size with
  `jax.profiler` (traces kept in DIR) and report their GPU kernels by kind: GEMMs, the
  attention over the cache, the cache writes, the rest (profile.py's `breakdown`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `gpt` (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_epilog.planning.attention_plan import LAYOUTS, READS

from gpt import generate, train


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def build_parser() -> argparse.ArgumentParser:
    """generate.py's parser with the experiment switches, each stored under its
    `generate.Settings` field (`generate.EXPERIMENT_SETTINGS`), `--dtype` aside."""
    parser = generate.build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = None
    bench = parser.add_argument_group("experiment switches")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs (the median)")
    bench.add_argument("--eval-batches", type=int, default=4,
                       help="validation batches for the quality metrics (0: no quality pass)")
    bench.add_argument("--dtype", default="auto", choices=tuple(train.DTYPES))
    bench.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                       help="the full forward's attention (the cached one is XLA's)")
    bench.add_argument("--fp8-min-features", type=int,
                       help="epilog_fp8, stock_fp8: store kernels whose dims are both at "
                            "least this in FP8 (default: quantize_params' rule, 512)")
    bench.add_argument("--static-scales", action="store_true",
                       help="epilog_fp8, stock_fp8: static input scales from the validation "
                            "batches (jax_epilog.calibrate)")
    bench.add_argument("--weight-scales", default="tensor", choices=("tensor", "channel"),
                       help="epilog_fp8, stock_fp8: one scale per stored kernel, or one per "
                            "output channel (quantize_params' granularity)")
    bench.add_argument("--fp8-attention", default="auto", choices=("auto", *READS),
                       help="how a decode step reads an FP8 KV cache: multiply-reduces or "
                            "dots over the converted cache (auto: jax_epilog's measured rule)")
    bench.add_argument("--fp8-cache-layout", default="auto", choices=("auto", *LAYOUTS),
                       help="how an FP8 KV cache is stored: positions before heads, or each "
                            "head's positions together in the order a decode step reads them "
                            "(heads_major_rows: the values stored as the keys, a row a "
                            "position; auto: jax_epilog's measured rule)")
    bench.add_argument("--steps-per-call", type=int, default=16,
                       help="decode steps per dispatch (a device loop; 1: one per token)")
    bench.add_argument("--prefill-command-buffers", type=on_off, default=False,
                       metavar="{on,off}",
                       help="compile the prefill step with XLA's command buffers (CUDA "
                            "graphs) or without them, the default (GPU only)")
    bench.add_argument("--profile", type=str, metavar="DIR",
                       help="trace a few decode steps and prefills per variant and batch size "
                            "into this folder and report where their GPU time goes")
    return parser


def main(argv=None) -> dict[str, Any]:
    return generate.main(argv, build_parser())


if __name__ == "__main__":
    main()
