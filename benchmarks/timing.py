"""Timing and run metadata shared by every benchmark (method: benchmarks/README.md).

The timing loop itself (`time_calls`, `time_interleaved`, `input_copies`) is the package's
`jax_epilog.tools.timing`, which `python -m jax_epilog.tune` uses too; it is re-exported here.

The benchmarks run as scripts (`python benchmarks/<name>.py`) and import this module as
`timing`, their sibling.
"""

from __future__ import annotations

import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import numpy as np
from tqdm import tqdm

from jax_epilog.runtime import targets
from jax_epilog.tools.timing import (L2_BYTES, MAX_INPUT_COPIES, Timing, input_copies,  # noqa: F401
                               time_calls, time_interleaved)

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

    return targets.MATMUL.name in jitted.lower(*args).as_text()


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


def provenance(metadata: dict[str, Any], *extra: str) -> str:
    """A Markdown report's line under its title: when, on what and with which versions it ran
    (`run_metadata`), then `extra`, all joined by " · "."""
    m = metadata
    return " · ".join([m["date"], m["gpu_name"] or m["device"], f"driver {m['driver_version']}",
                       f"jax {m['jax']} / jaxlib {m['jaxlib']}",
                       f"cuBLASLt {m['cublaslt_version']}",
                       f"custom call active: {m['custom_call_active']}", *extra])


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

    from jax_epilog import config
    from jax_epilog.runtime import library as cuda_library

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
