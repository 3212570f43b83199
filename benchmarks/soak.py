"""Soak: 20,000 distinct problems through jax-epilog's plan cache in one process (issue 15).

Does the process stay the same size when it meets far more problems than its plan cache holds
(4,096 by default, least recently used evicted)? Compiling an XLA program per shape would take
hours, so the soak calls the library's test-only `jax_epilog_soak_for_test` (ffi/soak.cc),
which plans and runs each problem exactly as the handler's execute stage does (the plan cache's
`GetPlan`, then `RunPlan` on a stream). Problems: m, n, k in [1, --max-dim], every epilog, both
transposes, bfloat16 and float16, each index a different problem. They go in chunks; after
each chunk the process's resident memory (VmRSS), the device memory in use (cudaMemGetInfo)
and the number of cached plans are recorded.

Verdict: "flat" when, after the warm-up, neither memory grows by more than FLAT_BOUND_MIB over
its value at the end of the warm-up. The warm-up is the first --warmup fraction of the chunks
(default 25%), and lasts at least until the cache is full: while it fills, memory rightly grows
by the plans it keeps. With --passes N (default 2) the soak runs N times --shapes problems,
every one distinct (pass p takes the problems after pass p-1's), and the whole first pass is
warm-up: it meets the kinds of problem the later passes meet, so what cuBLASLt loads once per
kind (kernel modules, its own heuristics cache of bounded size) is loaded by then, and growth
in the later passes would be per problem, i.e. unbounded.

Autotuning is off: with it on, each plan built would also look its problem up in the on-disk
file of tuned algorithms, and in a real program each new shape would be tuned once (3–250 ms
each), which is the tuner's cost, not the cache's; the soak measures the cache.

    python benchmarks/soak.py --out benchmarks/results            # 20,000 shapes, 40 chunks
    python benchmarks/soak.py --shapes 2000 --capacity 256 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

SHAPES = 20_000
CHUNKS = 40
PASSES = 2
MAX_DIM = 512  # small problems: 20,000 plans and runs take seconds, not minutes
WARMUP = 0.25
# Growth allowed after the warm-up, for the process and for the device alike: well above the
# noise of a few lazily loaded cuBLASLt kernels and allocator pages, well below what
# thousands of leaked plans would take (a plan holds 4 cuBLASLt descriptors and a few KiB).
FLAT_BOUND_MIB = 32
MEMORIES = {"rss_bytes": "process resident memory (VmRSS)",
            "device_bytes": "device memory in use (cudaMemGetInfo)"}
MIB = 1 << 20


def chunk_bounds(shapes: int, chunks: int) -> list[tuple[int, int]]:
    """(first problem, count) of each chunk: `shapes` split into `chunks` nearly equal parts."""
    if shapes < 1 or not 1 <= chunks <= shapes:
        raise ValueError(f"shapes, chunks: expected 1 <= chunks <= shapes, got shapes={shapes}, "
                         f"chunks={chunks}")
    edges = [round(i * shapes / chunks) for i in range(chunks + 1)]
    return [(start, end - start) for start, end in zip(edges, edges[1:])]


def warmup_chunks(samples: list[dict[str, Any]], fraction: float, capacity: int) -> int:
    """How many chunks are warm-up: `fraction` of them, and at least those up to the one after
    which the cache first held `capacity` plans (all of them, if it never did)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction: expected a number in [0, 1), got {fraction}")
    by_fraction = math.ceil(fraction * len(samples))
    full = next((i + 1 for i, s in enumerate(samples) if s["plan_cache_size"] >= capacity),
                len(samples))
    return max(by_fraction, full)


def judge_flat(samples: list[dict[str, Any]], warmup: int,
               bound_bytes: int = FLAT_BOUND_MIB * MIB) -> dict[str, Any]:
    """For each memory of MEMORIES: its value after the last warm-up chunk, its largest value
    after that, the growth, and whether it stayed below `bound_bytes`; "flat" when every memory
    did. Nothing to judge (None) when no chunk follows the warm-up."""
    if not 1 <= warmup < len(samples):
        return {"flat": None, "why": f"no chunk after the {warmup} warm-up chunks of "
                                     f"{len(samples)}", "bound_bytes": bound_bytes}
    verdict: dict[str, Any] = {"bound_bytes": bound_bytes, "warmup_chunks": warmup}
    for name in MEMORIES:
        baseline = samples[warmup - 1][name]
        peak = max(s[name] for s in samples[warmup:])
        verdict[name] = {"after_warmup": baseline, "peak_after": peak, "growth": peak - baseline,
                         "flat": peak - baseline < bound_bytes}
    verdict["flat"] = all(verdict[name]["flat"] for name in MEMORIES)
    return verdict


def rss_bytes() -> int:
    """This process's resident memory (VmRSS of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"/proc/self/status: expected VmRSS in kB, got {line!r}")
            return int(value) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


class Soak:
    """The loaded library's soak entry point and the CUDA runtime's memory query."""

    def __init__(self, device: int):
        from jax_epilog.runtime import library as cuda_library

        lib = cuda_library.library()
        if lib.handle is None:
            raise SystemExit(f"soak: jax-epilog's CUDA library is unavailable: {lib.error}")
        self.run_chunk_fn = lib.handle.jax_epilog_soak_for_test
        self.run_chunk_fn.restype = ctypes.c_int
        self.run_chunk_fn.argtypes = [
            ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t]
        # Loading jax_epilog's library loaded this copy of the runtime (by its soname) first.
        self.cudart = ctypes.CDLL("libcudart.so.13")
        self.device = device

    def run_chunk(self, seed: int, first: int, count: int, max_dim: int,
                  workspace_bytes: int) -> dict[str, int]:
        ran, unsupported, most_cached = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        message = ctypes.create_string_buffer(1024)
        status = self.run_chunk_fn(self.device, seed, first, count, max_dim, workspace_bytes,
                                   ctypes.byref(ran), ctypes.byref(unsupported),
                                   ctypes.byref(most_cached), message, len(message))
        if status != 0:
            raise RuntimeError(f"soak: problems {first}..{first + count - 1} failed: "
                               f"{message.value.decode(errors='replace')}")
        return {"ran": ran.value, "unsupported": unsupported.value,
                "most_cached": most_cached.value}

    def device_bytes(self) -> int:
        """Device memory in use, by every process and context (total - free)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        for call, what in ((lambda: self.cudart.cudaSetDevice(self.device), "cudaSetDevice"),
                           (lambda: self.cudart.cudaMemGetInfo(ctypes.byref(free),
                                                               ctypes.byref(total)),
                            "cudaMemGetInfo")):
            error = call()
            if error != 0:
                raise RuntimeError(f"soak: {what} failed with cudaError {error}")
        return total.value - free.value


def run(shapes: int, chunks: int, max_dim: int, seed: int, device: int, warmup: float,
        capacity: Optional[int], budget_s: float, passes: int = 1) -> dict[str, Any]:
    from jax_epilog import config
    from jax_epilog.runtime import library as cuda_library

    config.set_autotune(False)
    if capacity is not None:
        config.set_plan_cache_capacity(capacity)
    capacity = config.plan_cache_capacity()
    soak = Soak(device)
    cuda_library.clear_plan_cache()
    if passes < 1:
        raise ValueError(f"passes: expected at least 1, got {passes}")
    bounds = [(p * shapes + first, count) for p in range(passes)
              for first, count in chunk_bounds(shapes, chunks)]
    samples = []
    start = time.perf_counter()
    before = {"rss_bytes": rss_bytes(), "device_bytes": soak.device_bytes()}
    for i, (first, count) in enumerate(bounds):
        chunk_start = time.perf_counter()
        counts = soak.run_chunk(seed, first, count, max_dim, config.workspace_bytes())
        seconds = time.perf_counter() - chunk_start
        samples.append({"chunk": i, "pass": i // chunks + 1, "shapes_done": first + count,
                        **counts,
                        "plan_cache_size": cuda_library.plan_cache_size(),
                        "rss_bytes": rss_bytes(), "device_bytes": soak.device_bytes(),
                        "us_per_shape": 1e6 * seconds / count})
        print(f"chunk {i + 1}/{len(bounds)}: {first + count} shapes, "
              f"{samples[-1]['plan_cache_size']} plans cached, RSS "
              f"{samples[-1]['rss_bytes'] / MIB:.1f} MiB, device "
              f"{samples[-1]['device_bytes'] / MIB:.1f} MiB", flush=True)
        if time.perf_counter() - start > budget_s and i + 1 < len(bounds):
            break
    import timing  # its run_metadata starts JAX's backend: only once the soak is done

    return {"benchmark": "soak", "metadata": timing.run_metadata(),
            "settings": {"shapes": shapes * passes, "passes": passes, "chunks": chunks * passes,
                         "max_dim": max_dim, "seed": seed,
                         "device": device, "plan_cache_capacity": capacity,
                         "workspace_bytes": config.workspace_bytes(), "autotune": False,
                         "warmup_fraction": warmup, "budget_s": budget_s},
            "before": before, "samples": samples, "seconds": time.perf_counter() - start,
            "shapes_done": samples[-1]["shapes_done"],
            "verdict": judge_flat(samples, max(warmup_chunks(samples, warmup, capacity),
                                               chunks if passes > 1 else 0))}


def markdown(report: dict[str, Any]) -> str:
    meta, settings, verdict = report["metadata"], report["settings"], report["verdict"]
    samples = report["samples"]
    ran = sum(s["ran"] for s in samples)
    unsupported = sum(s["unsupported"] for s in samples)
    lines = [
        "# Plan-cache soak",
        "",
        f"{meta['date']} · {meta['gpu_name'] or meta['device']} · driver "
        f"{meta['driver_version']} · jax {meta['jax']} / jaxlib {meta['jaxlib']} · cuBLASLt "
        f"{meta['cublaslt_version']}",
        "",
        f"{report['shapes_done']} of {settings['shapes']} distinct problems in one process "
        f"({ran} planned and run, {unsupported} without a cuBLASLt kernel) in "
        f"{report['seconds']:.1f} s: m, n, k in [1, {settings['max_dim']}], every epilog, both "
        f"transposes, bf16 and fp16, seed {settings['seed']}; plan cache capacity "
        f"{settings['plan_cache_capacity']}, autotuning off, workspace "
        f"{settings['workspace_bytes'] // MIB} MiB. Before the first chunk: RSS "
        f"{report['before']['rss_bytes'] / MIB:.1f} MiB, device "
        f"{report['before']['device_bytes'] / MIB:.1f} MiB.",
        "",
        "| chunk | pass | shapes | plans cached (most) | RSS MiB | device MiB | µs per shape |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(f"| {s['chunk'] + 1} | {s.get('pass', 1)} | {s['shapes_done']} | "
                     f"{s['plan_cache_size']} "
                     f"({s['most_cached']}) | {s['rss_bytes'] / MIB:.1f} | "
                     f"{s['device_bytes'] / MIB:.1f} | {s['us_per_shape']:.0f} |")
    lines.append("")
    bound = verdict["bound_bytes"] / MIB
    if verdict["flat"] is None:
        lines.append(f"Flatness not judged: {verdict['why']}.")
    else:
        first_pass = (" and the whole first pass" if settings.get("passes", 1) > 1 else "")
        lines.append(f"After the warm-up ({verdict['warmup_chunks']} chunks: at least "
                     f"{settings['warmup_fraction']:.0%} of them, until the cache was full"
                     f"{first_pass}):")
        for name, what in MEMORIES.items():
            v = verdict[name]
            lines.append(f"- {what}: {v['after_warmup'] / MIB:.1f} MiB after the warm-up, at "
                         f"most {v['peak_after'] / MIB:.1f} MiB after it "
                         f"({v['growth'] / MIB:+.1f} MiB; bound {bound:.0f} MiB): "
                         f"{'flat' if v['flat'] else 'GROWS'}")
        lines.append(f"\nVerdict: {'flat' if verdict['flat'] else 'NOT flat'}.")
    if report["shapes_done"] < settings["shapes"]:
        lines.append(f"\nStopped after {report['shapes_done']} shapes: the time budget "
                     f"({settings['budget_s']:.0f} s) was spent.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--shapes", type=int, default=SHAPES, help="problems per pass")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="chunks per pass")
    parser.add_argument("--passes", type=int, default=PASSES,
                        help="passes of --shapes new problems each; the first is warm-up")
    parser.add_argument("--max-dim", type=int, default=MAX_DIM, help="m, n, k in [1, this]")
    parser.add_argument("--seed", type=int, default=0, help="orders the problems")
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    parser.add_argument("--warmup", type=float, default=WARMUP,
                        help="fraction of the chunks that is warm-up (at least until the "
                             "cache is full)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="plan cache capacity (default: JAX_EPILOG_PLAN_CACHE_SIZE or 4096)")
    parser.add_argument("--budget-s", type=float, default=100.0,
                        help="stop after the chunk that passes this many seconds")
    args = parser.parse_args(argv)
    try:  # the arguments are checked before the soak, not after it
        chunk_bounds(args.shapes, args.chunks)
        warmup_chunks([], args.warmup, capacity=1)
        if args.passes < 1:
            raise ValueError(f"--passes: expected at least 1, got {args.passes}")
    except ValueError as e:
        parser.error(str(e))
    # So the device figures are the soak's own memory and the CUDA context's, not a pool that
    # JAX's backend (started for the metadata, at the end) would reserve up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    report = run(args.shapes, args.chunks, args.max_dim, args.seed, args.device, args.warmup,
                 args.capacity, args.budget_s, args.passes)
    import timing  # as in run(): JAX's backend starts only once the soak is done

    print(markdown(report))
    timing.write_report(report, args.out, "soak", markdown)


if __name__ == "__main__":
    main()
