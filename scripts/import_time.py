"""Wall time of `import jax_epilog` (after `import jax`), in fresh processes.

    python scripts/import_time.py [--runs 5] [--tree DIR ...]

Each run is a new interpreter (a warm process would find everything imported already), so
the time includes loading the CUDA library and registering its targets where the import does
that (an NVIDIA driver present, the library built). `import jax` comes first and is not
counted: a user's process imports it anyway. With no --tree the jax_epilog the environment
imports (installed, or PYTHONPATH's) is timed; each --tree DIR is put first on PYTHONPATH (an
older source tree, say; copy the built libjax_epilog_ffi.so into DIR/jax_epilog for its
library to load). Prints one line per tree: the median and the spread, and whether the
library was loaded at import. The processes run from / so a checkout in the current folder
does not shadow what is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# Runs in the fresh process: times the import alone, and says where jax_epilog came from and
# whether the import loaded its library (runtime.library or, in older trees, cuda_library).
PROBE = """
import json, sys, time
import jax
t = time.perf_counter()
import jax_epilog
elapsed = time.perf_counter() - t
loaded = False  # neither module imported: nothing loaded
for name in ("jax_epilog.runtime.library", "jax_epilog.cuda_library"):
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "library"):
        loaded = module.library.cache_info().currsize > 0
print(json.dumps({"seconds": elapsed, "file": jax_epilog.__file__, "loaded": loaded}))
"""


def measure(tree: str | None, runs: int) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                          env.get("PYTHONPATH")]))
    samples = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              env=env, cwd="/", timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"import_time: importing jax_epilog from {tree or 'the environment'}"
                             f" failed:\n{done.stderr[-2000:]}")
        samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    seconds = sorted(s["seconds"] for s in samples)
    return {"tree": tree or "environment", "file": samples[0]["file"],
            "loaded": samples[0]["loaded"], "median": statistics.median(seconds),
            "min": seconds[0], "max": seconds[-1], "runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per tree")
    parser.add_argument("--tree", action="append", default=None,
                        help="a source tree to time instead of the environment's (repeatable)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for tree in args.tree or [None]:
        r = measure(tree, args.runs)
        print(f"import jax_epilog: median {r['median']:.3f} s (min {r['min']:.3f}, max "
              f"{r['max']:.3f}, {r['runs']} fresh processes), library loaded at import: "
              f"{r['loaded']}, from {r['file']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
