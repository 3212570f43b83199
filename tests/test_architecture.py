"""The package's structure as docs/architecture.md states it: every `jax_epilog.` name the page
gives exists, the bf16 call path is as short as it says, modules stay small, and no module
imports another that (directly or not) imports it back."""

from __future__ import annotations

import ast
import sys
import importlib
import re
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_epilog"
PAGE = (ROOT / "docs" / "architecture.md").read_text()
NAME = re.compile(r"`(jax_epilog(?:\.\w+)+)`")


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def section(title: str) -> str:
    start = PAGE.index(f"## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end > 0 else None]


def numbered_items(text: str) -> list[str]:
    """The first `jax_epilog.` name of each numbered item of the first numbered list."""
    items = re.findall(r"^\d+\. `(jax_epilog[\w.]+)`", text, flags=re.M)
    return items


@pytest.mark.parametrize("name", sorted(set(NAME.findall(PAGE))))
def test_every_name_on_the_page_exists(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("title", ["The path of a bf16 epilog call",
                                   "The path of an FP8 layer training step",
                                   "The path of a block-scaled FP8 layer training step",
                                   "The path of a `tune` run"])
def test_each_path_is_a_numbered_list_of_functions(title):
    items = numbered_items(section(title))
    assert len(items) >= 5 and all(callable(resolve(name)) for name in items)


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def test_every_subpackage_says_what_it_owns():
    for sub in (p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"{sub.name}/__init__.py: say what it owns and imports"
        assert f"`{sub.name}/`" in PAGE, f"docs/architecture.md does not name {sub.name}/"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_is_over_450_lines(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= 450, f"{module}: {lines} lines"


def _imports(module: str, path: Path, modules) -> set[str]:
    """The package's modules `module` imports, at any depth of its code."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                                ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name != "jax_epilog":
                found.add(name)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m, trail):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(n):] + [n])
                                     if n in trail else f"{m} -> {n}")
            if n not in state:
                visit(n, trail + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_each_primitives_rules_are_in_one_module():
    """Every rule of the outer primitive is registered in `op/primitive.py` and every rule of
    the inner one in `op/lowering.py` (abstract eval, lowerings, batching, differentiation),
    as TransformerEngine's `BasePrimitive` and JAX's cuDNN attention keep theirs."""
    rule = re.compile(r"(?:register_lowering\(|primitive_batchers\[|primitive_jvps\[|"
                      r"primitive_transposes\[)\s*(epilog_matmul_p|kernel_p)\b|"
                      r"\b(epilog_matmul_p|kernel_p)\.(?:def_abstract_eval|def_impl|"
                      r"multiple_results\s*=)")
    homes = {"epilog_matmul_p": "jax_epilog/op/primitive.py",
             "kernel_p": "jax_epilog/op/lowering.py"}
    found = {name: set() for name in homes}
    for path in PACKAGE.rglob("*.py"):
        for match in rule.finditer(path.read_text()):
            found[match.group(1) or match.group(2)].add(path.relative_to(ROOT).as_posix())
    assert found == {name: {home} for name, home in homes.items()}, found


LAYERS = ("runtime", "op", "float8", "planning", "layers", "tools")


def _subpackage_imports() -> dict[str, set[str]]:
    """Which subpackages each subpackage's modules import (its `__init__` aside, which only
    says what it owns)."""
    modules = _modules()
    graph: dict[str, set[str]] = {sub: set() for sub in LAYERS}
    for module, path in modules.items():
        parts = module.split(".")
        if len(parts) < 3:
            continue  # the public surface may import anything
        for imported in _imports(module, path, modules):
            target = imported.split(".")
            if len(target) >= 2 and target[1] in LAYERS and target[1] != parts[1]:
                graph[parts[1]].add(target[1])
    return graph


def test_no_cycle_between_subpackages():
    """The op asks a planner that planning registers (`op.planner`), so no subpackage imports
    one that imports it back, with no exception."""
    graph = _subpackage_imports()
    while graph:  # peel off the subpackages that import none of those left
        leaves = {sub for sub, imported in graph.items() if not imported & graph.keys()}
        assert leaves, f"import cycle among the subpackages {sorted(graph)}"
        graph = {sub: imported for sub, imported in graph.items() if sub not in leaves}


def test_each_subpackage_imports_only_those_above_it():
    for sub, imported in _subpackage_imports().items():
        below = [other for other in imported if LAYERS.index(other) > LAYERS.index(sub)]
        assert not below, f"{sub} imports {below}, below it in {LAYERS}"


# --- the paths of the page, traced --------------------------------------------------------------

def _traced(run) -> tuple[dict[str, str], int]:
    """The package's functions `run()` calls (`module.qualname`: its file, in the order first
    met; jax's own left out) and how many times it binds the primitive `epilog_matmul_p`."""
    import jax_epilog
    from jax_epilog.op.call import epilog_matmul_p
    # The package imported (installed, or this checkout), not necessarily PACKAGE's folder.
    package = str(Path(jax_epilog.__file__).resolve().parent) + "/"
    met: dict[str, str] = {}
    binds = 0

    def profile(frame, event, arg):
        nonlocal binds
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(package):
            met.setdefault(f"{frame.f_globals['__name__']}.{code.co_qualname}",
                           code.co_filename[len(package):])
        elif code.co_name == "bind" and frame.f_locals.get("self") is epilog_matmul_p:
            binds += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return met, binds


@pytest.fixture
def gpu_plan(monkeypatch):
    """Plans as on a CUDA GPU with the library, whose tables send every GEMM to cuBLASLt (no
    stack or serving entry: the rules decide); cuBLASLt has a kernel for every problem asked."""
    from jax_epilog.op import lowering
    from jax_epilog.planning import context, table_format
    monkeypatch.setattr(lowering.cuda_library, "query_support", lambda *a, **k: (True, ""))
    monkeypatch.setattr(lowering.cuda_library, "supports_fp8", lambda: True, raising=False)
    ctx = context.default_context()._replace(
        override=lambda: None, tables_decide=lambda: True, cuda_devices=lambda: True,
        library=lambda: True,
        gemm_table=lambda *problem: table_format.Decision("cublaslt", "test"),
        stack_table=lambda key: None, fp8_table=lambda key: None,
        serving_table=lambda rows: None)
    with context.planning(ctx):
        yield


def _lowered_for_cuda(fn, *args, before=None):
    """`run` for `_traced`: `fn` traced and lowered for CUDA (not compiled), its text; where
    given, `before(*args)` makes the arguments first."""
    def run():
        jax.clear_caches()
        traced = jax.jit(fn).trace(*(before(*args) if before else args))
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    return run


def _path_case(case: str):
    import jax.numpy as jnp

    import jax_epilog
    if case == "bf16":
        x, w, b = (jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                   for shape in ((256, 1024), (1024, 4096), (4096,)))
        return _lowered_for_cuda(lambda x, w, b: jax_epilog.matmul(
            x, w, epilog="relu_bias", epilog_inputs={"bias": b}), x, w, b)
    if case == "fp8":  # a GEMM large enough for `fp8=True` to run it in FP8
        x, w, b = (jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                   for shape in ((8192, 4096), (4096, 4096), (4096,)))

        def loss(x, w, b):
            return jax_epilog.dense(x, w, b, activation="relu", fp8=True).astype(
                jnp.float32).sum()
        return _lowered_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, w, b)
    keys = jax.random.split(jax.random.key(0), 2)  # above 64 rows: the FP8 GEMM
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    params = {"kernel": jax.random.normal(keys[0], (512, 512), jnp.bfloat16),  # stored in FP8
              "bias": jax.random.normal(keys[1], (512,), jnp.bfloat16)}
    return _lowered_for_cuda(
        lambda x, p: jax_epilog.dense(x, p["kernel"], p["bias"], activation="relu"), x, params,
        before=lambda x, p: (x, jax_epilog.quantize_params(p)))


PATHS = {  # the page's section, its GEMMs, and how far the trace may go (functions, files)
    "bf16": ("The path of a bf16 epilog call", 1),
    "fp8": ("The path of an FP8 layer training step", 3),
    "served": ("The path of a served layer (weights stored in FP8)", 1),
}


# Expressions, not steps a reader follows: generator expressions, and the comprehensions that
# Python 3.11 runs as functions of their own (3.12 inlines them, PEP 709).
EXPRESSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def _functions(met: dict[str, str]) -> dict[str, str]:
    """The functions of a trace, its generator expressions and comprehensions left out."""
    return {name: file for name, file in met.items() if not name.endswith(EXPRESSIONS)}


@pytest.mark.parametrize("case", sorted(PATHS))
def test_each_path_on_the_page_is_the_path_the_code_takes(case, gpu_plan):
    """Traced with `sys.setprofile` from the public call to the FFI call's construction (the
    program traced and lowered for CUDA on a GPU plan): the page's numbered list names
    functions met in its order, the call binds the primitive once per GEMM, and the whole path
    stays within the bound the page states (so it cannot creep)."""
    title, gemms = PATHS[case]
    text = section(title)
    run = _path_case(case)
    assert "custom_call" in run()  # the FFI call was built: a GPU plan, cuBLASLt's kernel
    met, binds = _traced(run)
    functions = _functions(met)
    listed = numbered_items(text)
    missing = [name for name in listed if name not in functions]
    assert not missing, f"docs/architecture.md, {title!r}: not on the path: {missing}"
    order = [list(functions).index(name) for name in listed]
    assert order == sorted(order), f"{title!r}: the list is not in the order met: {listed}"
    assert binds == gemms, f"{case}: {binds} binds of epilog_matmul_p for {gemms} GEMMs"
    bound = re.search(r"at most (\d+)\s+functions\s+in\s+(\d+)\s+files", text)
    assert bound, f"{title!r}: state the path's length ('at most N functions in M files')"
    most_functions, most_files = int(bound.group(1)), int(bound.group(2))
    files = set(functions.values())
    assert len(functions) <= most_functions and len(files) <= most_files, (
        f"{case}: {len(functions)} functions in {len(files)} files, over the page's bound "
        f"({most_functions} in {most_files}): shorten the path, or say why it grew")
