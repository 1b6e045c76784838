#!/usr/bin/env bash
# The demo on the small reference model (the README's first command). Sets up .venv if needed
# (progress on stderr, so stdout is the report alone); extra arguments go to
# `python -m sglang_nsa_cp demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh >&2
exec .venv/bin/python -m sglang_nsa_cp demo "$@"
