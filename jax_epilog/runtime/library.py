"""Loading `libjax_epilog_ffi.so` and registering its XLA FFI handler for CUDA.

The library links cuBLASLt and the CUDA runtime from NVIDIA's cu13 wheels (the copies JAX's
CUDA plugin uses). They are preloaded from the wheels' folder so our library finds exactly
those. Nothing here touches a GPU: cuBLASLt handles are made lazily inside the library, so
importing jax_epilog on a machine without a driver, or without the wheels, just leaves the CUDA
path unavailable (the reason is kept for the error or warning that needs it).

The library reads no environment variable: right after loading it, its settings (autotuning, its
log, the autotune file, the plan cache's capacity) are set from `jax_epilog.settings`, which
parses them, and `jax_epilog.config`'s setters reach the loaded library through the wrappers
here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path
from typing import Optional

import jax

from jax_epilog.runtime import settings, targets

_LIBRARY_FILE = "libjax_epilog_ffi.so"
# The build installs the library at the package's top (ffi/CMakeLists.txt).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: The library interface this package speaks (ffi/support_query.cc, jax_epilog_abi_version).
ABI_VERSION = 4
_PRELOAD = ("libcudart.so.13", "libcublasLt.so.13")


def _nvidia_lib_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) / "cu13" / "lib" for p in spec.submodule_search_locations]


def _preload_cuda_libraries() -> None:
    for name in _PRELOAD:
        for folder in _nvidia_lib_dirs():
            if (folder / name).exists():
                ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
                break


# Run-time controls (ffi/controls.cc): name, result type, argument types.
_CONTROLS = (
    ("jax_epilog_set_autotune", None, [ctypes.c_int]),
    ("jax_epilog_set_autotune_log", None, [ctypes.c_int]),
    ("jax_epilog_set_autotune_cache_path", None, [ctypes.c_char_p]),
    ("jax_epilog_set_plan_cache_capacity", None, [ctypes.c_int64]),
    ("jax_epilog_autotune_enabled", ctypes.c_int, []),
    ("jax_epilog_plan_cache_size", ctypes.c_int, []),
    ("jax_epilog_clear_plan_cache", None, []),
    ("jax_epilog_inject_failures", None, [ctypes.c_int]),
    ("jax_epilog_captured_executions", ctypes.c_int64, []),
    ("jax_epilog_algo_store_put_for_test", ctypes.c_int,
     [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int64]),
    ("jax_epilog_algo_store_count_for_test", ctypes.c_int64, [ctypes.c_char_p]),
)


class _Library:
    """The loaded library, or why it could not be loaded."""

    def __init__(self):
        self.handle: Optional[ctypes.CDLL] = None
        self.error: Optional[str] = None
        path = PACKAGE_DIR / _LIBRARY_FILE
        if settings.cuda_disabled():
            self.error = "disabled by JAX_EPILOG_DISABLE_CUDA"
            return
        if not path.exists():
            self.error = _not_built_reason(path)
            return
        try:
            _preload_cuda_libraries()
            self.handle = ctypes.CDLL(str(path))
        except OSError as e:  # e.g. no cuBLASLt on this machine: CUDA path unavailable
            self.error = f"could not load {path.name}: {e}"
            return
        built = getattr(self.handle, "jax_epilog_abi_version", None)
        if built is None or built() != ABI_VERSION:  # its calls and entry points differ
            self.handle = None
            self.error = f"{path} was built from other sources: reinstall jax-epilog"
            return
        lib = self.handle
        lib.jax_epilog_cublaslt_version.restype = ctypes.c_size_t
        lib.jax_epilog_query_support.restype = ctypes.c_int
        lib.jax_epilog_query_support.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
            ctypes.c_char_p, ctypes.c_size_t,
        ]
        for name, restype, argtypes in _CONTROLS:
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = argtypes
        lib.jax_epilog_set_autotune(int(settings.autotune()))
        lib.jax_epilog_set_plan_cache_capacity(settings.plan_cache_capacity())
        self.apply_file_settings()

    def apply_file_settings(self) -> None:
        """The autotune file and log, as the settings give them now (read again on every clear)."""
        self.handle.jax_epilog_set_autotune_log(int(settings.autotune_log()))
        self.handle.jax_epilog_set_autotune_cache_path(_path_bytes(settings.autotune_cache_path()))


#: How to get the handler into an install that lacks it.
BUILD_HINT = ("to build it, reinstall with a C++17 compiler and JAX_EPILOG_BUILD_CUDA=1: "
              "JAX_EPILOG_BUILD_CUDA=1 pip install --force-reinstall --no-deps . in a checkout")


def install_hint(extra: str) -> str:
    """How to install one of the package's extras, from a checkout and from an index."""
    return (f'pip install ".[{extra}]" in a checkout of jax-epilog '
            f'(pip install "jax-epilog[{extra}]" from a package index)')


def _not_built_reason(path: Path) -> str:
    """Why `path` is absent (the line the build backend left in the package, if it did) and
    how to build it."""
    reason = path.with_name("_no_cuda_handler.txt")  # build_backend/jax_epilog_build.py
    why = reason.read_text().strip() if reason.exists() else f"{path.name} was not built"
    return f"{why} ({BUILD_HINT})"


def _path_bytes(path: Optional[os.PathLike]) -> bytes:
    """A path for the library: b"" (no file) for None."""
    return os.fsencode(path) if path is not None else b""


@functools.cache
def library() -> _Library:
    lib = _Library()
    if lib.handle is not None:
        targets.register(lib.handle)
        targets.register(lib.handle, targets.FUSED_TARGETS)
    return lib


#: Where a machine shows an NVIDIA driver (the build backend looks for the same).
DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0")


def load_if_a_gpu_is_present() -> None:
    """At `import jax_epilog`: loads the library, and so registers its FFI targets, where this
    machine has an NVIDIA driver and the library was built. A module exported with
    `jax.export` and deserialized in a fresh process lowers nothing of ours, so without this
    its custom call would find no handler. Elsewhere nothing is loaded (import stays cheap,
    and a CPU-only machine has nothing to run the targets on). JAX keeps a registration made
    before its CUDA backend starts until it does; nothing here starts a backend."""
    if (not settings.cuda_disabled() and (PACKAGE_DIR / _LIBRARY_FILE).exists()
            and any(os.path.exists(path) for path in DRIVER_FILES)):
        library()


def available() -> bool:
    return library().handle is not None


def unavailable_reason() -> Optional[str]:
    return library().error


def cublaslt_version() -> Optional[int]:
    """cuBLASLt's version number (e.g. 130100), or None without the library."""
    lib = library()
    return int(lib.handle.jax_epilog_cublaslt_version()) if lib.handle is not None else None


def fused_kernels_built() -> bool:
    """Whether the loaded library carries the fused FP8 passes' kernels (built with nvcc:
    ffi/CMakeLists.txt); False without the library."""
    lib = library()
    return lib.handle is not None and bool(lib.handle.jax_epilog_fused_kernels_built())


_DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}


def supports_fp8() -> bool:
    """Whether the loaded library takes FP8 operands (False without the library)."""
    lib = library()
    return lib.handle is not None and hasattr(lib.handle, "jax_epilog_supports_fp8") and \
        bool(lib.handle.jax_epilog_supports_fp8())


@functools.lru_cache(maxsize=4096)
def query_support(epilog: int, dtype: str, transpose_a: bool, transpose_b: bool, batch: int,
                  b_batch: int, bias_batch: int, m: int, n: int, k: int, allow_tf32: bool,
                  workspace_bytes: int, device: int = 0, b_dtype: Optional[str] = None,
                  result_dtype: Optional[str] = None, result_amax: bool = False,
                  has_c: bool = False, fast_accumulation: bool = False,
                  block_rows: tuple[int, int] = (0, 0)) -> tuple[Optional[bool], str]:
    """Whether cuBLASLt has a kernel for this problem on `device`.

    `dtype` is a's; `b_dtype` and `result_dtype` (y's) default to it (they differ only for
    FP8 operands, as may `result_amax`). `has_c`: a call with a C matrix (alpha and beta
    device pointers, the plan `TARGET_NAME_C` runs). `fast_accumulation`: cuBLASLt's FP8
    fast accumulation (FP8 operands only; the library ignores it for others). `block_rows`:
    the rows of a's and b's block-scale tiles (1 or 128; 0, 0: per-tensor scales). Returns
    (True|False, message), or (None, reason) when it cannot tell (no library, no GPU on this
    machine: e.g. exporting for CUDA from a CPU host). Building the answer also builds and
    caches the plan, so the first execution does no planning.
    """
    lib = library()
    if lib.handle is None:
        return None, lib.error or "library unavailable"
    message = ctypes.create_string_buffer(512)
    status = lib.handle.jax_epilog_query_support(
        device, epilog, _DTYPE_CODES[dtype], _DTYPE_CODES[b_dtype or dtype],
        _DTYPE_CODES[result_dtype or dtype], int(result_amax), int(has_c), int(transpose_a),
        int(transpose_b), batch, b_batch, bias_batch, m, n, k, int(allow_tf32),
        int(fast_accumulation), int(block_rows[0]), int(block_rows[1]), workspace_bytes,
        message, len(message))
    text = message.value.decode(errors="replace")
    if status < 0:
        return None, text
    return bool(status), text


def set_autotune(enabled: bool) -> None:
    """Autotuning on or off in the loaded library; nothing without it. Use `jax_epilog.config`."""
    lib = library()
    if lib.handle is not None:
        lib.handle.jax_epilog_set_autotune(int(enabled))


def set_autotune_log(enabled: bool) -> None:
    """Each tuning logged to stderr, or not, in the loaded library; nothing without it."""
    lib = library()
    if lib.handle is not None:
        lib.handle.jax_epilog_set_autotune_log(int(enabled))


def set_autotune_cache_path(path: Optional[os.PathLike]) -> None:
    """The loaded library's file of tuned algorithms (None: no file), read when next needed;
    nothing without the library. Use `jax_epilog.config`."""
    lib = library()
    if lib.handle is not None:
        lib.handle.jax_epilog_set_autotune_cache_path(_path_bytes(path))


def set_plan_cache_capacity(n: int) -> None:
    """At most `n` cuBLASLt plans stay cached in the loaded library (the least recently used go
    first); nothing without the library. Use `jax_epilog.config`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    lib = library()
    if lib.handle is not None:
        lib.handle.jax_epilog_set_plan_cache_capacity(n)


def autotune_enabled() -> Optional[bool]:
    """Whether the loaded library autotunes new plans, or None without the library."""
    lib = library()
    return bool(lib.handle.jax_epilog_autotune_enabled()) if lib.handle is not None else None


def plan_cache_size() -> Optional[int]:
    """How many problems have a cached cuBLASLt plan in this process, or None without the
    library."""
    lib = library()
    return int(lib.handle.jax_epilog_plan_cache_size()) if lib.handle is not None else None


def clear_plan_cache() -> None:
    """For tests and benchmarks: forget every plan (and the support answers that built them) and
    re-read the autotune file (at the path and with the log setting config gives now), so each
    problem is planned, and with autotuning on tuned, anew."""
    query_support.cache_clear()
    lib = library()
    if lib.handle is not None:
        lib.handle.jax_epilog_clear_plan_cache()
        lib.apply_file_settings()


def captured_executions() -> Optional[int]:
    """How many kernel executions were recorded into CUDA graphs (XLA command buffers) in this
    process, or None without the library."""
    lib = library()
    return int(lib.handle.jax_epilog_captured_executions()) if lib.handle is not None else None


def inject_failures(count: int) -> None:
    """Test only: the next `count` executions of the custom call fail as if cublasLtMatmul had
    returned CUBLAS_STATUS_EXECUTION_FAILED (the exception names it); 0 cancels."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: expected a non-negative int, got {count!r}")
    lib = library()
    if lib.handle is None:
        raise RuntimeError(f"jax_epilog: cannot inject failures, the CUDA library is "
                           f"unavailable ({lib.error})")
    lib.handle.jax_epilog_inject_failures(count)
