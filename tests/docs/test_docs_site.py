"""The docs' own targets (issue 65): a README a new user reads in ten minutes, guides that say
what is true now (few dated mentions), every guide in the site's index, and a results ledger
whose rows carry their card, date, commit and command and cover every result file kept."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
LEDGER = (DOCS / "ledger.md").read_text()
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 350
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in first_block.splitlines()] == [
        "./scripts/demo.sh", "./scripts/test.sh"]


def test_the_guides_carry_few_dates():
    """Dated run history lives in the ledger and in git, not in the guides."""
    pages = [ROOT / "README.md", *(p for p in DOCS.glob("*.md") if p.name != "ledger.md")]
    dated = {p.name: len(DATE.findall(p.read_text())) for p in pages}
    assert sum(dated.values()) <= 25, dated


def toctree_entries(text: str) -> set[str]:
    entries = set()
    for block in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
        entries |= {line.strip() for line in block.splitlines()
                    if line.strip() and not line.startswith(":")}
    return entries


def test_every_guide_is_in_the_index():
    listed = toctree_entries((DOCS / "index.md").read_text())
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, pages - listed
    notebooks = {f"../notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks <= listed, notebooks - listed


def ledger_rows() -> list[list[str]]:
    rows = []
    for line in LEDGER.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("measured",) and not set(cells[0]) <= {"-"}:
            rows.append(cells)
    return rows


def test_every_ledger_row_says_card_date_commit_command_and_file():
    rows = ledger_rows()
    assert len(rows) >= 20
    for cells in rows:
        assert len(cells) == 7, cells
        measured, result, card, date, commit, command, file = cells
        assert re.search(r"H100|H200|CPU", card), cells
        assert DATE.search(date), cells
        assert re.fullmatch(r"[0-9a-f]{7,40}|not recorded \([0-9a-f]{7,40}, 20\d\d-\d\d-\d\d\)",
                            commit), cells
        assert command and "results/" in file, cells


def test_every_result_report_kept_is_a_ledger_row():
    """A result file nobody cites is an old run: it goes (git keeps it) or gets its row."""
    cited = set(re.findall(r"\]\(\.\./((?:benchmarks|examples/gpt)/results/[^)]+)\)", LEDGER))
    reports = {str(p.relative_to(ROOT)) for folder in ("benchmarks/results", "examples/gpt/results")
               for p in (ROOT / folder).rglob("*.md")}
    assert reports <= cited, reports - cited
    assert all((ROOT / path).is_file() for path in cited)
