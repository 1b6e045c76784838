#!/usr/bin/env bash
# Builds the CPU development environment in .venv from nothing; a re-run with an unchanged
# script only checks the stamp and returns. Pins live here, not in pyproject.toml: GPU nodes
# get torch from SGLang's own install.
# Needs: python3 >= 3.11 with venv, a package index pip can reach, and libibverbs1 (installed
# with apt-get when missing, which needs root or sudo). Prints one line per step with its time;
# the steps' own output goes to .venv/setup.log, whose tail is printed if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.setup-stamp
want=$(sha256sum scripts/setup_cpu.sh scripts/torchvision_stub.py pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup_cpu: .venv is up to date"
  exit 0
fi
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup_cpu: needs python3 >= 3.11 on PATH (found: $(python3 --version 2>&1 || echo none))" >&2
  exit 1
fi

LOG=$VENV/setup.log
mkdir -p $VENV
: > "$LOG"
exec 3>&1 4>&2 >>"$LOG" 2>&1
STEPS=9
step_no=0
step_start=$SECONDS
end_step() { if [ "$step_no" -gt 0 ]; then printf ' %d s\n' $((SECONDS - step_start)) >&3; fi; }
step() {  # step "what": close the step before (its time), announce this one
  end_step
  step_no=$((step_no + 1))
  step_start=$SECONDS
  printf 'setup_cpu: [%d/%d] %s ...' "$step_no" "$STEPS" "$1" >&3
}
on_exit() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    printf ' failed (exit %d); the end of %s:\n' $rc "$LOG" >&4
    tail -n 30 "$LOG" >&4
  fi
}
trap on_exit EXIT

# Mooncake's non-CUDA engine links libibverbs even when it only speaks TCP.
step "libibverbs1 (system library Mooncake links)"
if ! ldconfig -p | grep -q libibverbs.so.1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      printf ' missing, and installing it needs root: run "apt-get install libibverbs1" as root, then re-run\n' >&4
      trap - EXIT
      exit 1
    fi
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

step "virtual environment $VENV ($(python3 --version))"
[ -x $VENV/bin/python ] || python3 -m venv $VENV
PIP="$VENV/bin/pip install -q --disable-pip-version-check"
step "torch 2.13 CPU, Triton 3.8, numpy, pytest, ruff"
# torch 2.13.0 resolves to the CPU build on these machines; triton 3.8.0 is the interpreter we test with.
# matplotlib: the benchmarks' plots (bench_trace_replay.py's CPU test checks its PNG).
$PIP torch==2.13.0 triton==3.8.0 "numpy<2.4" pytest pytest-timeout hypothesis safetensors ruff==0.14.0 matplotlib
step "SGLang's CPU-importable dependencies"
# sglang 0.5.23 without its GPU stack: only what its CPU-importable modules need.
$PIP orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
     aiohttp apache-tvm-ffi==0.1.11 transformers==5.19.0 sentencepiece einops xxhash partial_json_parser \
     prometheus-client python-multipart interegular dill loguru frozendict gguf openai==2.8.0 \
     setproctitle fastapi uvicorn uvloop
step "SGLang 0.5.23 (no dependencies)"
$PIP --no-deps sglang==0.5.23 compressed-tensors==0.18.0
step "what SGLang's server adds: jsonschema, xgrammar, sglang-router"
# What `python -m sglang.launch_server` adds on top (test_sglang_server_pd.py): the HTTP server's
# jsonschema and xgrammar (its default grammar backend; --no-deps: it pulls torch), and SGLang's
# PD router (sglang-router: the Rust router its own PD test fixtures launch).
$PIP jsonschema==4.26.0
$PIP --no-deps xgrammar==0.2.7 sglang-router==0.3.2
step "Mooncake transfer engine (non-CUDA)"
$PIP mooncake-transfer-engine-non-cuda
step "torchvision stand-in"
# torchvision's PyPI builds are CUDA-only; sglang imports it on paths we never execute.
$VENV/bin/python scripts/torchvision_stub.py install
step "sglang-nsa-cp (editable)"
$PIP --no-deps -e .
end_step
echo "$want" > "$STAMP"
echo "setup_cpu: .venv ready in $SECONDS s (log: $LOG)" >&3
