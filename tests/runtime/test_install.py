"""The install: the build backend (build_backend/jax_epilog_build.py) compiles the C++ handler
only where it is wanted, and a wheel built without it says why.

The decision is tested with a stand-in environment; one real build (no isolation, no compiler,
a few seconds) checks the pure-Python wheel.
"""

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from jax_epilog.runtime import library as cuda_library

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("scikit_build_core")  # in the test extra: it is what the backend wraps
_spec = importlib.util.spec_from_file_location(
    "jax_epilog_build", ROOT / "build_backend" / "jax_epilog_build.py")
backend = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(backend)

GCC = "/usr/bin/g++"
DRIVER = "/proc/driver/nvidia/version"


def decide(env=None, programs=(), files=()):
    """backend.decide on a machine with these programs on PATH and these files."""
    programs = {Path(p).name: p for p in programs}
    return backend.decide(environ=env or {}, which=programs.get,
                          exists=lambda path: path in files)


def test_auto_builds_with_a_compiler_and_an_nvidia_driver():
    build, why = decide(programs=[GCC], files=[DRIVER])
    assert build and GCC in why and DRIVER in why
    build, why = decide(programs=[GCC, "/usr/bin/nvidia-smi"])
    assert build and "nvidia-smi" in why


@pytest.mark.parametrize("env,programs,files,why", [
    ({}, [GCC], [], "no NVIDIA driver on this machine"),  # a CPU machine, even with a CUDA toolkit
    ({}, [], [DRIVER], "no C++ compiler (none of c++, g++, clang++ on PATH)"),
    ({"CXX": "/nonexistent"}, [GCC], [DRIVER], "no C++ compiler (CXX=/nonexistent not found)"),
    ({"JAX_EPILOG_BUILD_CUDA": "0"}, [GCC], [DRIVER], "JAX_EPILOG_BUILD_CUDA=0"),
])
def test_auto_or_0_builds_pure_python_and_says_why(env, programs, files, why):
    assert decide(env, programs, files) == (False, why)


def test_1_forces_the_build_and_cxx_names_the_compiler():
    assert decide({"JAX_EPILOG_BUILD_CUDA": "1"}) == (True, "JAX_EPILOG_BUILD_CUDA=1")
    assert decide({"CXX": "g++ -fdiagnostics-color"}, [GCC], [DRIVER])[0]


def test_bad_switch_is_refused():
    with pytest.raises(ValueError, match=r"JAX_EPILOG_BUILD_CUDA: expected 1, 0 or auto, "
                                         r"got 'maybe'"):
        decide({"JAX_EPILOG_BUILD_CUDA": "maybe"})


def test_cuda_requirements_only_when_building_the_handler(monkeypatch):
    monkeypatch.setattr(backend._skbuild, "get_requires_for_build_wheel",
                        lambda settings: ["skbuild-needs"] + sorted(settings))
    monkeypatch.setenv("JAX_EPILOG_BUILD_CUDA", "0")
    assert backend.get_requires_for_build_wheel() == ["skbuild-needs", "wheel.cmake"]
    monkeypatch.setenv("JAX_EPILOG_BUILD_CUDA", "1")
    requires = backend.get_requires_for_build_wheel()
    assert requires == ["skbuild-needs", *backend.CUDA_BUILD_REQUIRES]
    assert any(r.startswith("jaxlib==") for r in requires)
    assert any(r.startswith("nvidia-cublas") for r in requires)


def test_pyproject_asks_only_for_scikit_build_core():
    build_system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert build_system["requires"] == ["scikit-build-core>=0.10"]
    assert build_system["build-backend"] == "jax_epilog_build"
    assert build_system["backend-path"] == ["build_backend"]


def test_a_machine_without_a_compiler_gets_a_pure_python_wheel_that_says_why(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent", "CC": "/nonexistent",
           "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("JAX_EPILOG_BUILD_CUDA", None)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = ("jax-epilog: built without the CUDA handler: no C++ compiler (CXX=/nonexistent "
            "not found); JAX_EPILOG_BUILD_CUDA=1 builds it")
    assert line in result.stdout + result.stderr
    (wheel,) = tmp_path.glob("jax_epilog-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert not any(name.endswith(".so") for name in names)
        reason = archive.read(backend.REASON_FILE)
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD")))
    assert reason == b"built without the CUDA handler: no C++ compiler (CXX=/nonexistent " \
                     b"not found)\n"
    digest = base64.urlsafe_b64encode(hashlib.sha256(reason).digest()).rstrip(b"=")
    assert f"{backend.REASON_FILE},sha256={digest.decode()},{len(reason)}".encode() in record


def test_the_package_reports_the_reason_and_how_to_build(tmp_path):
    library = tmp_path / "libjax_epilog_ffi.so"
    assert cuda_library._not_built_reason(library) == \
        f"libjax_epilog_ffi.so was not built ({cuda_library.BUILD_HINT})"
    (tmp_path / "_no_cuda_handler.txt").write_text("built without the CUDA handler: why\n")
    assert cuda_library._not_built_reason(library) == \
        f"built without the CUDA handler: why ({cuda_library.BUILD_HINT})"
    assert "JAX_EPILOG_BUILD_CUDA=1 pip install" in cuda_library.BUILD_HINT
    assert Path(backend.REASON_FILE).name == "_no_cuda_handler.txt"
