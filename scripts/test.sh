#!/usr/bin/env bash
# The CPU test suite (the README's test command). Sets up .venv first if needed.
#   bash scripts/test.sh                          the formatter and linter (ruff, pyproject.toml), then
#                                                 the CPU suite through scripts/run_suite.py: every
#                                                 registered test/**/test_*.py of suite nsa-cp-test-cpu,
#                                                 after checking that every test file is registered
#   bash scripts/test.sh --fast                   the formatter and linter, then the suite's unit tier
#                                                 (nsa-cp-test-cpu-unit: no server start, no rank spawn;
#                                                 about 4 minutes), the loop for everyday edits
#   bash scripts/test.sh test/comm/test_tail.py -k x   exactly what it is given, as pytest arguments
# A partition of the suite, or a GPU suite: .venv/bin/python scripts/run_suite.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
# Triton's interpreter must be selected before triton is imported (sglang imports it too).
export TRITON_INTERPRET=1
if [ $# -eq 0 ] || [ "$*" = --fast ]; then
  # `ruff format .` and `ruff check --fix .` fix most of what these report.
  .venv/bin/ruff format --check --quiet . || { echo "test.sh: run '.venv/bin/ruff format .'" >&2; exit 1; }
  .venv/bin/ruff check --quiet .
  suite=nsa-cp-test-cpu
  [ $# -eq 0 ] || suite=nsa-cp-test-cpu-unit
  exec .venv/bin/python scripts/run_suite.py --suite "$suite"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
