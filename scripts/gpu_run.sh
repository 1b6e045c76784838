#!/usr/bin/env bash
# On the GPU machine (1 or 2 x H200, torch 2.11, no network): unpack the bundle, check SGLang's
# imports, run the GPU test suites through scripts/run_suite.py, then the SGLang prefill benchmark.
# Logs and results go to ${OUT:-gpu_out}.
#
#   bash scripts/gpu_run.sh [tests|bench|all] [benchmark arguments...]
#   bash scripts/gpu_run.sh server [scripts/sglang_server_check.py arguments...]
#   bash scripts/gpu_run.sh layer [benchmark/bench_glm5_layer.py arguments...]
#   bash scripts/gpu_run.sh q8 [pytest arguments...]
#
# `q8` runs test/sglang_ext/layers/test_sglang_q8_gpu_forward.py alone (--dsa-prefill-backend
# flashmla_sparse_q8: SGLang's SM90 JIT kernel built here, shared KV against replicated CP):
# $OUT/q8_gpu_forward.log. Every mode unpacks .gpu_bundle/cutlass.tar.xz (scripts/gpu_cutlass.sh)
# when it is there, the CUTLASS headers that kernel's build needs.
#
# `layer` times one GLM-5 DSA layer's parts on one GPU at GLM-5's shapes (docs/glm5_layer.md):
# $OUT/bench_glm5_layer_1xh200.json and its log; it needs FlashMLA and SGLang's dequantizer from
# the bundle, not the server imports, so the import check is skipped.
#
# `server` starts SGLang's real servers with the flag on this GPU (docs/sglang_gpu_server.md) and
# checks them over HTTP against a non-CP oracle; by default bf16 and fp8 KV at CP 2 and 4 (two at
# a time) and a 100k-token prompt that only the shared-KV prefill can hold (arguments add to or change that).
#
# `tests` runs the GPU suite, nsa-cp-test-1-gpu-h200 (SGLang's forward over NCCL, the sharded pool
# gathering history with SGLang's PyNccl communicator; a GPU per rank where there are enough, else
# every rank on GPU 0 as its own NCCL host: test/helpers/distributed.py `nccl_device`), one pytest process
# per file so the log ends with each file's time beside its est_time; docs/testing.md lists the
# suites. The benchmark needs a GPU per rank for timings (`bench --share-gpu`: checks only).
#
# The bundle (.gpu_bundle/, built here with scripts/gpu_bundle.sh) travels with the working tree.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
out=${OUT:-gpu_out}
mkdir -p "$out"
# NVLink multicast stays off on shared machines (and SGLang must not try it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NSA_CP_FAIL_ON_SKIP=1  # a skip here means no CUDA or no bundle
source scripts/gpu_unpack.sh /tmp/site >/dev/null || exit 1
if [ -f .gpu_bundle/cutlass.tar.xz ]; then
  mkdir -p /tmp/cutlass && tar -C /tmp/cutlass -xJf .gpu_bundle/cutlass.tar.xz || exit 1
  export NSA_CP_CUTLASS_INCLUDE=/tmp/cutlass/include SGLANG_JIT_CACHE_DIR=${SGLANG_JIT_CACHE_DIR:-$PWD/build/sglang_jit}  # kept between calls
fi
if [ "$what" = layer ]; then
  python3 benchmark/bench_glm5_layer.py --out "$out" "$@" 2>&1 | tee "$out/bench_glm5_layer_1xh200.log" | tail -70
  exit "${PIPESTATUS[0]}"
fi
python3 scripts/check_gpu_imports.py >"$out/imports.log" 2>&1 || { tail -30 "$out/imports.log"; exit 1; }
if [ "$what" = q8 ]; then
  { python3 benchmark/provenance.py --header bash scripts/gpu_run.sh q8
    python3 -m pytest -q -s -p no:cacheprovider test/sglang_ext/layers/test_sglang_q8_gpu_forward.py "$@"; } 2>&1 |
    tee "$out/q8_gpu_forward.log" | grep -v "^$" | tail -60
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = server ]; then
  python3 scripts/sglang_server_check.py --device cuda --out "$out" "$@" 2>&1 | tee "$out/sglang_server_check.log" | tail -60
  exit "${PIPESTATUS[0]}"
fi
status=0
if [ "$what" != bench ]; then
  { python3 benchmark/provenance.py --header bash scripts/gpu_run.sh tests
    python3 scripts/run_suite.py --suite nsa-cp-test-1-gpu-h200 --per-file -- -s; } 2>&1 |
    tee "$out/nsa-cp-test-1-gpu-h200.log" | grep -v "^$" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" != tests ]; then
  python3 benchmark/bench_sglang_prefill.py --out "$out" --plot "$@" 2>&1 | tee "$out/bench_sglang_prefill.log" | tail -45
  status=$((status || PIPESTATUS[0]))
fi
exit $status
