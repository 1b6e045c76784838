"""CPU: the documents name only what exists, and docs/testing.md lists the test files as
they are registered.

Every repository path README.md and docs/*.md name (under python/sglang_nsa_cp/, test/,
benchmark/, scripts/, docs/, examples/) exists, and every test or benchmark file they name by
its bare name (`test_*.py`, `bench_*.py`) is in the repository; the exceptions are paths in
SGLang's own tree and one made-up example, listed below with why. Every test the documents name
(`test_x.py::test_y`, or a bare `test_y` in backquotes) is a test function of that file, or of
some test file. docs/testing.md's suite and file tables are what `scripts/gen_test_tables.py`
generates from the registrations, and its claims table names, for every row of the README's status
table, tests that exist (scripts/gen_test_tables.py's CLAIMS); every commit, machine and number docs/evidence.md gives for a
results file appears in that file.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:python/sglang_nsa_cp|test|benchmark|scripts|docs|examples)/[\w./-]*\w)")
BARE = re.compile(r"(?<![\w/.-])((?:test|bench)_\w+\.py)\b")
NOT_OURS = {  # path or prefix -> why it does not exist here
    "test/registered": "SGLang's own test tree (docs/testing.md, docs/speculative.md compare ours with it)",
    "test/run_suite.py": "SGLang's own runner, in its repository",
    "test/comm/test_new_feature.py": "the made-up file of docs/testing.md's example error message",
}
CITED_TEST = re.compile(r"(?<![\w/.-])(test_\w+\.py)::(test_\w+)")
BARE_TEST = re.compile(r"`(test_\w+)`")  # a bare test name in backquotes
GENERATED = re.compile(r"<!-- tests:begin -->.*?<!-- tests:end -->", re.S)  # checked against registrations


def _named(doc: Path) -> tuple[set[str], set[str]]:
    text = GENERATED.sub("", doc.read_text())
    paths = {m.group(1).rstrip(".") for m in PATH.finditer(text) if not text[m.end() :].startswith(("{", ".{"))}
    return {p for p in paths if not any(p == n or p.startswith(n + "/") for n in NOT_OURS)}, set(BARE.findall(text))


@functools.cache
def _python_file_names() -> frozenset[str]:
    """Names of the project's .py files (walked once, without descending into .venv or .git)."""
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git")]
        names.update(f for f in files if f.endswith(".py"))
    return frozenset(names)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_a_document_names_exists(doc):
    paths, names = _named(doc)
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"
    files = _python_file_names()
    assert not sorted(names - files), f"{doc.relative_to(ROOT)} names files that do not exist: {sorted(names - files)}"


@functools.cache
def _test_functions() -> dict[str, frozenset[str]]:
    """Test file name -> the names of its test functions (methods of test classes included)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "test").rglob("test_*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        found.setdefault(path.name, set()).update(n for n in names if n.startswith("test_"))
    return {name: frozenset(tests) for name, tests in found.items()}


def missing_tests(text: str) -> list[str]:
    """The tests `text` names that no test file defines: `file::test` against that file, a bare
    `test_name` against every test file."""
    tests = _test_functions()
    everywhere = frozenset().union(*tests.values())
    missing = [f"{f}::{t}" for f, t in CITED_TEST.findall(text) if t not in tests.get(f, ())]
    return missing + [t for t in BARE_TEST.findall(text) if t not in everywhere]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_test_a_document_names_exists(doc):
    missing = missing_tests(GENERATED.sub("", doc.read_text()))
    assert not missing, f"{doc.relative_to(ROOT)} names tests that do not exist (renamed or deleted?): {missing}"


def test_a_document_naming_a_test_that_does_not_exist_is_caught():
    assert missing_tests("`test_docs.py::test_every_test_a_document_names_exists` and `test_envs`") == ["test_envs"]
    assert missing_tests("`test_docs.py::test_no_such_test`, `test_no_such_test_either`") == [
        "test_docs.py::test_no_such_test",
        "test_no_such_test_either",
    ]


def test_the_testing_doc_lists_every_registered_test_file():
    spec = importlib.util.spec_from_file_location("gen_test_tables", ROOT / "scripts" / "gen_test_tables.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.current_doc_tables() == generator.tables(), (
        "docs/testing.md's tables are stale: run `.venv/bin/python scripts/gen_test_tables.py --write`"
    )


def _gen_test_tables():
    spec = importlib.util.spec_from_file_location("gen_test_tables", ROOT / "scripts" / "gen_test_tables.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def claim_problems(readme: str, claims: dict, not_claims: dict) -> list[str]:
    """What keeps docs/testing.md's claims table from holding every README status row."""
    rows = _gen_test_tables().readme_status_rows(readme)
    problems = [f"README status row {r!r} has no tests in CLAIMS (scripts/gen_test_tables.py)"
                for r in rows if r not in claims and r not in not_claims]  # fmt: skip
    problems += [f"CLAIMS entry {c!r} is no README status row" for c in claims if c not in rows]
    problems += [f"CLAIMS entry {c!r} names no test" for c, tests in claims.items() if not tests]
    for claim, tests in claims.items():
        problems += [f"{claim!r}: {t} does not exist" for t in missing_tests(" ".join(f"`{t}`" for t in tests))]
    return problems


def test_every_readme_claim_is_held_by_named_tests_that_exist():
    generator = _gen_test_tables()
    assert claim_problems((ROOT / "README.md").read_text(), generator.CLAIMS, generator.NOT_A_CLAIM) == []
    assert generator.current_doc_claims() == generator.claims_table(), (
        "docs/testing.md's claims table is stale: run `.venv/bin/python scripts/gen_test_tables.py --write`"
    )


def test_a_claim_without_tests_or_a_test_gone_is_caught():
    generator = _gen_test_tables()
    readme = (ROOT / "README.md").read_text()
    grown = readme.replace("| plugin scope |", "| a new piece | CPU |\n| plugin scope |", 1)
    assert claim_problems(grown, generator.CLAIMS, generator.NOT_A_CLAIM) == [
        "README status row 'a new piece' has no tests in CLAIMS (scripts/gen_test_tables.py)"
    ]
    claims = dict(generator.CLAIMS, **{"plugin scope": ("test_ledger.py::test_renamed_away",)})
    assert claim_problems(readme, claims, generator.NOT_A_CLAIM) == [
        "'plugin scope': test_ledger.py::test_renamed_away does not exist"
    ]
    claims = dict(generator.CLAIMS, **{"plugin scope": ()})
    assert claim_problems(readme, claims, generator.NOT_A_CLAIM) == ["CLAIMS entry 'plugin scope' names no test"]


def _gen_result_tables():
    spec = importlib.util.spec_from_file_location("gen_result_tables", ROOT / "scripts" / "gen_result_tables.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_every_results_block_in_the_docs_is_what_its_results_file_renders():
    generator = _gen_result_tables()
    blocks = [m.group(2) for doc in generator.documents() for m in generator.BLOCK.finditer(Path(doc).read_text())]
    assert "kernels" in blocks, "docs/kernels.md must carry its table as a generated block"
    assert not generator.stale_documents(), (
        f"stale results blocks in {generator.stale_documents()}: run `.venv/bin/python scripts/gen_result_tables.py --write`"
    )


def test_a_results_block_that_was_typed_over_is_caught():
    generator = _gen_result_tables()
    text = "<!-- results:kernels:begin -->\n| typed | by hand |\n<!-- results:kernels:end -->"
    assert generator.regenerate(text) != text


EVIDENCE_ROW = re.compile(r"^\| (E\d+) \|.*?\| `benchmark/results/([\w.]+)` \| (.*) \|$", re.M)
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])")


def unsupported_evidence(evidence_md: str, read_result) -> list[str]:
    """Each commit, machine and number of the model column that a row of
    docs/evidence.md gives for a results file and that file does not hold (read_result(name): its
    text). The claim and kind columns are the generator's words, not the file's."""
    problems = []
    rows = EVIDENCE_ROW.findall(evidence_md)
    assert rows, "docs/evidence.md has no evidence rows (| E1 | ... |)"
    for row, name, rest in rows:
        commit, machine, model, _kind = (c.strip() for c in rest.split(" | "))
        text = read_result(name)
        numbers = {float(n.replace(",", "")) for n in NUMBER.findall(text)}
        sha = re.match(r"[0-9a-f]{10}\b", commit)
        if sha and sha.group(0) not in text:
            problems.append(f"{row}: commit {sha.group(0)} not in {name}")
        for part in machine.split(", "):
            if not part.startswith("not recorded") and part not in text:
                problems.append(f"{row}: machine {part!r} not in {name}")
        for figure in NUMBER.findall(model):
            if float(figure.replace(",", "")) not in numbers:
                problems.append(f"{row}: {figure} not in {name}")
    return problems


def test_every_figure_of_the_evidence_page_is_in_its_results_file():
    page = (ROOT / "docs" / "evidence.md").read_text()
    problems = unsupported_evidence(page, lambda name: (ROOT / "benchmark" / "results" / name).read_text())
    assert not problems, f"docs/evidence.md gives what its results files do not hold: {problems}"


def test_an_evidence_figure_its_results_file_lacks_is_caught():
    row = "| E1 | a claim | `benchmark/results/x.json` | 0123459999 | NVIDIA H200 | 78 layers | measured |"
    holds = '{"commit": "0123459999abcdef", "gpus": ["NVIDIA H200"], "layers": 78}'
    assert unsupported_evidence(row, lambda name: holds) == []
    assert unsupported_evidence(row, lambda name: holds.replace("78", "61")) == ["E1: 78 not in x.json"]
    assert unsupported_evidence(row, lambda name: holds.replace("H200", "H100")) == [
        "E1: machine 'NVIDIA H200' not in x.json"
    ]
    assert unsupported_evidence(row, lambda name: holds.replace("0123", "1111")) == [
        "E1: commit 0123459999 not in x.json"
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
