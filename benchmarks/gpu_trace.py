"""The GPU kernels of a `jax.profiler` trace (its .xplane.pb), for the benchmarks that say where
a step's time goes (fp8_profile.py) or how its collectives overlap (multi_gpu_bench.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

# Kernel names in a GPU trace: cuBLAS(Lt) GEMMs (Hopper's are "nvjet_*" or "sm90_xmma_*"),
# and NCCL's collectives.
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|matmul", re.IGNORECASE)
NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)


class Kernel(NamedTuple):
    start_ns: float
    end_ns: float
    stream: str
    name: str
    hlo_op: Optional[str]  # the HLO instruction that launched it, where the trace says

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


def _stat(event, name: str) -> Optional[str]:
    try:
        for key, value in event.stats:
            if key == name:
                return str(value)
    except Exception:  # noqa: BLE001  (stats are optional in a trace)
        return None
    return None


def gpu_kernels(xplane: Path) -> dict[str, list[Kernel]]:
    """Per GPU plane ("/device:GPU:0", ...): its kernels in start order (the "Stream" lines; not
    the derived op or step lines, which repeat them)."""
    from jax.profiler import ProfileData

    devices = {}
    for plane in ProfileData.from_file(str(xplane)).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        kernels = [Kernel(event.start_ns, event.start_ns + event.duration_ns, line.name,
                          event.name, _stat(event, "hlo_op"))
                   for line in plane.lines if line.name.startswith("Stream")
                   for event in line.events]
        devices[plane.name] = sorted(kernels)
    return devices


def host_events(xplane: Path, top: int = 40) -> list[dict]:
    """The host side of a trace: events off the GPU planes' streams and off the Python line
    (XLA's thunks, CUDA API calls), grouped by plane and name over threads, longest total
    first. A GPU that waits on its host shows here as a host call that takes long (a
    synchronization, a slow launch)."""
    from jax.profiler import ProfileData

    totals: dict[tuple[str, str], list[float]] = {}
    for plane in ProfileData.from_file(str(xplane)).planes:
        for line in plane.lines:
            if line.name == "python" or (plane.name.startswith("/device:GPU")
                                         and line.name.startswith("Stream")):
                continue
            for event in line.events:
                entry = totals.setdefault((plane.name, event.name), [0, 0.0])
                entry[0] += 1
                entry[1] += event.duration_ns
    longest = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"plane": plane, "name": name[:120], "count": count, "total_ns": total}
            for (plane, name), (count, total) in longest]


def latest_trace(folder: Path) -> Optional[Path]:
    """The newest .xplane.pb `jax.profiler.trace(folder)` wrote, if any."""
    traces = sorted(folder.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None
