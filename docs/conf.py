"""Sphinx configuration of the jax-epilog documentation site.

Built by `scripts/docs.sh` from the checkout's root (`sphinx-build -c docs . build/docs`), so
the guides in docs/, the notebooks in notebooks/ and the result files the ledger cites keep the
relative links that also work on GitHub. MyST Markdown and myst-nb, as JAX, Flax and Optax do;
the notebooks are rendered with their committed outputs, never executed here.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autodoc documents this checkout's jax_epilog

project = "jax-epilog"
author = "jax-epilog developers"
copyright = "jax-epilog developers"  # noqa: A001 (Sphinx's name)
release = "0.1.0"

extensions = [
    "myst_nb",  # MyST Markdown and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
]

root_doc = "docs/index"
# Only the site's sources; the rest of the checkout (venvs, build trees, tests) is never walked.
include_patterns = ["docs/**", "notebooks/*.ipynb", "benchmarks/README.md",
                    "benchmarks/results/**", "examples/gpt/results/**"]
exclude_patterns = [".*", "build", "dist", "docs/conf.py", "**/.ipynb_checkpoints",
                    "jax_epilog", "tests", "ffi", "scripts", "build_backend"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

nb_execution_mode = "off"  # the notebooks' committed outputs are what the site shows
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3  # `page.md#a-section` links resolve as on GitHub
# The result files are generated reports whose headings may skip a level.
suppress_warnings = ["myst.header"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "jax-epilog"
html_theme_options = {"show_toc_level": 2, "home_page_in_toc": True}
#: Guides the index lists that a checkout may not have yet (they arrive from other branches):
#: their toctree lines are dropped while the page is absent, so the site builds either way.
OPTIONAL_PAGES = ("stock_models", "kv_cache")


def _drop_absent_pages(app, docname, source):
    """The index's toctree lines of absent optional pages go, and links to them elsewhere
    become their text."""
    absent = {name for name in OPTIONAL_PAGES if not (ROOT / "docs" / f"{name}.md").exists()}
    if not absent:
        return
    text = source[0]
    if docname == "docs/index":
        text = "\n".join(line for line in text.splitlines() if line.strip() not in absent) + "\n"
    for name in absent:
        text = re.sub(r"\[([^\]]*)\]\(%s\.md(#[^)]*)?\)" % name, r"\1", text)
    source[0] = text


def _escape_bars(app, what, name, obj, options, lines):
    """Docstrings write |x| for an absolute value, which reStructuredText reads as a
    substitution: escape every bar outside a table row."""
    for i, line in enumerate(lines):
        if "|" in line and not line.lstrip().startswith(("|", "+")):
            lines[i] = line.replace("|", "\\|")


def _redirect_to_the_index(app, exception):
    """The site's root page (the sources are the checkout's root, the index is docs/)."""
    if exception is None and app.builder.format == "html":
        (Path(app.outdir) / "index.html").write_text(
            '<meta http-equiv="refresh" content="0; url=docs/index.html">\n')


def setup(app):
    app.connect("source-read", _drop_absent_pages)
    app.connect("build-finished", _redirect_to_the_index)
    app.connect("autodoc-process-docstring", _escape_bars)
