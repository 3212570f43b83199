"""Data-parallel scaling of the M1 training step: the same global batch on 1 GPU and on all.

M1 (BENCHMARK.md): a 4-layer ReLU MLP of width 4096, batch 65536, bf16, `value_and_grad` of a
mean-squared loss. On n devices the batch is sharded over a 1-D mesh ("data") and the
parameters replicated; jax-epilog's partitioning runs every GEMM on the local rows and XLA
all-reduces the weight gradients. Each step is timed with `timing.time_calls` for jax-epilog
(`jax_epilog.mlp`) and for XLA on the plain-JAX network, on 1 device and on n; reported:
ms per step, TFLOP/s (3 GEMMs per layer), the speed-up n-device / 1-device, and the
collectives in the compiled sharded step (there must be no all-gather).

    python benchmarks/multi_gpu_bench.py            # every visible GPU (needs >= 2)
    python benchmarks/multi_gpu_bench.py --smoke    # tiny shapes on 2 host CPU devices
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

M1 = dict(batch=65536, widths=[4096] * 5)
SMOKE = dict(batch=256, widths=[128] * 5)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 2 host CPU devices")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:  # before jax is imported: the host platform's device count is read once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=2").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    report = run(SMOKE if args.smoke else M1, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "multi_gpu.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out}/multi_gpu.json, multi_gpu.md")


def run(shape: dict, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(Path(__file__).parent))
    import timing

    import jax_epilog

    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"multi_gpu_bench: needs at least 2 devices, sees {len(devices)}")
    batch, widths = shape["batch"], shape["widths"]
    dtype = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(widths) + 2))
    x = jax.random.normal(next(keys), (batch, widths[0]), dtype)
    target = jax.random.normal(next(keys), (batch, widths[-1]), dtype)
    params = tuple(((jax.random.normal(next(keys), (k, n), jnp.float32) / np.sqrt(k)).astype(dtype),
                    (0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype))
                   for k, n in zip(widths, widths[1:]))

    def xla_mlp(x, layers):
        for i, (w, b) in enumerate(layers):
            x = jnp.dot(x, w) + b
            x = jax.nn.relu(x) if i < len(layers) - 1 else x
        return x

    def step_of(mlp):
        def loss(params, x, target):
            error = mlp(x, params).astype(jnp.float32) - target
            return 0.5 * jnp.mean(error * error)
        return jax.value_and_grad(loss)

    flops = 3 * sum(timing.gemm_flops(batch, k, n) for k, n in zip(widths, widths[1:]))
    meshes = {1: devices[:1], len(devices): devices}
    rows = []
    for name, mlp in (("jax-epilog", jax_epilog.mlp), ("XLA", xla_mlp)):
        per_devices = {}
        for n_dev, devs in meshes.items():
            mesh = jax.sharding.Mesh(np.array(devs), ("data",))
            data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
            args = jax.device_put((params, x, target), (replicated, data, data))
            compiled = jax.jit(step_of(mlp), in_shardings=(replicated, data, data)).lower(
                *args).compile()
            text = compiled.as_text()
            t = timing.time_calls(compiled, [args], rounds=rounds)
            per_devices[n_dev] = t.seconds
            rows.append({
                "implementation": name, "devices": n_dev, "ms": 1e3 * t.seconds,
                "tflops": timing.tflops(flops, t.seconds), "timing": t.as_dict(),
                "all_gathers": text.count("all-gather-start") + text.count(" all-gather("),
                "all_reduces": text.count("all-reduce-start") + text.count(" all-reduce("),
                "memory": timing.memory_analysis(compiled)})
        rows[-1]["speedup"] = per_devices[1] / per_devices[len(devices)]
    return {"shape": shape, "dtype": "bfloat16", "rows": rows, "metadata": timing.run_metadata()}


def markdown(report: dict) -> str:
    shape = report["shape"]
    lines = [f"# Data-parallel M1 step: batch {shape['batch']}, widths {shape['widths']}, bf16",
             "", "| implementation | devices | ms / step | TFLOP/s (total) | speed-up vs 1 "
             "| all-gathers | all-reduces |", "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
        lines.append(f"| {row['implementation']} | {row['devices']} | {row['ms']:.2f} | "
                     f"{row['tflops']:.0f} | {speedup} | {row['all_gathers']} | "
                     f"{row['all_reduces']} |")
    meta = report["metadata"]
    lines += ["", "Run: " + ", ".join(f"{k}={v}" for k, v in meta.items()
                                      if isinstance(v, (str, int, float)))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
