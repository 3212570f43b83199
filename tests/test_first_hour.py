"""What a new user meets in the first hour (issue 14): set-up that talks and does not rebuild
for nothing, `--help` and install hints that work from a checkout, errors that say what to do,
examples in the README that run, notebooks that say what the kernel does.

All CPU and fast: the set-up scripts run against a stand-in venv whose `python` logs what pip
would have done.
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHECKOUT_HINT = 'pip install ".[{}]"'

nbformat = pytest.importorskip("nbformat")
flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_epilog.linen as fused_linen  # noqa: E402
import jax_epilog.nnx as fused_nnx  # noqa: E402


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "tests")


# --- set-up: the install stamp of scripts/env.sh ---------------------------------------------

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for a venv's python: pip installs are logged, `pip freeze` prints freeze.txt.
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  case "$3" in
    install) echo "install ${*:4}" >> "$here/calls.log"; exit "${FAKE_PIP_STATUS:-0}" ;;
    freeze) cat "$here/freeze.txt" ;;
  esac
  exit 0
fi
exec %s "$@"
"""


class SetUp:
    """A copy of what env.sh hashes, and a stand-in venv, to call `install_project` on."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "checkout"
        (self.root / "scripts").mkdir(parents=True)
        shutil.copy(ROOT / "scripts" / "env.sh", self.root / "scripts" / "env.sh")
        for name in ("pyproject.toml", "README.md", "ffi/epilog_matmul.cc",
                     "jax_epilog/__init__.py"):
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            (self.root / name).write_text(f"contents of {name}\n")
        self.venv = tmp_path / "venv"
        (self.venv / "bin").mkdir(parents=True)
        python = self.venv / "bin" / "python"
        python.write_text(FAKE_PYTHON % sys.executable)
        python.chmod(0o755)
        (self.venv / "freeze.txt").write_text("jax==0.12\nflax==0.12\n")

    def install(self, extra: str = "test", **env) -> tuple[list[str], str]:
        """(the pip installs it ran, what it said)."""
        log = self.venv / "calls.log"
        before = log.read_text().splitlines() if log.exists() else []
        done = subprocess.run(
            ["bash", "-c", f'source "{self.root}/scripts/env.sh" && install_project {extra}'],
            capture_output=True, text=True, timeout=60,
            env={**{k: v for k, v in os.environ.items() if k != "JAX_EPILOG_BUILD_CUDA"},
                 "JAX_EPILOG_VENV": str(self.venv), "JAX_EPILOG_REINSTALL": "0", **env})
        after = log.read_text().splitlines() if log.exists() else []
        if done.returncode:
            raise RuntimeError(done.stderr)
        return after[len(before):], done.stderr


@pytest.fixture
def setup(tmp_path):
    return SetUp(tmp_path)


def test_install_says_what_it_does_and_runs_once(setup):
    installs, said = setup.install()
    assert installs == [f"install -q {setup.root}[test]"]
    assert "building the C++ handler" in said and "minutes" in said
    assert "NVIDIA driver" in said
    installs, said = setup.install()
    assert installs == [] and "skipping the reinstall" in said


@pytest.mark.parametrize("change", [
    "ffi/epilog_matmul.cc", "jax_epilog/__init__.py", "jax_epilog/new_module.py",
    "pyproject.toml", "README.md"])
def test_changed_sources_reinstall(setup, change):
    setup.install()
    (setup.root / change).write_text("changed\n")
    assert setup.install()[0] == [f"install -q {setup.root}[test]"]
    assert setup.install()[0] == []


def test_changed_dependencies_or_settings_reinstall(setup):
    setup.install()
    (setup.venv / "freeze.txt").write_text("jax==0.12\n")  # flax uninstalled by hand
    assert setup.install()[0] == [f"install -q {setup.root}[test]"]
    assert setup.install(CC="clang")[0] == [f"install -q {setup.root}[test]"]
    assert setup.install(CC="clang")[0] == []
    assert setup.install(CC="clang", JAX_EPILOG_REINSTALL="1")[0] != []
    # Whether the handler is built is a build setting too.
    assert setup.install(CC="clang", JAX_EPILOG_BUILD_CUDA="1")[0] != []


def test_another_extra_adds_its_dependencies_without_a_rebuild(setup):
    setup.install("test")
    assert setup.install("demo")[0] == ["install -q jax-epilog[demo]"]
    assert setup.install("demo")[0] == [] and setup.install("test")[0] == []


def test_a_failed_install_is_retried(setup):
    setup.install()
    (setup.root / "README.md").write_text("changed\n")
    with pytest.raises(RuntimeError):
        setup.install(FAKE_PIP_STATUS="1")
    assert setup.install()[0] == [f"install -q {setup.root}[test]"]


PICK = """#!/usr/bin/env bash
# %s: a stand-in; python3.12 works only with a pyenv version chosen, as pyenv's shim does.
if [ "$(basename "$0")" = pyenv ]; then printf '3.11.7\\n3.12.1\\n3.12.10\\n3.13.0\\n'; exit 0; fi
if [ "$(basename "$0")" = python3.12 ]; then
  [ -n "${PYENV_VERSION:-}" ] || exit 127
  echo "$PYENV_VERSION" > "$(dirname "$0")/chosen"
fi
exec %s "$@"
"""


@pytest.mark.parametrize("env,chosen", [({}, "3.12.10"), ({"PYTHON": "python3"}, None)])
def test_env_sh_finds_python_on_path_or_through_pyenv(setup, tmp_path, env, chosen):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3.12", "python3", "pyenv"):
        (bin_dir / name).write_text(PICK % (name, sys.executable))
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(
        ["bash", "-c", f'source "{setup.root}/scripts/env.sh" && pick_python'],
        capture_output=True, text=True, timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "JAX_EPILOG_VENV": str(setup.venv), **env})
    assert done.returncode == 0, done.stderr
    # The interpreter itself, not a shim (resolved: pytest may run from a relative path)
    assert Path(done.stdout.strip()).resolve() == Path(sys.executable).resolve()
    assert ((bin_dir / "chosen").read_text().strip() if chosen else None) == chosen


def test_env_sh_says_when_python_is_not_one(setup):
    done = subprocess.run(
        ["bash", "-c", f'source "{setup.root}/scripts/env.sh" && pick_python'],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHON": "no-such-python", "JAX_EPILOG_VENV": str(setup.venv)})
    assert done.returncode != 0
    assert "PYTHON=no-such-python is not a Python >= 3.11" in done.stderr
    assert "/root/.pyenv" not in (ROOT / "scripts" / "env.sh").read_text()


def test_scripts_install_through_the_stamp():
    for script, extra in (("test.sh", "test"), ("demo.sh", "demo")):
        assert f"install_project {extra}" in (ROOT / "scripts" / script).read_text()


# --- python -m jax_epilog, install hints, extras, metadata ------------------------------------

WITHOUT_FLAX = """
    import runpy, sys
    sys.modules["flax"] = None  # as if the demo extra were not installed
    sys.argv = ["python -m jax_epilog", *sys.argv[1:]]
    runpy.run_module("jax_epilog", run_name="__main__")
"""


def test_help_works_without_the_demo_extra():
    done = run_python(WITHOUT_FLAX, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m jax_epilog" in done.stdout and "--compare-batch" in done.stdout
    assert "pip install" not in done.stdout + done.stderr


def test_demo_without_its_extra_says_what_to_install():
    done = run_python(WITHOUT_FLAX, "--epochs", "1")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert CHECKOUT_HINT.format("demo") in done.stderr
    assert '"jax-epilog[demo]"' in done.stderr


def test_flax_modules_without_flax_say_what_to_install():
    done = run_python("""
        import sys; sys.modules["flax"] = None
        import jax_epilog
        try:
            jax_epilog.nnx
        except ImportError as e:
            print(e)
    """)
    assert CHECKOUT_HINT.format("flax") in done.stdout, done.stderr


def test_no_hint_says_an_unquoted_package_install():
    """`pip install jax-epilog[demo]` fails from a checkout (and unquoted in zsh)."""
    places = [ROOT / "README.md", *(ROOT / "jax_epilog").rglob("*.py"),
              *(ROOT / "scripts").glob("*.sh"), *(ROOT / "notebooks").glob("*.ipynb")]
    for path in places:
        assert not re.search(r"pip install jax-epilog\[", path.read_text()), path


def extra_closure(extra: str) -> set[str]:
    """The requirement names an extra brings, its jax-epilog[...] references followed."""
    names = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]
        if name == "jax-epilog":
            inner = re.search(r"\[(.*)\]", requirement).group(1)
            for other in inner.split(","):
                names |= extra_closure(other.strip())
        else:
            names.add(name)
    return names


def notebook_imports() -> set[str]:
    modules = set()
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                modules |= set(re.findall(r"^(?:import|from) (\w+)", cell.source, re.M))
    examples = {p.name for p in (ROOT / "examples").iterdir() if p.is_dir()}  # on sys.path
    return modules - set(sys.stdlib_module_names) - examples


def test_extras_for_notebooks_nvmath_and_export():
    core = {re.split(r"[<>=]", r)[0] for r in PYPROJECT["project"]["dependencies"]}
    notebooks = extra_closure("notebooks")
    distribution = {"sklearn": "scikit-learn", "jax_epilog": "jax-epilog"}
    for module in notebook_imports():
        name = distribution.get(module, module)
        assert name in core | notebooks | {"jax-epilog"}, module
    assert "ipykernel" in notebooks  # a kernel to run them
    assert "nvmath-python" in extra_closure("nvmath")
    assert "flatbuffers" in extra_closure("export")
    assert extra_closure("notebooks") | extra_closure("export") <= extra_closure("test")


def test_project_metadata_for_pip_show():
    project = PYPROJECT["project"]
    assert project["authors"] == [{"name": "jax-epilog developers"}]
    assert project["license"] and project["description"] and project["classifiers"]


# --- errors and checks ----------------------------------------------------------------------

def test_mask_helpers_are_public_and_match_the_kernel():
    assert {"pack_relu_mask", "unpack_relu_mask"} <= set(jax_epilog.__all__)
    # K = 1 and a = 1: z = b exactly, special values included.
    b = jnp.asarray(np.random.default_rng(0).standard_normal((1, 130)), jnp.float32)
    b = b.at[0, :4].set(jnp.asarray([0.0, -0.0, jnp.nan, -1.0]))
    _, aux = jax_epilog.matmul(jnp.ones((5, 1)), b, epilog=Epilog.RELU_AUX)
    not_negative = jnp.broadcast_to(~(b < 0), (5, 130))  # the kernel's bit: +0, -0, NaN set
    assert bool(not_negative[0, 2])
    np.testing.assert_array_equal(jax_epilog.unpack_relu_mask(aux["relu_aux"], 130),
                                  not_negative)
    packed = jax_epilog.pack_relu_mask(not_negative)
    assert packed.shape == aux["relu_aux"].shape and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(jax_epilog.unpack_relu_mask(packed, 130), not_negative)


@pytest.mark.parametrize("dtype,margin", [("float8_e4m3fn", 0), (jnp.float8_e5m2, 0),
                                          (jnp.float8_e4m3fn, 3)])
def test_quantize_follows_the_quantization_scales_convention(dtype, margin):
    x = jax.random.normal(jax.random.key(3), (33, 129), jnp.bfloat16) * 7
    x8, scale = jax_epilog.quantize(x, dtype, margin=margin)
    assert x8.dtype == jnp.dtype(dtype) and x8.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == ()
    largest = float(jnp.finfo(dtype).max) / 2 ** margin
    wide, back = np.asarray(x, np.float32), np.asarray(x8, np.float32) * float(scale)
    np.testing.assert_allclose(float(scale), np.abs(wide).max() / largest, rtol=1e-6)
    assert np.abs(np.asarray(x8, np.float32)).max() <= largest
    # x ≈ scale * x8 to the format's precision (3 mantissa bits for e4m3, 2 for e5m2).
    step = 2.0 ** -(3 if jnp.dtype(dtype) == jnp.float8_e4m3fn else 2)
    assert np.all(np.abs(back - wide) <= step * np.abs(wide) + float(scale) * 2 ** -9)
    # and it is what matmul's quantization_scales take: a ≈ sa * a8.
    w8, sw = jax_epilog.quantize(x.T[:, :31], jnp.float8_e4m3fn)  # no e5m2 x e5m2 GEMM
    y = jax_epilog.matmul(x8, w8, quantization_scales={"a": scale, "b": sw},
                          preferred_element_type=jnp.float32)
    np.testing.assert_allclose(y, back @ (np.asarray(w8, np.float32) * float(sw)), rtol=1e-4,
                               atol=1e-3 * float(np.abs(y).max()))


@pytest.mark.parametrize("call,error,message", [
    (lambda: jax_epilog.quantize(jnp.ones(3), jnp.bfloat16), ValueError,
     "dtype: expected an FP8 format, float8_e4m3fn or float8_e5m2"),
    (lambda: jax_epilog.quantize(jnp.ones(3), margin=-1), ValueError,
     "margin: expected a non-negative int"),
    (lambda: jax_epilog.quantize(jnp.arange(3)), TypeError,
     "x: expected a floating-point array, got int32"),
])
def test_quantize_bad_arguments(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_flax_submodules_load_lazily():
    done = run_python("""
        import sys
        import jax_epilog
        assert "flax" not in sys.modules and "nnx" in dir(jax_epilog)
        assert jax_epilog.nnx.MLP and jax_epilog.linen.Dense
        assert "flax" in sys.modules
        try:
            jax_epilog.no_such_thing
        except AttributeError as e:
            print(e)
    """)
    assert done.returncode == 0, done.stderr
    assert "has no attribute 'no_such_thing'" in done.stdout


RNGS = functools.partial(nnx.Rngs, 0)
BAD_ACTIVATIONS = [
    ("tanh", ValueError, "got 'tanh'"),
    (jnp.tanh, TypeError, "got jax.numpy.tanh"),
    (jax.nn.silu, TypeError, "got jax.nn.silu"),
    (functools.partial(jax.nn.gelu, approximate=False), ValueError, "exact GELU"),
]
CONSTRUCTORS = {
    "nnx.Dense": lambda act: fused_nnx.Dense(8, 4, activation=act, rngs=RNGS()),
    "nnx.MLP": lambda act: fused_nnx.MLP(8, [4, 2], activation=act, rngs=RNGS()),
    "nnx.MLP final": lambda act: fused_nnx.MLP(8, [4, 2], final_activation=act, rngs=RNGS()),
    "linen.Dense": lambda act: fused_linen.Dense(4, activation=act),
    "linen.MLP": lambda act: fused_linen.MLP([4, 2], activation=act),
    "linen.MLP final": lambda act: fused_linen.MLP([4, 2], final_activation=act),
}


@pytest.mark.parametrize("bad,error,message", BAD_ACTIVATIONS)
@pytest.mark.parametrize("module", CONSTRUCTORS)
def test_bad_activation_is_refused_on_construction(module, bad, error, message):
    with pytest.raises(error, match=re.escape(message)) as caught:
        CONSTRUCTORS[module](bad)
    assert "activation" in str(caught.value) and " at 0x" not in str(caught.value)


@pytest.mark.parametrize("function,name", [
    (jax.nn.relu, "relu"), (jax.nn.gelu, "gelu"),
    (functools.partial(jax.nn.gelu, approximate=True), "gelu")])
def test_jax_nn_functions_stand_for_their_names(function, name):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.float32)
    by_function = fused_nnx.MLP(8, [4, 2], activation=function, final_activation=function,
                                rngs=RNGS())
    by_name = fused_nnx.MLP(8, [4, 2], activation=name, final_activation=name, rngs=RNGS())
    assert by_function.activation == name
    np.testing.assert_array_equal(by_function(x), by_name(x))
    linen_model = fused_linen.MLP([4, 2], activation=function)
    params = linen_model.init(jax.random.key(0), x)
    np.testing.assert_array_equal(linen_model.apply(params, x),
                                  fused_linen.MLP([4, 2], activation=name).apply(params, x))


def test_functional_layers_take_the_functions_too():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3)), jnp.float32)
    kernel = jnp.ones((3, 4))
    for function, name in ((jax.nn.relu, "relu"), (jax.nn.gelu, "gelu")):
        np.testing.assert_array_equal(jax_epilog.dense(x, kernel, activation=function),
                                      jax_epilog.dense(x, kernel, activation=name))
        np.testing.assert_array_equal(
            jax_epilog.mlp(x, [(kernel, None)], final_activation=function),
            jax_epilog.mlp(x, [(kernel, None)], final_activation=name))
    with pytest.raises(TypeError, match=r"got jax.nn.silu"):
        jax_epilog.dense(x, kernel, activation=jax.nn.silu)


def test_mlp_features_must_be_a_sequence():
    for build in (lambda: fused_nnx.MLP(784, 10, rngs=RNGS()),
                  lambda: fused_linen.MLP(features=10)):
        with pytest.raises(TypeError, match=r"features: expected a sequence of layer sizes"):
            build()


def test_input_width_against_in_features():
    x = jnp.ones((2, 784))
    with pytest.raises(ValueError, match=re.escape(
            "x has 784 features; this Dense was built with in_features=700")):
        fused_nnx.Dense(700, 10, rngs=RNGS())(x)
    with pytest.raises(ValueError, match=re.escape(
            "x has 784 features; this MLP was built with in_features=700")):
        fused_nnx.MLP(700, [10], rngs=RNGS())(x)
    dense = fused_linen.Dense(10)
    params = dense.init(jax.random.key(0), jnp.ones((2, 700)))
    with pytest.raises(ValueError, match=re.escape(
            "x has 784 features; this Dense was initialised with in_features=700")):
        dense.apply(params, x)
    with pytest.raises(ValueError, match=re.escape("(x has 784 features)")):
        jax_epilog.mlp(x, [(jnp.ones((700, 10)), None)])


# --- docs and notebooks ---------------------------------------------------------------------

def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


README_BLOCKS = python_blocks(README)


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_code_block_runs_as_written(index):
    """Each README block on its own, in a fresh namespace: nothing it uses is left undefined."""
    code = README_BLOCKS[index]
    exec(compile(code, f"README.md, python block {index + 1}", "exec"), {})  # noqa: S102


def test_readme_blocks_cover_the_sections():
    assert len(README_BLOCKS) >= 7
    joined = "\n".join(README_BLOCKS)
    for needed in ("jax_epilog.dense(", "jax_epilog.mlp(", "jax_epilog.quantize(",
                   "quantization_scales=",
                   "fp8=True", "jax_epilog.nnx.MLP(", "jax_epilog.linen.MLP(", "deserialize("):
        assert needed in joined, needed


def test_readme_export_example():
    section = README.split("### Exporting", 1)[1].split("\n## ", 1)[0]
    (code,) = python_blocks(section)
    assert "serialize()" in code and "deserialize(" in code and '"cuda"' in code
    assert CHECKOUT_HINT.format("export") in section


def test_fp8_doc_delayed_scaling_loop_runs():
    section = (ROOT / "docs" / "fp8.md").read_text().split("### Delayed scaling", 1)[1]
    code = python_blocks(section)[0]
    namespace = {}
    exec(compile(code, "docs/fp8.md, delayed scaling", "exec"), namespace)  # noqa: S102
    # The loop ran its steps: every layer's histories recorded an amax.
    for history in namespace["state"]:
        assert float(history.input[0]) > 0 and float(history.gradient[0]) > 0


def test_fp8_doc_tables_are_whole():
    """A table interrupted by a blank line renders as two (the second without a header)."""
    text = (ROOT / "docs" / "fp8.md").read_text()
    assert not re.search(r"^\|.*\|\n\n\|", text, re.M)


def project_text_files():
    """The checkout's own text files (not venvs, build trees or git's folder)."""
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.is_file() and not any(p.startswith(".") and p != ".ci" or p == "build"
                                      for p in parts[:-1]) \
                and path.suffix in {".md", ".py", ".sh", ".toml", ".ipynb", ".cc", ".h", ""}:
            yield path


@pytest.mark.slow
def test_nothing_cites_files_outside_the_project():
    """A user's checkout has only the project: no file may cite the developers' folder beside
    it (the measuring method is in benchmarks/README.md)."""
    outside = r"\.\./" + "shared"  # split: this file names the patterns it looks for
    cited = [str(p.relative_to(ROOT)) for p in project_text_files()
             if p != Path(__file__).resolve() and re.search(outside + r"|shared/BENCHMARK|(?<![/\w])BENCHMARK\.md",
                          p.read_text(errors="replace"))]
    assert not cited
    method = (ROOT / "benchmarks" / "README.md").read_text().split("## Method", 1)[1]
    for needed in ("G1 | 65536 × 4096 × 4096", "G7 | 256 × 784 × 100", "M1 a 4-layer",
                   "Two harnesses", "*user*", "*careful*"):
        assert needed in method, needed


RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE_RESULTS = ROOT / "examples" / "gpt" / "results"


def test_results_are_the_current_ones_and_every_cited_one_exists():
    """benchmarks/results/ and examples/gpt/results/ keep the current runs, which the docs and
    the ledger (docs/ledger.md) cite (git keeps the history), and what they cite is there."""
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 40, "prune benchmarks/results/: " + ", ".join(
        sorted(str(p.relative_to(RESULTS)) for p in files))
    examples = [p for p in EXAMPLE_RESULTS.rglob("*") if p.is_file()]
    assert len(examples) <= 15, "prune examples/gpt/results/: " + ", ".join(
        sorted(str(p.relative_to(EXAMPLE_RESULTS)) for p in examples))
    missing = set()
    for page in project_text_files():
        if page.suffix not in (".md", ".ipynb") or RESULTS in page.parents \
                or EXAMPLE_RESULTS in page.parents:
            continue
        for line in page.read_text().splitlines():
            if "git history" in line:  # a citation of an older commit's file
                continue
            for folder, cited in re.findall(r"(benchmarks|examples/gpt)/results/([\w./-]*\w)",
                                            line):
                if not (ROOT / folder / "results" / cited).exists():
                    missing.add(f"{page.relative_to(ROOT)}: {folder}/results/{cited}")
    assert not missing


def test_run_all_runs_what_the_benchmarks_readme_says():
    script = (ROOT / "benchmarks" / "run_all.sh").read_text()
    ran = re.search(r"selected=\(([\w ]+)\); fi", script).group(1).split()
    running = (ROOT / "benchmarks" / "README.md").read_text().split("## Running", 1)[1]
    said = re.search(r"runs the (\w+) benchmarks[^(]*\(([^)]*)\)", running)
    assert re.split(r",\s+", said.group(2).replace("`", "")) == ran
    assert said.group(1) == {4: "four"}.get(len(ran), str(len(ran)))
    alone = re.search(r"run alone: (.*?) \(", running, re.S).group(1)
    benchmarks = {p.stem for p in (ROOT / "benchmarks").glob("*.py")
                  if "--out" in p.read_text()}
    named = {re.sub(r"_bench$", "", b) for b in benchmarks}
    assert named == set(ran) | {re.sub(r"_bench$", "", n) for n in
                                re.findall(r"`(\w+)\.py`", alone)}


def test_readme_documents_the_mask_interchange_with_nvmath():
    assert "jax_epilog.pack_relu_mask" in README and "nvmath-python" in README
    assert re.search(r"byte for\s+byte", README)


def cells(name):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4).cells


def test_notebook_1_says_what_the_mask_bit_is():
    text = "\n".join(cell.source for cell in cells("01_epilogs.ipynb"))
    for wrong in ("the mask `z > 0`", "equals z > 0", "z_naive > 0", "naive: z > 0"):
        assert wrong not in text
    assert "~(z < 0)" in text and "not negative" in text and "-0" in text and "NaN" in text


@pytest.mark.parametrize("name", ["01_epilogs.ipynb", "02_flax_mlp.ipynb",
                                  "03_performance.ipynb"])
def test_notebooks_show_no_warnings_or_local_paths(name):
    for cell in cells(name):
        for output in cell.get("outputs", []):
            assert not (output.output_type == "stream" and output.name == "stderr"), output
            text = json.dumps({k: v for k, v in output.get("data", {}).items()
                               if not k.startswith("image/")}) + output.get("text", "")
            assert not re.search(r"/(work|home|tmp|root|Users)/|site-packages|venv", text), text


def test_notebook_3_names_its_problems_runs_and_memory_figures():
    notebook = cells("03_performance.ipynb")
    text = "\n".join(cell.source for cell in notebook)
    for row, shape in [("G1", "65536 × 4096 × 4096"), ("G2", "8192 × 8192 × 8192"),
                       ("G3", "8192 × 1024 × 4096"), ("G4", "16384 × 4096 × 16384"),
                       ("G5", "16384 × 16384 × 4096"), ("G6", "4096 × 1024 × 1024"),
                       ("G7", "256 × 784 × 100")]:
        assert f"| {row} | {shape} |" in text
    assert "ReLU's output" in text and "workspace" in text
    outputs = "\n".join(output.get("text", "") for cell in notebook
                        for output in cell.get("outputs", []))
    for report in ("forward", "layers"):
        date = json.loads((ROOT / "benchmarks" / "results" / f"{report}.json").read_text())[
            "metadata"]["date"]
        assert date[:10] in outputs
    assert "layers.json: NVIDIA H200, run of" in outputs
    assert text.count('fig.suptitle(run_of(') == 3  # every figure names its run
