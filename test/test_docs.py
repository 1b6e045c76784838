"""CPU, ~20 s: the documents name only what exists, and docs/testing.md lists the test files as
they are registered.

Every repository path README.md and docs/*.md name (under python/sglang_nsa_cp/, test/,
benchmark/, scripts/, docs/, examples/) exists, and every test or benchmark file they name by
its bare name (`test_*.py`, `bench_*.py`) is in the repository; the exceptions are paths in
SGLang's own tree and one made-up example, listed below with why. docs/testing.md's suite and
file tables are what `scripts/gen_test_tables.py` generates from the registrations.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="nsa-cp-test-cpu-unit")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:python/sglang_nsa_cp|test|benchmark|scripts|docs|examples)/[\w./-]*\w)")
BARE = re.compile(r"(?<![\w/.-])((?:test|bench)_\w+\.py)\b")
NOT_OURS = {  # path or prefix -> why it does not exist here
    "test/registered": "SGLang's own test tree (docs/testing.md, docs/speculative.md compare ours with it)",
    "test/run_suite.py": "SGLang's own runner, in its repository",
    "test/comm/test_new_feature.py": "the made-up file of docs/testing.md's example error message",
}
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


def test_the_testing_doc_lists_every_registered_test_file():
    spec = importlib.util.spec_from_file_location("gen_test_tables", ROOT / "scripts" / "gen_test_tables.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.current_doc_tables() == generator.tables(), (
        "docs/testing.md's tables are stale: run `.venv/bin/python scripts/gen_test_tables.py --write`"
    )


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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
