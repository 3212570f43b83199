"""Timing and run metadata shared by every benchmark (method: benchmarks/README.md).

A call is timed by the device's clock as seen from the host: many back-to-back asynchronous
calls, one synchronisation at the end, so host dispatch overlaps device work and only the
device's throughput is measured. The median of several such rounds (after warm-up) is
reported. Problems small enough to sit in L2 rotate through several copies of their inputs, so
each call reads its operands from HBM as it would inside a real network.

The benchmarks run as scripts (`python benchmarks/<name>.py`) and import this module as
`timing`, their sibling.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import numpy as np
from tqdm import tqdm

# H100/H200 have a 50 MiB L2; inputs are rotated until the working set is twice that.
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


def input_copies(bytes_per_call: int, l2_bytes: int = L2_BYTES) -> int:
    """How many copies of a call's inputs to rotate through so they cannot all stay in L2."""
    if bytes_per_call <= 0:
        raise ValueError(f"bytes_per_call: expected a positive byte count, got {bytes_per_call}")
    return max(1, min(MAX_INPUT_COPIES, math.ceil(2 * l2_bytes / bytes_per_call)))


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


def ratio_spread(numerator: Timing, denominator: Timing) -> tuple[float, float]:
    """(min, max) over rounds of numerator's round time / denominator's, rounds paired by index
    (`time_interleaved` runs round i of each back to back, under the same drift)."""
    ratios = [a / b for a, b in zip(numerator.rounds, denominator.rounds)]
    if not ratios:
        raise ValueError("ratio_spread: expected timings with at least one round each")
    return min(ratios), max(ratios)


class Budget:
    """Spreads a total time budget (compilation included) over the remaining measurements:
    each round lasts (remaining time) / (remaining measurements × (rounds + 3 for warm-up)),
    kept between `shortest_round` (long enough that launch latency does not count) and
    `longest_round`. A run whose compilation eats the budget still gets the shortest rounds,
    so it may overrun."""

    def __init__(self, seconds: float, measurements: int, *, rounds: int = 5,
                 shortest_round: float = 0.01, longest_round: float = 0.05):
        self.deadline = time.perf_counter() + seconds
        self.left = measurements
        self.rounds = rounds
        self.shortest_round, self.longest_round = shortest_round, longest_round

    @property
    def remaining(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    def round_seconds(self) -> float:
        share = self.remaining / max(1, self.left) / (self.rounds + 3)
        self.left -= 1
        return min(self.longest_round, max(self.shortest_round, share))


def progress_bar(total: int, desc: str) -> tqdm:
    """A progress bar; redrawn rarely when the output is a log, not a terminal."""
    return tqdm(total=total, desc=desc, unit="run", mininterval=0.1 if sys.stderr.isatty() else 10)


def gemm_flops(batch: int, k: int, n: int) -> int:
    """FLOPs of one `x[batch, k] @ w[k, n]`: a multiply and an add per term."""
    return 2 * batch * k * n


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def memory_analysis(compiled) -> Optional[dict[str, int]]:
    """The compiled executable's memory use, and its peak (arguments + outputs + temporaries,
    less what is aliased), or None where the backend does not report it."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    if stats is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes")
    report = {name: int(getattr(stats, name, 0)) for name in fields}
    report["peak_bytes"] = (report["argument_size_in_bytes"] + report["output_size_in_bytes"]
                            + report["temp_size_in_bytes"] - report["alias_size_in_bytes"])
    return report


def uses_custom_call(jitted: Callable, *args) -> bool:
    """Whether `jitted(*args)` lowers to jax-epilog's cuBLASLt custom call (else the reference
    lowering runs: no CUDA, library missing, or a problem cuBLASLt has no kernel for)."""
    from jax_epilog import cuda_library

    return cuda_library.TARGET_NAME in jitted.lower(*args).as_text()


def _nvidia_smi(field: str) -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    lines = out.strip().splitlines()
    return lines[0].strip() if lines else None


def footnotes(metadata: dict[str, Any], skipped: Sequence[str]) -> list[str]:
    """A Markdown report's closing lines: what the time budget skipped, and a note where
    jax-epilog's rows ran the reference lowering instead of cuBLASLt."""
    lines = []
    if skipped:
        lines += ["", f"Skipped (time budget spent): {', '.join(skipped)}"]
    if not metadata["custom_call_active"]:
        lines += ["", f"Note: jax_epilog ran the plain-JAX reference lowering, not cuBLASLt "
                  f"({metadata['custom_call_unavailable_reason']})."]
    return lines


def write_report(report: dict[str, Any], out, name: str, render: Callable[[dict], str],
                 draw: Optional[Callable[[dict, Any], None]] = None) -> None:
    """`out`/`name`.json (the report), .md (`render(report)`) and, with `draw`, .png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(render(report))
    written = ".json, .md"
    if draw is not None:
        draw(report, out / f"{name}.png")
        written += ", .png"
    print(f"wrote {out / name}{written}")


def run_metadata() -> dict[str, Any]:
    """Where and with what a benchmark ran: written next to every result."""
    import jaxlib

    from jax_epilog import config, cuda_library

    device = jax.devices()[0]
    active = device.platform == "gpu" and cuda_library.available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": device.platform,
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "gpu_name": _nvidia_smi("name"),
        "driver_version": _nvidia_smi("driver_version"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "cublaslt_version": cuda_library.cublaslt_version(),
        "custom_call_active": active,
        "autotune": config.autotune_enabled(),
        "custom_call_unavailable_reason": None if active else (
            cuda_library.unavailable_reason() or f"platform is {device.platform}, not CUDA"),
    }
