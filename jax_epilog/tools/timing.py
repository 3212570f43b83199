"""The timing loop shared by `python -m jax_epilog.tune` and the benchmarks
(`benchmarks/timing.py` adds run metadata and reports around it).

A call is timed by the device's clock as seen from the host: many back-to-back asynchronous
calls, one synchronisation at the end, so host dispatch overlaps device work and only the
device's throughput is measured. The median of several such rounds (after warm-up) is
reported. Problems small enough to sit in L2 rotate through several copies of their inputs, so
each call reads its operands from HBM as it would inside a real network.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

# Hopper GPUs have a 50 MiB L2; inputs are rotated until the working set is twice that.
L2_BYTES = 50 * 1024 * 1024
MAX_INPUT_COPIES = 64


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: the median over rounds, and every round's value."""

    seconds: float
    rounds: tuple[float, ...]
    calls_per_round: int

    @property
    def microseconds(self) -> float:
        return self.seconds * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "rounds": list(self.rounds),
                "calls_per_round": self.calls_per_round}


def input_copies(bytes_per_call: int, l2_bytes: int = L2_BYTES,
                 max_copies: int = MAX_INPUT_COPIES) -> int:
    """How many copies of a call's inputs to rotate through so they cannot all stay in L2 (at
    most `max_copies`)."""
    if bytes_per_call <= 0:
        raise ValueError(f"bytes_per_call: expected a positive byte count, got {bytes_per_call}")
    return max(1, min(max_copies, math.ceil(2 * l2_bytes / bytes_per_call)))


def time_calls(call: Callable[..., Any], arg_sets: Sequence[tuple], *,
               sync: Callable[[Any], Any] = jax.block_until_ready, rounds: int = 5,
               round_seconds: float = 0.02, max_calls_per_round: int = 10_000,
               warmup_calls: int = 2) -> Timing:
    """Median seconds per `call(*args)`, cycling through `arg_sets` (one set per input copy).

    `sync(result)` must wait for the device to finish the result (for JAX,
    `jax.block_until_ready`; for torch or CuPy, a stream synchronisation). Each round issues
    enough back-to-back calls to last about `round_seconds`, then synchronises once.
    """
    return time_interleaved({"call": (call, arg_sets)}, sync=sync, rounds=rounds,
                            round_seconds=round_seconds, max_calls_per_round=max_calls_per_round,
                            warmup_calls=warmup_calls)["call"]


def time_interleaved(calls: dict[str, tuple[Callable[..., Any], Sequence[tuple]]], *,
                     sync: Callable[[Any], Any] = jax.block_until_ready, rounds: int = 5,
                     round_seconds: float = 0.02, max_calls_per_round: int = 10_000,
                     warmup_calls: int = 2) -> dict[str, Timing]:
    """`time_calls` for several `name: (call, arg_sets)` at once, their rounds interleaved
    (a, b, a, b, ...) so that the shared machine's drift affects every one alike."""
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    for name, (_, arg_sets) in calls.items():
        if not arg_sets:
            raise ValueError(f"arg_sets of {name!r}: expected at least one tuple of arguments, "
                             "got none")

    def run(call, arg_sets, n: int) -> float:
        start = time.perf_counter()
        result = None
        for i in range(n):
            result = call(*arg_sets[i % len(arg_sets)])
        sync(result)
        return time.perf_counter() - start

    counts = {}
    for name, (call, arg_sets) in calls.items():
        # Warm-up touches every input copy (compilation, plans, allocator) before anything counts.
        run(call, arg_sets, max(warmup_calls, len(arg_sets)))
        estimate = run(call, arg_sets, max(1, len(arg_sets))) / max(1, len(arg_sets))
        counts[name] = int(min(max_calls_per_round,
                               max(len(arg_sets), math.ceil(round_seconds / max(estimate, 1e-9)))))
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, arg_sets) in calls.items():
            per_call[name].append(run(call, arg_sets, counts[name]) / counts[name])
    return {name: Timing(seconds=statistics.median(values), rounds=tuple(values),
                         calls_per_round=counts[name]) for name, values in per_call.items()}
