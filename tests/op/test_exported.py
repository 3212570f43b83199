"""Modules exported with `jax.export` by earlier versions keep running (docs/exporting.md).

`tests/exported/<commit>/<platform>/` holds what `tests/exported/make_modules.py` exported at
that commit: a `matmul` of each fused-epilog family, one with a C matrix, the gradient of an
`mlp` and an FP8 `dense` training step, with their inputs and the reference's outputs. Each
folder runs in a fresh process that only imports jax and jax_epilog, as a serving process
would; the custom calls they name are checked against this version's targets on any machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jax_epilog.runtime import targets

HERE = Path(__file__).resolve().parents[1] / "exported"
# JAX_EPILOG_EXPORTED: more folders laid out like tests/exported (<commit>/<platform>/), e.g.
# modules just exported on a GPU machine (scripts/gpu_round.sh's export stage), tested alike.
ROOTS = [HERE, *(Path(p) for p in os.environ.get("JAX_EPILOG_EXPORTED", "").split(os.pathsep)
                 if p)]
FOLDERS = sorted(p.parent for root in ROOTS for p in root.glob("*/*/manifest.json"))
CALL = re.compile(r"stablehlo\.custom_call @(\w+)\([^)]*\)\s*\{(.*?)\}\s*:", re.S)
# Any call of ours, however it is printed: CALL must have parsed each one.
OURS = re.compile(r"custom_call @(jax_epilog\w*)")
ATTRIBUTE = re.compile(r"(\w+) = (true|false|-?\d+)(?: : (\w+))?")
MLIR_TYPES = {bool: "i1", int: "i32"}  # an attribute's type as the module spells it
TOLERANCE = {"cpu": 1e-5, "cuda": 0.05}  # relative to the largest value; masks: bits
# A 16-bit output is a float32 result rounded once: another CPU (its vector width, its fused
# multiply-adds) can move that float32 value by an ulp and so the 16-bit one by a step, which
# is 2**-8 of the value in bfloat16 (seen: 0.1025 against 0.1021 on a 5.25-wide output, on
# 0.03% of the values). A wrong module is off by far more.
SIXTEEN_BIT_STEP = 2.0**-8


def _tolerance(platform: str, dtype: str) -> float:
    sixteen_bit = dtype in ("bfloat16", "float16")
    return max(TOLERANCE[platform], SIXTEEN_BIT_STEP) if sixteen_bit else TOLERANCE[platform]


def _version(text: str) -> tuple:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def _skip_if_newer_than_this_jax(folder: Path) -> None:
    """JAX reads modules serialized by its own and earlier versions, not later ones (a newer
    StableHLO): a folder exported with a newer jax than this one is not this version's to run."""
    made_with = json.loads((folder / "manifest.json").read_text())["jax"]
    if _version(made_with) > _version(jax.__version__):
        pytest.skip(f"exported with jax {made_with}, newer than this jax {jax.__version__}")


def _id(folder: Path) -> str:
    return f"{folder.parent.name}-{folder.name}"


def test_there_are_modules_of_97e9b38_and_a_later_commit_for_both_platforms():
    found = {(f.parent.name, f.name) for f in FOLDERS}
    commits = {c for c, _ in found}
    assert "97e9b38" in commits and len(commits) >= 2, found
    assert ("97e9b38", "cpu") in found


def test_the_python_targets_are_the_ones_the_handler_decodes():
    """`runtime.targets` and the C++ binding (`.Attr<T>(name)`) name the same attributes."""
    source = (HERE.parents[1] / "ffi" / "epilog_matmul.cc").read_text()
    types = {"int32_t": "i32", "bool": "i1"}

    def decoded(text):
        return [(types[t], n) for t, n in re.findall(r'\.template Attr<(\w+)>\("(\w+)"\)', text)]

    # Binding() decodes every target's attributes; BlockBinding() adds the block target's.
    base = decoded(source.split("auto BlockBinding()")[0])
    block = decoded(source)[len(base):]
    for target in targets.TARGETS:
        want = base + (block if target is targets.MATMUL_BLOCK else [])
        assert want == [("i32" if kind is not bool else "i1", name)
                        for name, kind in target.attributes], target.name


def test_registration_registers_each_target_of_the_table_from_symbols_the_library_exports(
        monkeypatch):
    """`targets.register` registers exactly the table's targets for CUDA, each with its two
    stages, from handler symbols that `ffi/epilog_matmul.cc` defines and `ffi/exports.map`
    exports (the library itself is only built on GPU machines)."""
    registered, asked = {}, []

    class Handle:  # stands in for the loaded library: records the symbols looked up
        def __getattr__(self, symbol):
            asked.append(symbol)
            return symbol

    monkeypatch.setattr(jax.ffi, "pycapsule", lambda pointer: ("capsule", pointer))
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, stages, platform: registered.setdefault(
                            (name, platform), stages))
    targets.register(Handle())
    assert registered == {
        (t.name, "CUDA"): {"execute": ("capsule", t.symbol),
                           "initialize": ("capsule", t.symbol + "Initialize")}
        for t in targets.TARGETS}
    source = (HERE.parents[1] / "ffi" / "epilog_matmul.cc").read_text()
    defined = set(re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", source))
    exported = set(re.findall(r"^\s*(\w+);", (HERE.parents[1] / "ffi" / "exports.map")
                              .read_text(), re.M))
    assert set(asked) <= defined & exported, (set(asked) - defined, set(asked) - exported)


def test_import_and_registration_start_no_jax_backend():
    """A registration for CUDA made before JAX's backends start is queued until the CUDA
    plugin starts (jaxlib/xla_client.py, register_custom_call_target): so the import, which
    registers where a driver is, does not start a backend (its cost stays the library's
    load). Checked in a fresh process, after the import and after registering again with
    stand-in pointers (here nothing may be loaded at import: no driver or no library)."""
    done = subprocess.run([sys.executable, "-c", (
        "import ctypes, jax, jax_epilog\n"
        "from jax._src import xla_bridge\n"
        "from jax_epilog.runtime import targets\n"
        "assert not xla_bridge.backends_are_initialized(), 'the import started a backend'\n"
        "libc = ctypes.CDLL(None)\n"
        "class Handle:\n"
        "    def __getattr__(self, symbol):\n"
        "        return libc.abs  # a real pointer, never called: no CUDA backend starts\n"
        "targets.register(Handle())\n"
        "assert not xla_bridge.backends_are_initialized(), 'registering started a backend'\n"
        "print('ok')\n")],
        capture_output=True, text=True, timeout=300, cwd="/",
        env={**os.environ, "JAX_PLATFORMS": "cpu"})  # a GPU's CUDA never sees the stand-ins
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr[-2000:]


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_every_custom_call_is_a_target_of_this_version_with_its_attributes(folder):
    _skip_if_newer_than_this_jax(folder)
    by_name = {t.name: t for t in targets.TARGETS}
    manifest = json.loads((folder / "manifest.json").read_text())
    for name, case in manifest["cases"].items():
        module = jax.export.deserialize((folder / f"{name}.bin").read_bytes()).mlir_module()
        calls = [(t, c) for t, c in CALL.findall(module) if t.startswith("jax_epilog")]
        # The calls parsed with their attributes are all of ours in the module, and the ones
        # make_modules found when it exported it (so a change in how MLIR is printed fails
        # here instead of leaving nothing to check).
        assert sorted(t for t, _ in calls) == sorted(OURS.findall(module)), name
        assert sorted({t for t, _ in calls}) == sorted(
            t for t in case["custom_calls"] if t.startswith("jax_epilog")), name
        if folder.name == "cuda":  # every CUDA case was exported to reach the kernel
            assert calls, f"{name}: no jax_epilog custom call in a CUDA module"
        for target, config in calls:
            assert target in by_name, f"{name}: {target} is not registered by this version"
            got = {key: (value, kind) for key, value, kind in ATTRIBUTE.findall(config)
                   if key not in ("operand_layouts", "result_layouts")}
            want = {n: ("i1" if k is bool else "i32") for n, k in by_name[target].attributes}
            assert set(got) == set(want), f"{name}: {target} passes {sorted(got)}"
            for key, (value, kind) in got.items():
                assert (kind or "i1") == want[key], f"{name}: {target}.{key} is {kind}"


def _run_fresh(folder: Path) -> list[dict]:
    env = dict(os.environ)  # the jax_epilog this suite tests, installed or on PYTHONPATH
    if folder.name == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, str(HERE / "run_modules.py"), str(folder)],
                          capture_output=True, text=True, timeout=600, env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _check(folder: Path):
    _skip_if_newer_than_this_jax(folder)
    results = _run_fresh(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [r["name"] for r in results] == list(manifest["cases"])
    bad = [r for r in results if "exception" in r or
           r["outputs"] != manifest["cases"][r["name"]]["outputs"] or
           any(e > _tolerance(folder.name, d) for e, d in zip(r["errors"], r["dtypes"]))]
    assert not bad, bad


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f.name == "cpu"], ids=_id)
def test_cpu_modules_run_in_a_fresh_process(folder):
    _check(folder)


@pytest.mark.gpu
@pytest.mark.parametrize("folder", sorted({f.parent / "cuda" for f in FOLDERS}), ids=_id)
def test_cuda_modules_run_in_a_fresh_process(folder):
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a CUDA device")
    if not (folder / "manifest.json").exists():  # CUDA modules are made on a GPU machine
        pytest.skip(f"{folder} not generated yet (scripts/gpu_round.sh export makes it)")
    _check(folder)


def _loaded_at_import() -> bool:
    done = subprocess.run([sys.executable, "-c", (
        "import jax, jax_epilog\n"
        "from jax_epilog.runtime import library\n"
        "print(library.library.cache_info().currsize)")],
        capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] == "1"


def test_import_loads_the_library_only_where_a_driver_is():
    from jax_epilog.runtime import library
    driver = any(os.path.exists(p) for p in library.DRIVER_FILES)
    built = (library.PACKAGE_DIR / "libjax_epilog_ffi.so").exists()
    assert _loaded_at_import() == (driver and built)


@pytest.mark.gpu
def test_import_registers_the_targets_on_a_gpu_machine():
    """Where JAX sees a CUDA device (and so a driver), the import alone loads the library."""
    assert _loaded_at_import()
