"""The GPU wheel's scripts, on a CPU and without network: what scripts/check_gpu_wheel.py
accepts and refuses (tag, handler, grafted libraries, requirements), that the libraries
scripts/build_gpu_wheel.sh leaves out are the ones the handler links and the package loads
from NVIDIA's wheels, and that gpu_round.sh's `wheel` stage installs with no compiler
reachable. Building the wheel itself needs network (scripts/build_gpu_wheel.sh)."""

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_gpu_wheel  # noqa: E402

from jax_epilog.runtime import library  # noqa: E402

NAME = "jax_epilog-0.1.0-py3-none-manylinux_2_34_x86_64.whl"
BUILD_SCRIPT = (ROOT / "scripts" / "build_gpu_wheel.sh").read_text()
ROUND_SCRIPT = (ROOT / "scripts" / "gpu_round.sh").read_text()


def requires_dist() -> list[str]:
    """The project's Requires-Dist lines, as its wheels carry them (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        lines += [f'{r}; extra == "{extra}"' for r in requirements]
    return lines


def make_wheel(folder: Path, name: str = NAME, tag: str = "py3-none-manylinux_2_34_x86_64",
               files=(check_gpu_wheel.LIBRARY,), requires=None, purelib="false") -> Path:
    wheel = folder / name
    info = "jax_epilog-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("jax_epilog/__init__.py", "")
        for file in files:
            z.writestr(file, b"\x7fELF")
        z.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\n"
                                    f"Root-Is-Purelib: {purelib}\nTag: {tag}\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: jax-epilog\n" + "".join(
            f"Requires-Dist: {r}\n" for r in (requires_dist() if requires is None else requires)))
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_the_checker_accepts_the_wheel_the_script_builds(tmp_path):
    wheel = make_wheel(tmp_path)
    assert check_gpu_wheel.problems(wheel) == []
    resolution = {"install": [{"metadata": {"name": n, "version": v}} for n, v in (
        ("jax", "0.11.2"), ("jax-cuda13-plugin", "0.11.2"), ("nvidia-cublas", "13.1.0.3"),
        ("nvidia-cuda-runtime", "13.0.96"))]}
    assert check_gpu_wheel.problems(wheel, resolution) == []
    report = tmp_path / "resolution.json"
    report.write_text(json.dumps(resolution))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_gpu_wheel.py"),
                           str(wheel), "--resolution", str(report)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tag: py3-none-manylinux_2_34_x86_64" in done.stdout
    assert "with [cuda]: jax[cuda13]>=0.10.2" in done.stdout
    assert "nvidia-cublas 13.1.0.3, nvidia-cuda-runtime 13.0.96" in done.stdout


@pytest.mark.parametrize("change, problem", [
    ({"files": ()}, "no jax_epilog/libjax_epilog_ffi.so"),
    ({"files": (check_gpu_wheel.LIBRARY, check_gpu_wheel.NO_HANDLER)}, "without the handler"),
    ({"files": (check_gpu_wheel.LIBRARY, "jax_epilog.libs/libcublasLt-0123abcd.so.13")},
     "libraries grafted in by auditwheel"),
    ({"tag": "cp312-cp312-manylinux_2_34_x86_64",
      "name": "jax_epilog-0.1.0-cp312-cp312-manylinux_2_34_x86_64.whl"},
     "expected one, py3-none-manylinux_2_NN_x86_64"),
    ({"tag": "py3-none-linux_x86_64", "name": "jax_epilog-0.1.0-py3-none-linux_x86_64.whl"},
     "expected one, py3-none-manylinux_2_NN_x86_64"),  # not repaired
    ({"tag": "py3-none-manylinux_2_28_x86_64"}, "does not end in its tag"),
    ({"purelib": "true"}, "Root-Is-Purelib"),
    ({"requires": ["jax>=0.10.2", "numpy>=1.26", 'jax[cuda13]>=0.10.2; extra == "cuda"']},
     "Requires-Dist lacks jaxlib"),
    ({"requires": ["jax>=0.10.2", "jaxlib>=0.10.2", "numpy>=1.26",
                   'jax[cuda12]>=0.10.2; extra == "cuda"']},
     'Requires-Dist lacks jax[cuda13]; extra == "cuda"'),
])
def test_the_checker_names_what_is_wrong(tmp_path, change, problem):
    found = check_gpu_wheel.problems(make_wheel(tmp_path, **change))
    assert len(found) == 1 and problem in found[0], found


def test_the_checker_wants_the_cuda_extra_to_bring_cublaslt_and_the_runtime(tmp_path):
    resolution = {"install": [{"metadata": {"name": "nvidia-cublas", "version": "12.9.1.4"}}]}
    found = check_gpu_wheel.problems(make_wheel(tmp_path), resolution)
    assert found == ["installing the wheel with [cuda] brings no nvidia-cublas 13 (got 12.9.1.4)",
                     "installing the wheel with [cuda] brings no nvidia-cuda-runtime 13 "
                     "(got None)"]


def test_the_script_leaves_out_what_the_handler_links_and_the_package_loads():
    excluded = set(re.search(r"^EXCLUDE=\((.*)\)$", BUILD_SCRIPT, re.M).group(1).split())
    assert set(library._PRELOAD) <= excluded  # loaded from NVIDIA's wheels
    linked = re.findall(r"lib/(lib\S+\.so\.\d+)", (ROOT / "ffi" / "CMakeLists.txt").read_text())
    assert linked and set(linked) <= excluded
    assert '--config-settings=wheel.py-api=py3' in BUILD_SCRIPT  # tag py3-none
    assert "check_gpu_wheel.py" in BUILD_SCRIPT


def test_the_scripts_parse_and_the_round_has_a_wheel_stage():
    for script in ("build_gpu_wheel.sh", "gpu_round.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True, timeout=30)
    assert re.search(r"^#   stages: .*\bwheel\b", ROUND_SCRIPT, re.M)
    stage = ROUND_SCRIPT[ROUND_SCRIPT.index("    wheel)\n"):ROUND_SCRIPT.index("    export)\n")]
    # pip runs with PATH an empty folder (so no compiler), no index, no dependencies
    assert 'PATH="$nocc" CC=/nonexistent CXX=/nonexistent "$py" -m pip install' in stage
    assert "--no-index --no-deps" in stage and ".wheelhouse/" in stage


def test_no_compiler_is_reachable_on_the_stages_path(tmp_path):
    """The stage's test: `command -v` under PATH=an empty folder finds none."""
    found = subprocess.run(
        ["bash", "-c", 'nocc="$1"; for cc in c++ g++ gcc cc clang clang++; do '
                       'PATH="$nocc" command -v "$cc"; done; exit 0', "-", str(tmp_path)],
        capture_output=True, text=True, timeout=30)
    assert found.stdout == ""


@pytest.mark.parametrize("folder", [".wheelhouse", "dist"])
def test_a_built_wheel_here_passes_the_checks(folder):
    wheels = sorted((ROOT / folder).glob("jax_epilog-*manylinux*.whl"))
    if not wheels:
        pytest.skip(f"no GPU wheel in {folder}/ (scripts/build_gpu_wheel.sh builds one)")
    for wheel in wheels:
        assert check_gpu_wheel.problems(wheel) == [], wheel
