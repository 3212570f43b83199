"""Every `JAX_EPILOG_*` setting: its variable, default, meaning and parser, in one place.

The environment is read here and nowhere else (the C++ library gets its values through the
setters `cuda_library` calls when it loads), when a value is needed, so a variable set before
the first call, or changed by a test, is honoured. The README's settings table lists `SETTINGS`
(a test checks that it does). Users read and change the settings through `jax_epilog.config`,
which adds the setters that also reach the loaded library; this module is what the library's
loader (`cuda_library`) reads, below both.
"""


from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal, NamedTuple, Optional, get_args

from jax_epilog.runtime import context


class Setting(NamedTuple):
    variable: str
    default: str  # as written in the README
    meaning: str


SETTINGS = (
    Setting("JAX_EPILOG_AUTOTUNE", "1",
            "`1`: time cuBLASLt's top candidates (up to 8) the first time a problem runs and keep "
            "the fastest (benchmarks/results/autotune.md; it costs a little time once per "
            "problem); `0`: take "
            "the heuristic's first. Applies to problems not planned yet."),
    Setting("JAX_EPILOG_AUTOTUNE_CACHE", "`~/.cache/jax_epilog/autotune.txt`",
            "The file of tuned algorithms shared by the processes of the machine, keyed by GPU, "
            "cuBLASLt version and problem; set but empty: no file."),
    Setting("JAX_EPILOG_AUTOTUNE_LOG", "0",
            "`1`: print each tuning (candidate times, choice), and why a problem was left "
            "untuned, to stderr."),
    Setting("JAX_EPILOG_PLAN_CACHE_SIZE", "4096",
            "Most cuBLASLt plans kept per process; the least recently used is dropped first."),
    Setting("JAX_EPILOG_WORKSPACE_BYTES", "33554432",
            "cuBLASLt's workspace per call (an XLA temporary; 32 MiB is cuBLASLt's advice for "
            "Hopper). Read when a call is lowered."),
    Setting("JAX_EPILOG_PAD_UNALIGNED", "1",
            "`1`: zero-pad a K or N that is not a multiple of 16 bytes before the kernel (as XLA "
            "does for its GEMMs); `0`: call the kernel on the unaligned problem."),
    Setting("JAX_EPILOG_BACKEND", "auto",
            "Overrides the `auto` choice between the cuBLASLt kernel and XLA's lowering of the "
            "same computation: `cublaslt` or `xla` for every call that did not choose itself."),
    Setting("JAX_EPILOG_SERVING", "auto",
            "How layers with weights stored in FP8 run: `fp8` (activations quantized, our "
            "FP8 GEMM with the epilog), `xla_fp8` (activations quantized, XLA's own FP8 dot), "
            "`weight_only` (16-bit activations times the FP8 weight converted inside XLA's "
            "GEMM) or `auto` (by the rows, `planning.serving_plan`). Read when a call is "
            "traced."),
    Setting("JAX_EPILOG_DECISIONS", "`~/.cache/jax_epilog/decisions.json`",
            "The table `python -m jax_epilog.tune` writes and `auto` reads before the shipped "
            "one; set but empty: none."),
    Setting("JAX_EPILOG_FUSED_PASSES", "xla",
            "What runs the FP8 passes around the GEMMs (quantize with the transposed copy, "
            "SwiGLU's h and `[dg du]`): `xla` (XLA's fusions), `cuda` (the library's fused "
            "kernels, an error where they cannot run) or `auto` (the kernels on one CUDA GPU "
            "where the library has them, else XLA's): docs/fp8.md, \"Fused passes\". Read "
            "when a call is traced."),
    Setting("JAX_EPILOG_DISABLE_CUDA", "0",
            "`1`: never load the C++ library; CUDA calls run XLA's lowering of the reference "
            "(with a warning)."),
)
_DEFAULTS = {s.variable: s.default for s in SETTINGS}
#: What runs a GEMM: `matmul(backend=)` and JAX_EPILOG_BACKEND (which has no "auto").
Backend = Literal["auto", "cublaslt", "xla"]
BACKENDS = get_args(Backend)

# Kept for callers of the earlier API.
AUTOTUNE_ENV = "JAX_EPILOG_AUTOTUNE"
AUTOTUNE_CACHE_ENV = "JAX_EPILOG_AUTOTUNE_CACHE"
AUTOTUNE_DEFAULT = _DEFAULTS["JAX_EPILOG_AUTOTUNE"] == "1"


def _raw(variable: str) -> Optional[str]:
    assert variable in _DEFAULTS, variable  # every variable is listed in SETTINGS
    return os.environ.get(variable)


def _flag(variable: str) -> bool:
    """"1" on, "0" off, anything else (unset included) the default."""
    return {"1": True, "0": False}.get(_raw(variable) or "", _DEFAULTS[variable] == "1")


def _positive_int(variable: str, default: int, minimum: int) -> int:
    value = _raw(variable)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ValueError(f"{variable}={value!r}: expected an integer >= {minimum}")
    return number


def _cache_file(variable: str, name: str) -> Optional[Path]:
    """$variable (set but empty: None), else ~/.cache/jax_epilog/<name> (no HOME: None)."""
    path = _raw(variable)
    if path is not None:
        return Path(path) if path else None
    home = os.environ.get("HOME")
    return Path(home) / ".cache" / "jax_epilog" / name if home else None


# --- the settings -----------------------------------------------------------------------------

def autotune() -> bool:
    """Whether new problems are autotuned (JAX_EPILOG_AUTOTUNE)."""
    return _flag("JAX_EPILOG_AUTOTUNE")




def autotune_log() -> bool:
    return _flag("JAX_EPILOG_AUTOTUNE_LOG")


def autotune_cache_path() -> Optional[Path]:
    """The file of tuned algorithms (JAX_EPILOG_AUTOTUNE_CACHE)."""
    return _cache_file("JAX_EPILOG_AUTOTUNE_CACHE", "autotune.txt")


def decisions_path() -> Optional[Path]:
    """The user's measured table of backend choices (JAX_EPILOG_DECISIONS)."""
    return _cache_file("JAX_EPILOG_DECISIONS", "decisions.json")


def plan_cache_capacity() -> int:
    return _positive_int("JAX_EPILOG_PLAN_CACHE_SIZE", 4096, minimum=1)


def workspace_bytes() -> int:
    return _positive_int("JAX_EPILOG_WORKSPACE_BYTES", 32 * 1024 * 1024, minimum=0)


def pad_unaligned() -> bool:
    return _flag("JAX_EPILOG_PAD_UNALIGNED")


def cuda_disabled() -> bool:
    return _flag("JAX_EPILOG_DISABLE_CUDA")


def backend_override() -> Optional[str]:
    """`cublaslt` / `xla` from JAX_EPILOG_BACKEND, or None (unset or `auto`)."""
    value = (_raw("JAX_EPILOG_BACKEND") or "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"JAX_EPILOG_BACKEND={value!r}: expected one of {', '.join(BACKENDS)}")
    return None if value == "auto" else value


#: How a layer of a stored FP8 weight runs (docs/serving.md): JAX_EPILOG_SERVING and
#: `forced_serving_way`; "auto" leaves it to `planning.serving_plan`.
ServingWay = Literal["auto", "fp8", "fp8_pallas", "xla_fp8", "weight_only"]
SERVING_WAYS = get_args(ServingWay)


def serving_override() -> Optional[str]:
    """`fp8` / `fp8_pallas` / `xla_fp8` / `weight_only` from JAX_EPILOG_SERVING, or None (unset or `auto`)."""
    value = (_raw("JAX_EPILOG_SERVING") or "auto").strip().lower()
    if value not in SERVING_WAYS:
        raise ValueError(f"JAX_EPILOG_SERVING={value!r}: expected one of "
                         f"{', '.join(SERVING_WAYS)}")
    return None if value == "auto" else value


@contextlib.contextmanager
def forced_serving_way(way: Optional[ServingWay]):
    """As `JAX_EPILOG_SERVING=way` while the block runs (in this thread), then as it was: every
    layer with a stored FP8 weight traced inside runs that way (docs/serving.md); None changes
    nothing. Set in the per-trace `runtime.context.Context`, not the environment."""
    if way is None:
        yield
        return
    if way not in SERVING_WAYS:
        raise ValueError(f"way: expected one of {', '.join(SERVING_WAYS)} or None, got {way!r}")
    with context.changed(serving_way=way):
        yield


#: What runs the fused FP8 passes (`float8.fused`): JAX_EPILOG_FUSED_PASSES.
FusedPasses = Literal["xla", "cuda", "auto"]
FUSED_PASSES = get_args(FusedPasses)


def fused_passes() -> str:
    """`xla`, `cuda` or `auto` from JAX_EPILOG_FUSED_PASSES (unset: `xla`)."""
    value = (_raw("JAX_EPILOG_FUSED_PASSES") or "xla").strip().lower()
    if value not in FUSED_PASSES:
        raise ValueError(f"JAX_EPILOG_FUSED_PASSES={value!r}: expected one of "
                         f"{', '.join(FUSED_PASSES)}")
    return value


def set_variable(variable: str, value: str) -> None:
    """Set a variable for this process and the processes it starts (and for a library loaded
    later); `config`'s setters also reach a library already loaded. The one write to the
    environment: the C++ library and child processes read their settings there."""
    assert variable in _DEFAULTS, variable
    os.environ[variable] = value
