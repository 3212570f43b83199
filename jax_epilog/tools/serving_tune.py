"""`python -m jax_epilog.tune --serving`: time the ways of a layer with a stored FP8 weight
(`planning.serving_plan.WAYS`) at decode and prefill row counts on this GPU, and store them as
the decision table's serving entries, one per row count; `serving_plan.serving_way` then takes
the fastest way measured at the nearest row count on this GPU (docs/serving.md).

Each way is `jax_epilog.dense(x, stored, bias, activation="gelu")` with the way forced
(`config.forced_serving_way`) while it is compiled, `LAYERS` layers per call, each with its own
weight and its own input, as a decode step runs a model (XLA cannot quantize one input once for
all of them, and the weights do not fit in L2). The ways of one shape and row count are timed
interleaved (`timing.time_interleaved`) and their times summed over the shapes. A way that
fails to compile or run is recorded as failed, never chosen.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.weights import quantize_weight
from jax_epilog.layers.functional import dense
from jax_epilog.planning import decisions, table_format
from jax_epilog.planning.serving_plan import WAYS
from jax_epilog.runtime import settings
from jax_epilog.tools import timing

#: (K, N) of the layers timed by default: a Llama-8B-sized MLP's up and down projections.
SHAPES = ((4096, 14336), (14336, 4096))
#: Row counts timed by default: decoding 1 to 64 sequences, then prefill-sized calls.
ROWS = (1, 16, 32, 64, 128, 256)
#: Layers per timed call (each its own weight and input).
LAYERS = 8
#: Rounds of `timing.time_interleaved` per shape and row count.
ROUNDS = 5


def _layers(k: int, n: int, count: int, dtype, seed: int) -> list:
    """`count` (stored FP8 weight of a random (K, N) kernel, bias) pairs."""
    keys = jax.random.split(jax.random.key(seed), 2 * count)
    return [(quantize_weight(jax.random.normal(keys[2 * i], (k, n), jnp.float32) * k ** -0.5),
             (0.1 * jax.random.normal(keys[2 * i + 1], (n,), jnp.float32)).astype(dtype))
            for i in range(count)]


def _compiled(way: str, xs, layers):
    """The `LAYERS`-layer call compiled with `way` forced."""
    def call(xs, layers):
        return [dense(x, w, b, activation="gelu") for x, (w, b) in zip(xs, layers)]
    with settings.forced_serving_way(way):
        return jax.jit(call).lower(xs, layers).compile()


def time_ways(rows: int, k: int, n: int, *, ways: Sequence[str] = WAYS, dtype=jnp.bfloat16,
              layers: int = LAYERS, seconds: float = 0.5, seed: int = 0,
              failures: Optional[list] = None) -> dict:
    """{way: seconds per layer over `rows` rows of a (K, N) layer, None where it failed}."""
    stored = _layers(k, n, layers, dtype, seed)
    keys = jax.random.split(jax.random.key(seed + 1), layers)
    xs = [jax.random.normal(key, (rows, k), jnp.float32).astype(dtype) for key in keys]
    calls, times = {}, {}
    for way in ways:
        try:
            calls[way] = (_compiled(way, xs, stored), [(xs, stored)])
        except Exception as e:  # noqa: BLE001 -- one failure costs one way
            times[way] = None
            if failures is not None:
                failures.append(f"{rows} rows, K {k} x N {n}, {way}: {type(e).__name__}: {e}")
    if calls:
        timed = timing.time_interleaved(calls, rounds=ROUNDS, round_seconds=seconds / ROUNDS)
        times.update({way: t.seconds / layers for way, t in timed.items()})
    return {way: times[way] for way in ways}


def tune_serving(shapes: Sequence[tuple[int, int]] = SHAPES, rows: Sequence[int] = ROWS, *,
                 output: Optional[Path] = None, seconds: float = 0.5, write: bool = True,
                 measure=time_ways) -> tuple[table_format.ServingEntry, ...]:
    """Time every way at each of `rows` on bfloat16 layers `shapes` ((K, N) each) and merge one
    serving entry per row count into `output` (default: the user's table,
    `settings.decisions_path()`), each as it is measured, with a line of its times.
    `measure(rows, k, n, seconds=..., failures=...)` -> {way: seconds or None} (`time_ways`;
    tests inject their own)."""
    shapes = check_shapes(shapes)
    rows = check_rows(rows)
    device, version = decisions.device_identity()
    if device is None:
        raise RuntimeError("jax_epilog.tune --serving needs a CUDA GPU: JAX sees none on this "
                           "machine")
    path = Path(output) if output is not None else settings.decisions_path()
    started, entries, failures = time.perf_counter(), [], []
    for r in rows:
        per_shape = [measure(r, k, n, seconds=seconds, failures=failures) for k, n in shapes]
        summed = {way: (None if any(t[way] is None for t in per_shape)
                        else sum(t[way] for t in per_shape)) for way in per_shape[0]}
        entry = table_format.make_serving_entry(r, jnp.bfloat16, shapes, summed)
        entries.append(entry)
        if write and path is not None:
            decisions.merge_into(path, device, version, (), (), (entry,))
        print(f"serving, {r} rows: {entry.times} -> {entry.choice}", flush=True)
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    where = f" into {path}" if write and path is not None else ""
    print(f"tuned the served ways at {len(entries)} row counts in "
          f"{time.perf_counter() - started:.1f} s{where}", flush=True)
    return tuple(entries)


def check_shapes(shapes) -> tuple[tuple[int, int], ...]:
    """`shapes` as (K, N) pairs of positive ints, or a ValueError naming the argument."""
    try:
        out = tuple((int(k), int(n)) for k, n in shapes)
    except (TypeError, ValueError):
        out = ()
    if not out or any(k < 1 or n < 1 for k, n in out):
        raise ValueError(f"shapes: expected (K, N) pairs of positive ints, got {shapes!r}")
    return out


def check_rows(rows) -> tuple[int, ...]:
    """`rows` as positive ints, or a ValueError naming the argument."""
    try:
        out = tuple(int(r) for r in rows)
    except (TypeError, ValueError):
        out = ()
    if not out or any(r < 1 for r in out):
        raise ValueError(f"rows: expected positive row counts, got {rows!r}")
    return out


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"4096x14336,14336x4096" -> ((4096, 14336), (14336, 4096)): K x N each."""
    try:
        return check_shapes(tuple(tuple(int(d) for d in s.lower().split("x"))
                                  for s in text.split(",") if s.strip()))
    except ValueError:
        raise ValueError(f"--serving-shapes: expected KxN[,KxN...] (e.g. 4096x14336), got "
                         f"{text!r}") from None
