#!/usr/bin/env bash
# The real SGLang server with --enable-nsa-prefill-cp-shared-kv on this CPU machine, by hand: a PD
# prefill (CP=2, the flag), a decode, SGLang's router, and two oracle servers (replicated CP, one
# non-CP server) on a tiny DeepSeek-V3.2 checkpoint; sends a few requests through each path and
# prints the tokens. `--keep` leaves the servers up until Ctrl-C. See docs/sglang_cpu_server.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
# Triton's interpreter must be selected before triton is imported (sglang imports it too).
export TRITON_INTERPRET=1
# The servers' module is in the test helpers package (test/helpers/).
export PYTHONPATH=test${PYTHONPATH:+:$PYTHONPATH}
exec .venv/bin/python -m helpers.sglang_servers "$@"
