"""Run-time settings of the CUDA path: autotuning of cuBLASLt's algorithm choice.

With autotuning on, the first execution of each new problem (in XLA's initialize stage, never
inside CUDA-graph capture) times cuBLASLt's top heuristic candidates (up to 8) on the call's
inputs and keeps the fastest, for the process and in a file shared by the processes of the
machine (`autotune_cache_path()`), keyed by GPU model, cuBLASLt version and problem, so each
problem is tuned once per machine. On by default: on the H200 it made the G3 forward 1.21x
faster and cost 3-250 ms once per problem (benchmarks/results/autotune.md).

    from jax_epilog import config
    config.set_autotune(False)    # or JAX_EPILOG_AUTOTUNE=0 in the environment

The switch applies to problems not tuned yet; a tuned plan keeps its algorithm for the process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from . import cuda_library

AUTOTUNE_ENV = "JAX_EPILOG_AUTOTUNE"
AUTOTUNE_CACHE_ENV = "JAX_EPILOG_AUTOTUNE_CACHE"
# The library's default (kAutotuneByDefault in ffi/autotune.cc).
AUTOTUNE_DEFAULT = True


def set_autotune(enabled: bool) -> None:
    """Turn autotuning on or off, for this process and the processes it starts."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__} {enabled!r}")
    # The environment reaches child processes and a library loaded later; the setter
    # reaches one already loaded (it reads the environment only once).
    os.environ[AUTOTUNE_ENV] = "1" if enabled else "0"
    cuda_library.set_autotune(enabled)


def autotune_enabled() -> bool:
    """Whether new problems are autotuned: the library's answer, or without the library what
    it would read from the environment ("1" on, "0" off, else the default)."""
    enabled = cuda_library.autotune_enabled()
    if enabled is not None:
        return enabled
    return {"1": True, "0": False}.get(os.environ.get(AUTOTUNE_ENV, ""), AUTOTUNE_DEFAULT)


def autotune_cache_path() -> Optional[Path]:
    """The file of tuned algorithms: $JAX_EPILOG_AUTOTUNE_CACHE (set but empty: none), else
    ~/.cache/jax_epilog/autotune.txt (no HOME: none). Read when the library first needs it
    (again after `cuda_library.clear_plan_cache()`)."""
    path = os.environ.get(AUTOTUNE_CACHE_ENV)
    if path is not None:
        return Path(path) if path else None
    home = os.environ.get("HOME")
    return Path(home) / ".cache" / "jax_epilog" / "autotune.txt" if home else None
