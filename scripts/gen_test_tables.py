"""The suite and file tables of docs/testing.md, generated from the test files' registrations.

    .venv/bin/python scripts/gen_test_tables.py           # print the tables
    .venv/bin/python scripts/gen_test_tables.py --write   # replace them in docs/testing.md

Each `test/**/test_*.py` declares its suite and `est_time` with SGLang's `register_cpu_ci` /
`register_cuda_ci` (read from the source by SGLang's `ut_parse_one_file`, as scripts/run_suite.py
does); the "checks" column is the first line of the file's docstring. docs/testing.md carries the
output between `<!-- tests:begin -->` and `<!-- tests:end -->`; test/test_docs.py keeps the two equal,
so after adding, moving or re-timing a test file, run this with --write.
"""

from __future__ import annotations

import ast
import os
import sys

from sglang.test.ci.ci_register import ut_parse_one_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_DIR = os.path.join(REPO, "test")
DOC = os.path.join(REPO, "docs", "testing.md")
BEGIN, END = "<!-- tests:begin -->\n", "\n<!-- tests:end -->"
MACHINES = {"cpu": "CPU; what CI runs (`.ci/run`)", "cuda": "one or two H200s"}


def test_files() -> list[str]:
    found = []
    for root, dirs, files in os.walk(TEST_DIR):
        dirs[:] = sorted(d for d in dirs if d not in ("helpers", "__pycache__"))
        found += [os.path.join(root, f) for f in sorted(files) if f.startswith("test_") and f.endswith(".py")]
    return sorted(found)


def first_docstring_line(path: str) -> str:
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").replace("|", "/").strip()


def rows() -> list[tuple[str, str, str, float, str]]:
    """(file under test/, suite, backend, est_time, checks) for every registered test file."""
    out = []
    for path in test_files():
        registries, _ = ut_parse_one_file(path)
        for reg in registries:
            name = os.path.relpath(path, TEST_DIR)
            out.append((name, reg.effective_suite, reg.backend.name.lower(), reg.est_time, first_docstring_line(path)))
    return out


def tables() -> str:
    data = rows()
    suites = sorted({(suite, backend) for _, suite, backend, _, _ in data})
    lines = ["| suite | marker | machine | files | est_time in all |", "| --- | --- | --- | ---: | ---: |"]
    for suite, backend in suites:
        mine = [r for r in data if r[1] == suite]
        marker = f"`register_{backend}_ci`"
        lines.append(f"| `{suite}` | {marker} | {MACHINES.get(backend, backend)} | {len(mine)} | "
                     f"{sum(r[3] for r in mine):.0f} s |")  # fmt: skip
    lines += ["", "| file (under test/) | suite | est_time (s) | checks (its docstring's first paragraph) |",
              "| --- | --- | ---: | --- |"]  # fmt: skip
    lines += [f"| `{name}` | `{suite}` | {est:.0f} | {checks} |" for name, suite, _, est, checks in data]
    return "\n".join(lines)


def current_doc_tables() -> str:
    with open(DOC) as f:
        text = f.read()
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def write() -> None:
    with open(DOC) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(head + BEGIN + tables() + END + tail)


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
        print(f"wrote the tables of {os.path.relpath(DOC, REPO)}")
    else:
        print(tables())
