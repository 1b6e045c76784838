#!/usr/bin/env bash
# Builds the CPU development environment in .venv from nothing; a re-run with an unchanged
# script only checks the stamp and returns. Pins live here, not in pyproject.toml: GPU nodes
# get torch from SGLang's own install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.setup-stamp
want=$(sha256sum scripts/setup_cpu.sh scripts/torchvision_stub.py pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup_cpu: .venv is up to date"
  exit 0
fi

# Mooncake's non-CUDA engine links libibverbs even when it only speaks TCP.
if ! ldconfig -p | grep -q libibverbs.so.1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

[ -x $VENV/bin/python ] || python3 -m venv $VENV
PIP="$VENV/bin/pip install -q --disable-pip-version-check"
# torch 2.13.0 resolves to the CPU build on these machines; triton 3.8.0 is the interpreter we test with.
$PIP torch==2.13.0 triton==3.8.0 "numpy<2.4" pytest pytest-timeout hypothesis safetensors
# sglang 0.5.23 without its GPU stack: only what its CPU-importable modules need.
$PIP orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
     aiohttp apache-tvm-ffi==0.1.11 transformers==5.19.0 sentencepiece einops xxhash partial_json_parser \
     prometheus-client python-multipart interegular dill loguru frozendict gguf openai==2.8.0 \
     setproctitle fastapi uvicorn uvloop
$PIP --no-deps sglang==0.5.23 compressed-tensors==0.18.0
$PIP mooncake-transfer-engine-non-cuda
# torchvision's PyPI builds are CUDA-only; sglang imports it on paths we never execute.
$VENV/bin/python scripts/torchvision_stub.py install
$PIP --no-deps -e .
echo "$want" > "$STAMP"
echo "setup_cpu: .venv ready"
