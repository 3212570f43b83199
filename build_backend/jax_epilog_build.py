"""The build backend: scikit-build-core, with the C++ CUDA handler's build made optional.

A wheel with the handler needs a C++17 compiler and ~0.5 GB of build requirements (jaxlib's
FFI headers, NVIDIA's cuBLASLt and CUDA runtime wheels); a wheel without it is pure Python and
runs the reference everywhere. `JAX_EPILOG_BUILD_CUDA` chooses:

- `1`: build the handler (fails if it cannot be built);
- `0`: do not (a pure-Python wheel, no CUDA build requirements downloaded);
- `auto` (the default): build it when a C++ compiler is found and the machine has an NVIDIA
  driver, so a GPU machine gets the handler and a CPU machine a fast pure-Python install. A
  CUDA toolkit alone does not count: CPU-only CI images often carry one.

The requirements are asked for (`get_requires_for_build_wheel`) and the wheel built in separate
processes from the same environment, so both take the same decision. A wheel built without
the handler carries one line saying why (`REASON_FILE`), which `jax_epilog.cuda_library`
reports where the handler is looked for.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import shutil
import sys
import zipfile
from pathlib import Path

from scikit_build_core import build as _skbuild

# The rest of the PEP 517 interface, as scikit-build-core has it.
build_sdist = _skbuild.build_sdist
get_requires_for_build_sdist = _skbuild.get_requires_for_build_sdist

SWITCH = "JAX_EPILOG_BUILD_CUDA"
#: Inside the package, in a wheel built without the handler: why, in one line.
REASON_FILE = "jax_epilog/_no_cuda_handler.txt"
# What compiling the handler reads (ffi/CMakeLists.txt says why each):
CUDA_BUILD_REQUIRES = [
    "jaxlib==0.10.2",  # the XLA FFI headers of the oldest supported FFI API
    "nvidia-cublas>=13.0,<14",
    "nvidia-cuda-runtime>=13.0,<14",
    "nvidia-cuda-crt>=13.0,<14",
    "nvidia-cuda-cccl>=13.0,<14",
]
_COMPILERS = ("c++", "g++", "clang++")
_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0")
_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def find_compiler(environ=os.environ, which=shutil.which) -> str | None:
    """The C++ compiler CMake would use: $CXX if set (None if it is not there), else the
    first of c++, g++, clang++ on PATH."""
    if environ.get("CXX"):
        words = shlex.split(environ["CXX"])
        return which(words[0]) if words else None
    return next((found for name in _COMPILERS if (found := which(name))), None)


def find_nvidia_driver(exists=os.path.exists, which=shutil.which) -> str | None:
    """Where this machine shows an NVIDIA driver (a /proc or /dev entry, or nvidia-smi), or
    None."""
    return next((path for path in _DRIVER_FILES if exists(path)), None) or which("nvidia-smi")


def decide(environ=os.environ, which=shutil.which, exists=os.path.exists) -> tuple[bool, str]:
    """Whether to build the handler, and why (one phrase)."""
    setting = environ.get(SWITCH, "auto").strip().lower()
    if setting in _YES:
        return True, f"{SWITCH}={environ[SWITCH]}"
    if setting in _NO:
        return False, f"{SWITCH}={environ[SWITCH]}"
    if setting != "auto":
        raise ValueError(f"{SWITCH}: expected 1, 0 or auto, got {environ[SWITCH]!r}")
    compiler = find_compiler(environ, which)
    if compiler is None:
        where = f"CXX={environ['CXX']} not found" if environ.get("CXX") else \
            f"none of {', '.join(_COMPILERS)} on PATH"
        return False, f"no C++ compiler ({where})"
    driver = find_nvidia_driver(exists, which)
    if driver is None:
        return False, "no NVIDIA driver on this machine"
    return True, f"C++ compiler {compiler} and NVIDIA driver ({driver}) found"


def _settings(config_settings, build_handler: bool) -> dict:
    """scikit-build-core's config settings, with CMake (the handler's build) off if not wanted."""
    settings = dict(config_settings or {})
    if not build_handler:
        settings["wheel.cmake"] = "false"
    return settings


def _say(text: str) -> None:
    # pip shows a backend's output only with -v or on failure; the installed package says it
    # again where the handler is looked for (REASON_FILE).
    print(f"jax-epilog: {text}", file=sys.stderr, flush=True)


def _requires(config_settings, get_requires) -> list[str]:
    build_handler, _ = decide()
    requires = get_requires(_settings(config_settings, build_handler))
    return [*requires, *CUDA_BUILD_REQUIRES] if build_handler else requires


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _requires(config_settings, _skbuild.get_requires_for_build_wheel)


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _requires(config_settings, _skbuild.get_requires_for_build_editable)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    build_handler, why = decide()
    if build_handler:
        _say(f"building the CUDA handler ({why})")
        return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)
    line = f"built without the CUDA handler: {why}"
    _say(f"{line}; {SWITCH}=1 builds it")
    name = _skbuild.build_wheel(wheel_directory, _settings(config_settings, False),
                                metadata_directory)
    add_to_wheel(Path(wheel_directory) / name, REASON_FILE, line + "\n")
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    build_handler, why = decide()
    if not build_handler:
        _say(f"built without the CUDA handler: {why}; {SWITCH}=1 builds it")
    return _skbuild.build_editable(wheel_directory, _settings(config_settings, build_handler),
                                   metadata_directory)


# scikit-build-core offers these hooks only when its metadata needs no build. Its WHEEL file
# (pure or not) depends on whether CMake runs, so they take the same decision.
if hasattr(_skbuild, "prepare_metadata_for_build_wheel"):
    def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
        return _skbuild.prepare_metadata_for_build_wheel(
            metadata_directory, _settings(config_settings, decide()[0]))

if hasattr(_skbuild, "prepare_metadata_for_build_editable"):
    def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
        return _skbuild.prepare_metadata_for_build_editable(
            metadata_directory, _settings(config_settings, decide()[0]))


def add_to_wheel(wheel: Path, arcname: str, text: str) -> None:
    """Add a text file to a built wheel, with its line in the wheel's RECORD."""
    data = text.encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as old, \
            zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            content = old.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content += f"{arcname},sha256={digest},{len(data)}\n".encode()
                new.writestr(arcname, data)
            new.writestr(item, content)
    os.replace(rewritten, wheel)
