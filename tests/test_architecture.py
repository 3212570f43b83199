"""The package's structure as docs/architecture.md states it: every `jax_epilog.` name the page
gives exists, the bf16 call path is as short as it says, modules stay small, and no module
imports another that (directly or not) imports it back."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

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


def test_the_bf16_call_path_is_short():
    text = section("The path of a bf16 epilog call")
    to_bind = text[:text.index("When the program is compiled")]
    functions = numbered_items(to_bind)
    files = {name.rsplit(".", 1)[0] for name in functions}
    assert 1 < len(functions) <= 12 and len(files) <= 6, (functions, files)
    assert functions[0] == "jax_epilog.op.matmul.matmul"
    said = re.search(r"(\w+) functions in (\w+) files", text)
    words = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
             "ten": 10, "eleven": 11, "twelve": 12}
    assert (words[said.group(1).lower()], words[said.group(2).lower()]) == \
        (len(functions), len(files))


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


LAYERS = ("runtime", "op", "planning", "float8", "layers", "tools")
# The one exception the page states: the op's lowering and public call consult the plan, and
# the planners read only these facts of the op.
OP_CONSULTS_PLANNING = {"jax_epilog.op.lowering", "jax_epilog.op.matmul"}
PLANNING_READS_OP = {"jax_epilog.op.epilogs", "jax_epilog.op.call", "jax_epilog.op.padding",
                     "jax_epilog.op.block_scales"}


def test_each_subpackage_imports_only_those_above_it():
    modules = _modules()
    for module, path in modules.items():
        parts = module.split(".")
        if len(parts) < 3:
            continue  # the public surface may import anything
        own = LAYERS.index(parts[1])
        for imported in _imports(module, path, modules):
            target = imported.split(".")
            if len(target) < 3 or target[1] not in LAYERS:  # (a subpackage itself: its docstring)
                continue
            if LAYERS.index(target[1]) <= own:
                assert not (parts[1] == "planning" and target[1] == "op") or \
                    imported in PLANNING_READS_OP, f"{module} imports {imported}"
                continue
            assert module in OP_CONSULTS_PLANNING and target[1] == "planning", \
                f"{module} imports {imported}, a layer below it"
