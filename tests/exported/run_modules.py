"""Runs every exported module of one folder in THIS process, as a user's fresh process would:
`import jax, jax_epilog`, then `jax.export.deserialize(blob).call(*inputs)`, nothing lowered
first. Prints one JSON line per module: its name and the error against the outputs stored with
it (and their dtypes), or the exception. `tests/op/test_exported.py` runs it in a subprocess per
folder.

    python tests/exported/run_modules.py tests/exported/<commit>/<platform>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog  # noqa: F401  (what a user imports; it registers the FFI targets)


def error(got, want) -> float:
    """The largest difference relative to the largest expected value (masks: the share of
    disagreeing bits, since values at 0 may round either way)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if want.size and set(np.unique(want)) <= {0.0, 1.0} and set(np.unique(got)) <= {0.0, 1.0}:
        return float(np.mean(got != want))
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    return float(np.max(np.abs(got - want)) / scale) if want.size else 0.0


def load(data, key: str):
    """An array `make_modules` stored, its float dtype restored from its bits."""
    x = data[key]
    return x.view(jnp.dtype(str(data[f"{key}_dtype"]))) if f"{key}_dtype" in data else x


def main(folder: str) -> int:
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["cases"]:
        try:
            exported = jax.export.deserialize((folder / f"{name}.bin").read_bytes())
            data = np.load(folder / f"{name}.npz")
            inputs = [load(data, f"in{i}") for i in range(manifest["cases"][name]["inputs"])]
            outputs = jax.tree.leaves(exported.call(*inputs))
            wanted = [load(data, f"out{i}") for i in range(manifest["cases"][name]["outputs"])]
            errors = [error(g, w) for g, w in zip(outputs, wanted)]
            line = {"name": name, "errors": errors, "outputs": len(outputs),
                    "dtypes": [np.dtype(w.dtype).name for w in wanted]}
        except Exception as e:  # each module's failure reported, the others still run
            line = {"name": name, "exception": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
