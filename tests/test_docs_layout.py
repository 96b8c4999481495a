"""What a reader of docs/ relies on: performance.md is a reference (its figures table generated from the record, a
reproduce command per row, no dated lab sections), testing.md says how the suite works (no CI journal), every
measurement's lab notes live in docs/results/ as one dated file with a summary line, and no link or cited section
leads nowhere. The table's values against bench/record.jsonl are tests/test_bench_record.py's."""

from __future__ import annotations

import re
import subprocess
from datetime import date
from pathlib import Path

from bench.record import BEGIN, BY_NAME, DOCS, END
from tests.runs import ROOT

DOC_DIR = ROOT / "docs"
RESULTS = DOC_DIR / "results"
RESULT_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9]+(?:-[a-z0-9]+)*\.md$")
SUMMARY = re.compile(r"^# (\d{4}-\d{2}-\d{2}) · (\S.{19,})$")  # "# DATE · one line that says what was found"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A cited section: a doc's path, then "Title" after a comma or in parentheses (line breaks collapsed).
CITATION = re.compile(r"docs/([\w./-]+\.md)`?(?:,\s*|\s+\(\s*)\"([^\"]+)\"")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+?\.md\b")


def docs() -> list[Path]:
    return sorted(DOC_DIR.glob("*.md")) + sorted(RESULTS.glob("*.md"))


def prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def headings(path: Path) -> list[str]:
    return [" ".join(ln.lstrip("#").split()) for ln in prose(path.read_text()) if ln.startswith("#")]


def sections(path: Path) -> list[str]:
    """What a citation may name: a heading (without its number, "10. Growth: …" answers "Growth") or a
    paragraph's bold lead ("**Feeding the GPU (issue 15).** …")."""
    numbered = [re.sub(r"^\d+\.\s+", "", h) for h in headings(path)]
    leads = [m[1] for ln in prose(path.read_text()) if (m := re.match(r"^\*\*([^*]+)\*\*", ln))]
    return numbered + leads


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_results_file_is_dated_in_its_name_and_opens_with_that_date_and_a_summary() -> None:
    files = sorted(RESULTS.iterdir())
    assert files, "docs/results/ holds the lab notes: it cannot be empty"
    for path in files:
        named = RESULT_NAME.match(path.name)
        assert named, f"{path.name}: a results file is named YYYY-MM-DD-what.md (lower case, hyphens)"
        date.fromisoformat(named[1])  # a real date
        first = path.read_text().splitlines()[0]
        opened = SUMMARY.match(first)
        assert opened, f"{path.name}: the first line is '# {named[1]} · <one-line summary>', not {first!r}"
        assert opened[1] == named[1], (
            f"{path.name}: its summary line is dated {opened[1]}, its name {named[1]}"
        )


def test_performance_md_indexes_every_results_file() -> None:
    """The reader finds every measurement from one place: the lab-notes index that closes performance.md."""
    index = DOCS.read_text().split("## Lab notes (`docs/results/`)", 1)[-1]
    linked = {Path(t).name for t in LINK.findall(index) if t.startswith("results/")}
    unlisted = sorted(p.name for p in RESULTS.glob("*.md") if p.name not in linked)
    assert not unlisted, f"docs/performance.md's lab-notes index lacks {unlisted}"


def test_every_relative_link_in_the_docs_leads_to_a_file_and_heading_that_exist() -> None:
    broken: list[str] = []
    for path in docs():
        for target in LINK.findall("\n".join(prose(path.read_text()))):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)


def test_performance_md_is_a_reference_with_the_generated_table_and_a_reproduce_command_per_row() -> None:
    text = DOCS.read_text()
    assert text.index(BEGIN) < text.index("\n## ", text.index("## Current figures")), (
        "the table opens the page"
    )
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in block.splitlines() if ln.startswith("| ")]
    header, body = rows[0], rows[2:]
    col = header.index("reproduce")
    assert body, "the generated table has no rows"
    for row in body:
        figure, cmd = row[0], row[col].strip("`")
        bench = cmd.removeprefix("python bench/record.py --only ")
        assert bench in BY_NAME and figure in {s.name for s in BY_NAME[bench].figures}, (
            f"{figure}: reproduce cell {cmd!r} does not run the benchmark that measures it"
        )
    dated = [ln for ln in prose(text) if ln.startswith("#") and DATE.search(ln)]
    assert not dated, f"dated sections belong in docs/results/, not docs/performance.md: {dated}"
    notes = [ln for ln in prose(text) if re.match(r"^\*\*(\(?20\d\d-\d\d-\d\d)", ln)]
    assert not notes, f"dated lab notes belong in docs/results/: {notes}"


def test_testing_md_says_how_the_suite_works_not_when_it_ran() -> None:
    text = (DOC_DIR / "testing.md").read_text()
    for cited in ("Tolerances", "Versions"):  # cited from tests/tolerance.py, .ci/relock, pipeline/
        assert cited in headings(DOC_DIR / "testing.md"), f"docs/testing.md lost its {cited!r} section"
    stray = [ln for ln in prose(text) if DATE.search(LINK.sub("", DOC_PATH.sub("", ln)))]
    assert not stray, f"dated CI history belongs in docs/results/ (a file of CI runs): {stray}"


def test_every_docs_path_and_section_cited_in_the_repo_exists() -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    broken: list[str] = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".sh", ".txt", ""} or not path.is_file():
            continue
        try:
            text = " ".join(path.read_text().split())
        except UnicodeDecodeError:
            continue
        for cited in set(DOC_PATH.findall(text)):
            if not (ROOT / cited).exists():
                broken.append(f"{name}: {cited} does not exist")
        for doc, title in CITATION.findall(text):
            target = ROOT / "docs" / doc
            if target.exists() and not any(s.startswith(title) for s in sections(target)):
                broken.append(f'{name}: docs/{doc} has no section "{title}"')
    assert not broken, "\n".join(sorted(set(broken)))
