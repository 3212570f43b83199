"""Which backward a layer runs for one problem: a fused cuBLASLt epilog or the unfused equivalent.

Fusion is not automatically a win. On the H200, cuBLASLt's DRELU_BGRAD ran at ~515 TFLOP/s
where a plain GEMM of the same shape (65536 x 4096 x 4096, bf16) ran at ~700: for such a problem
a plain GEMM followed by XLA's elementwise mask and bias reduction is faster. So each fusable
step of the backward is one of:

- ``DRELU_BGRAD`` / ``DGELU_BGRAD`` (or ``DRELU`` / ``DGELU`` without a bias): the data-gradient
  GEMM with the previous layer's activation derivative (and bias gradient) fused, against the
  plain GEMM, the mask (or GELU derivative) and a reduction;
- ``BGRADB``: the weight-gradient GEMM with the bias gradient fused, against the plain GEMM and
  a reduction.

The choice is made from measurements. ``benchmarks/layers_bench.py --write-table`` times both
variants of each step on the benchmark grid and writes ``backward_strategy.json`` beside this
module. A problem takes the choice of the nearest measured problem of the same epilog and dtype
(distance: the largest ratio between the two problems' M, N or K), if one is within a factor of
`NEAREST_WITHIN`; with none, the fused epilog. The unfused variant is chosen only where it
measured faster by more than `MIN_GAIN`, so that noise never flips a choice. Both variants
compute the same values; ``backward="fused"`` / ``"unfused"`` on `jax_epilog.dense` /
`jax_epilog.mlp` forces one (that is how the tests check they agree).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import NamedTuple, Optional

import jax.numpy as jnp

from .epilogs import Epilog

STRATEGIES = ("auto", "fused", "unfused")
TABLE_PATH = Path(__file__).with_name("backward_strategy.json")
NEAREST_WITHIN = 2.0
MIN_GAIN = 0.02


class Measurement(NamedTuple):
    """One measured problem: the fused epilog's time against the unfused variant's."""

    epilog: str
    dtype: str
    m: int
    n: int
    k: int
    fused_s: float
    unfused_s: float

    @property
    def choice(self) -> str:
        return "unfused" if self.unfused_s < self.fused_s * (1.0 - MIN_GAIN) else "fused"


def check_strategy(backward: str) -> str:
    if backward not in STRATEGIES:
        raise ValueError(f"backward: expected one of {STRATEGIES}, got {backward!r}")
    return backward


@functools.cache
def load_table(path: Path) -> tuple[Measurement, ...]:
    """The measurements in `path` (none if the file does not exist)."""
    if not Path(path).exists():
        return ()
    entries = json.loads(Path(path).read_text())["measurements"]
    return tuple(Measurement(**entry) for entry in entries)


def write_table(measurements, device: str, path: Optional[Path] = None) -> None:
    """Replace the table (the benchmark calls this) and forget the cached copy."""
    rows = [m._asdict() for m in measurements]
    Path(path or TABLE_PATH).write_text(json.dumps({"device": device, "measurements": rows}, indent=1) + "\n")
    load_table.cache_clear()


def _distance(entry: Measurement, m: int, n: int, k: int) -> float:
    ratios = (max(a, 1) / max(b, 1) for a, b in ((entry.m, m), (entry.n, n), (entry.k, k)))
    return max(abs(math.log(r)) for r in ratios)


def choose(epilog: Epilog, dtype, m: int, n: int, k: int, backward: str = "auto") -> str:
    """'fused' or 'unfused' for the step that `epilog` would fuse, on an (M, N, K) GEMM."""
    if check_strategy(backward) != "auto":
        return backward
    name, dtype = Epilog(epilog).name, jnp.dtype(dtype).name
    candidates = [e for e in load_table(TABLE_PATH) if e.epilog == name and e.dtype == dtype]
    if not candidates:
        return "fused"
    nearest = min(candidates, key=lambda e: _distance(e, m, n, k))
    return nearest.choice if _distance(nearest, m, n, k) <= math.log(NEAREST_WITHIN) else "fused"
