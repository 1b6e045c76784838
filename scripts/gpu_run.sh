#!/usr/bin/env bash
# On the GPU machine (2 x H200, torch 2.11, no network): unpack the bundle, check SGLang's imports,
# run the GPU tests, then the SGLang prefill benchmark. Logs and results go to ${OUT:-gpu_out}.
#
#   bash scripts/gpu_run.sh [tests|bench|all] [benchmark arguments...]
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
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source scripts/gpu_unpack.sh /tmp/site >/dev/null || exit 1
python3 scripts/check_gpu_imports.py >"$out/imports.log" 2>&1 || { tail -30 "$out/imports.log"; exit 1; }
status=0
if [ "$what" != bench ]; then
  python3 -m pytest -q -s -p no:cacheprovider test/test_mqa_logits_triton.py test/test_kernels_gpu.py \
    test/test_sglang_gpu_forward.py 2>&1 | tee "$out/gpu_tests.log" | grep -v "^$" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" != tests ]; then
  python3 benchmark/bench_sglang_prefill.py --out "$out" --plot "$@" 2>&1 | tee "$out/bench_sglang_prefill.log" | tail -45
  status=$((status || PIPESTATUS[0]))
fi
exit $status
