#!/usr/bin/env bash
# The product on this CPU machine (the README's first command): SGLang 0.5.23's real servers with
# --enable-nsa-prefill-cp-shared-kv (PD prefill at CP=2, a decode, SGLang's router) next to a
# replicated-CP prefill (the same KV rows per rank) and a non-CP oracle server; a few requests, the
# tokens checked against the oracle, a prompt longer than one rank's pool (replicated refuses it,
# shared KV serves it), SGLang's capacity and memory reports side by side; everything stopped at the
# end, also on Ctrl-C. Sets up .venv if needed (progress on stderr). Options: --cp N (2, 4 or 8),
# --kv-cache-dtype fp8_e4m3, --hicache, --workdir DIR; see test/helpers/demo.py and
# docs/sglang_cpu_server.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh >&2
# Triton's interpreter must be selected before triton is imported (sglang imports it too).
export TRITON_INTERPRET=1
# The servers' helpers are in the test helpers package (test/helpers/).
export PYTHONPATH=test${PYTHONPATH:+:$PYTHONPATH}
exec .venv/bin/python -m helpers.demo "$@"
