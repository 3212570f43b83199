"""The settings from Python: every `JAX_EPILOG_*` setting (parsed in `settings`, re-exported
here), and the setters that change one for this process, the processes it starts and the loaded
C++ library (which gets its values through the setters `cuda_library` calls when it loads).

    from jax_epilog import config
    config.set_autotune(False)    # or JAX_EPILOG_AUTOTUNE=0 in the environment
"""

from __future__ import annotations

from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime.settings import (AUTOTUNE_CACHE_ENV, AUTOTUNE_DEFAULT, AUTOTUNE_ENV,  # noqa: F401
                       BACKENDS, FUSED_PASSES, SERVING_WAYS, SETTINGS, Setting, autotune,
                       autotune_cache_path, autotune_log, backend_override, cuda_disabled,
                       decisions_path, fused_passes,
                       forced_serving_way, pad_unaligned, plan_cache_capacity,
                       serving_override, set_variable, workspace_bytes)


def autotune_enabled() -> bool:
    """The library's answer where it is loaded, else what it will be told: `autotune()`."""
    enabled = cuda_library.autotune_enabled()
    return autotune() if enabled is None else enabled


def set_autotune(enabled: bool) -> None:
    """Turn autotuning on or off for problems not planned yet."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__} {enabled!r}")
    set_variable("JAX_EPILOG_AUTOTUNE", "1" if enabled else "0")
    cuda_library.set_autotune(enabled)


def set_plan_cache_capacity(plans: int) -> None:
    """Keep at most `plans` cuBLASLt plans in this process (least recently used dropped)."""
    if isinstance(plans, bool) or not isinstance(plans, int) or plans < 1:
        raise ValueError(f"plans: expected an int >= 1, got {plans!r}")
    set_variable("JAX_EPILOG_PLAN_CACHE_SIZE", str(plans))
    cuda_library.set_plan_cache_capacity(plans)



def set_fused_passes(engine: str) -> None:
    """What runs the FP8 passes around the GEMMs in steps traced from now on (docs/fp8.md,
    "Fused passes"): `xla`, `cuda` or `auto`, as JAX_EPILOG_FUSED_PASSES."""
    if engine not in FUSED_PASSES:
        raise ValueError(f"engine: expected one of {', '.join(FUSED_PASSES)}, got {engine!r}")
    set_variable("JAX_EPILOG_FUSED_PASSES", engine)
