"""GPU fuzz: random valid problems on the GPU against the CPU reference and the NumPy model.

Run on a CUDA machine (from the repository root):

    python tests/support/gpu_fuzz.py [--seed 20240601] [--count 300]

Each problem (`random_problems.draw_problem`: every epilog, dtype, 0-2 leading dims, shapes
1..40, transposes, shared or batched b and bias, precision) runs jitted on the GPU and, on the
same inputs, on the CPU; both must match the float64 NumPy model within the dtype's tolerance,
mask bits included. Prints the seed, the counts and every failure; exits 1 on any failure.

Then a NaN / Inf / signed-zero probe: for every epilog and dtype, inputs with NaN, +Inf, -Inf
and -0.0 in `a`, the bias and the GELU pre-activation (`test_nonfinite.nonfinite_problem`),
printing each output element where the GPU and the CPU differ. The probe reports; it does not
fail the run (tests/op/test_nonfinite.py asserts).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_epilog  # noqa: E402
from jax_epilog import Epilog  # noqa: E402
from random_problems import draw_problem  # noqa: E402
from test_nonfinite import differences, nonfinite_problem, outputs  # noqa: E402


def _jit(p):
    return jax.jit(lambda a, b, x: p.run(jax_epilog.matmul, a, b, x))


def fuzz(seed: int, count: int) -> int:
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    rng = np.random.default_rng(seed)
    failures = []
    for i in range(count):
        p = draw_problem(rng)
        args = p.operands()
        try:
            fn = _jit(p)
            found = [f"gpu {m}" for m in p.mismatches(fn(*jax.device_put(args, gpu)), *args)]
            found += [f"cpu {m}" for m in p.mismatches(fn(*jax.device_put(args, cpu)), *args)]
        except Exception:  # noqa: BLE001 (a crash in a valid problem is a failure to report)
            found = [traceback.format_exc(limit=3)]
        if found:
            failures.append((i, p, found))
            print(f"FAIL #{i} {p}\n    " + "\n    ".join(found), flush=True)
    print(f"gpu_fuzz: seed {seed}: {count - len(failures)} passed, {len(failures)} failed "
          f"of {count}", flush=True)
    return len(failures)


def nonfinite_probe() -> None:
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    print("\nNaN/Inf/-0.0 probe (GPU vs CPU; rows of a: 0 NaN, 1 +Inf, 2 -Inf, 3 -0.0, "
          "4 finite, 5 +Inf & -Inf; bias cols 0 NaN, 1 +Inf, 2 -Inf, 3 -0.0; gelu_aux row 4: "
          "NaN, +Inf, -Inf, -0.0, 1e20, -1e20)")
    for dtype in ("float32", "bfloat16"):
        for epilog in Epilog:
            args = nonfinite_problem(epilog, dtype)
            found = differences(outputs(epilog, *args, gpu), outputs(epilog, *args, cpu))
            status = "same" if not found else f"{len(found)} differ"
            print(f"  {dtype:8s} {epilog.name:14s} {status}")
            for line in found[:24]:
                print(f"      gpu vs cpu: {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    if not any(d.platform == "gpu" or d.platform == "cuda" for d in jax.devices()):
        print("gpu_fuzz: no CUDA device", file=sys.stderr)
        return 2
    print(f"gpu_fuzz: jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"cuBLASLt {jax_epilog.runtime.library.cublaslt_version()}")
    failed = fuzz(args.seed, args.count)
    nonfinite_probe()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
