"""The docs as a reader meets them: the README starts with the two set-up commands and stays short, its
figures are the benchmarks summary's, every link and every script, bench result and device group the docs
name exists, the summary stays a summary, and the spec reference is the one the schema generates."""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
PAGES = sorted([README, *(REPO / "docs").glob("*.md")])
CURRENT = [page for page in PAGES if page.name != "benchmarks-log.md"]  # the log keeps its history's names
WRITES = re.compile(r"--(?:screenshot|output|out)[= ](\S+)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def tracked_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return set(listed.stdout.split())


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", prose(page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def expand_braces(name: str) -> list[str]:
    """`a_{b,c}_run{1,2}.json` -> the four names it stands for, as the shell expands it."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def device_groups() -> set[str]:
    sys.path.insert(0, str(REPO / "bench"))
    import device_runs

    return set(device_runs.GROUPS)


def test_readme_commands_write_no_tracked_file():
    written = WRITES.findall(README.read_text())
    assert written, "the README's screenshot command is no longer found: update this test"
    tracked = tracked_files()
    overwritten = [
        path for path in written if not path.startswith("/") and path.removeprefix("./") in tracked
    ]
    assert overwritten == [], f"README commands overwrite tracked files: {overwritten}"


def test_the_readme_starts_with_the_two_commands_that_set_up_a_fresh_machine():
    first_block = FENCE.search(README.read_text()).group(0).splitlines()[1:-1]
    assert [line.split("#")[0].strip() for line in first_block] == [
        "bash scripts/quickstart.sh",
        "bash scripts/test.sh",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, "CI runs exactly the README's test command"
    before = README.read_text().split("```")[0]
    assert before.strip() == "# mortal", "nothing but the title comes before the two commands"


def test_the_readme_is_read_in_five_minutes():
    assert len(README.read_text().splitlines()) <= 250


def test_the_benchmarks_page_stays_a_summary_of_the_log():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= 500
    assert "(benchmarks-log.md)" in text


def test_every_figure_the_readme_states_is_the_benchmarks_summarys():
    summary = BENCHMARKS.read_text()
    text = prose(README.read_text())
    figures = set(re.findall(r"\b\d+(?:\.\d+)?x\b|\b\d+%|\b0\.\d{3}\b|\b\d+ min \d+ s\b", text))
    assert figures, "no figure found in the README: update this test"
    missing = sorted(figure for figure in figures if figure not in summary)
    assert missing == [], f"figures in the README that docs/benchmarks.md does not state: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_stays_in_the_repository_and_finds_its_target(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            broken.append(f"{target}: a link outside the repository")
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert broken == []


@pytest.mark.parametrize("page", CURRENT, ids=lambda page: page.name)
def test_the_scripts_benches_and_examples_the_docs_name_exist(page):
    named = re.findall(r"(?<![\w/.])((?:scripts|bench|specs/examples|docs)/[\w./{},-]*\w)", page.read_text())
    missing = sorted({name for name in named for path in expand_braces(name) if not (REPO / path).exists()})
    assert missing == []


def test_every_result_the_benchmarks_summary_cites_is_kept():
    cited = re.findall(r"`([\w.{},-]+\.(?:json|txt|log))`", BENCHMARKS.read_text())
    assert cited, "no JSON cited in docs/benchmarks.md: update this test"
    results = REPO / "bench" / "results"
    missing = sorted(
        {name for name in cited for path in expand_braces(name) if not (results / path).exists()}
    )
    assert missing == [], f"cited in docs/benchmarks.md, not in bench/results/: {missing}"


def test_the_device_groups_the_docs_name_are_the_runners_and_each_is_documented():
    groups = device_groups()
    command = re.compile(r"device_runs\.py ([a-z0-9][a-z0-9.-]*)")
    named = {name for page in CURRENT for name in command.findall(page.read_text())}
    assert named - groups - {"--list"} == set()
    summary = BENCHMARKS.read_text()
    assert sorted(group for group in groups if f"`{group}`" not in summary) == []


def load_script(name: str):
    """A script of scripts/ as a module (scripts/ is not a package: its files are run, not imported)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_spec_reference_is_the_one_the_schema_generates():
    generated = load_script("spec_reference").render()
    checked_in = (REPO / "docs" / "spec-reference.md").read_text()
    assert checked_in == generated, (
        "docs/spec-reference.md is out of date with the spec's field descriptions: "
        "regenerate it with `python scripts/spec_reference.py --write`"
    )
