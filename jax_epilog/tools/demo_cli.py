"""The demo's command line (`python -m jax_epilog`), parsed before the demo is imported so that
`--help` works without the demo's extra dependencies."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jax_epilog", description=(
        "Train jax-epilog's fused MLP on scikit-learn's digits, then compare one training "
        "step with the same network in plain JAX. Needs the demo extra (flax, optax, "
        "scikit-learn, tqdm)."))
    parser.add_argument("--epochs", type=int, default=25, help="training epochs (default 25)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 128],
                        help="hidden layer widths of the classifier (default 128 128)")
    parser.add_argument("--compare-batch", type=int, default=None,
                        help="rows per step in the speed/memory comparison "
                             "(default 16384 on a GPU, 1024 elsewhere)")
    parser.add_argument("--compare-width", type=int, default=None,
                        help="hidden width in the comparison (default 2048 on a GPU, 256 "
                             "elsewhere)")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps per timing round in the comparison (default 10)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="timing rounds per model, alternating between the two; the "
                             "spread over rounds is printed (default 7)")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)
