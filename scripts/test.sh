#!/usr/bin/env bash
# The CPU test suite (the README's test command). Sets up .venv first if needed.
#   bash scripts/test.sh                          the whole suite (pyproject's testpaths: test/)
#   bash scripts/test.sh test/test_split.py -k x  exactly what it is given, as pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
# Triton's interpreter must be selected before triton is imported (sglang imports it too).
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
