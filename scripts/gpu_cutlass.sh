#!/usr/bin/env bash
# CUTLASS's headers for SGLang's flashmla_sparse_q8 JIT kernel on the GPU machine, where SGLang
# looks for them in flashinfer or DeepGEMM, neither of which loads there (docs/upstream.md, q8).
# Writes .gpu_bundle/cutlass.tar.xz (about 1 MB: include/cute and include/cutlass of the pinned
# nvidia-cutlass wheel, fixed order, times and owners); `bash scripts/gpu_run.sh q8` unpacks it.
#
#   bash scripts/gpu_cutlass.sh      # here, with the package index
set -euo pipefail
cd "$(dirname "$0")/.."
pin=nvidia-cutlass==4.2.0.0
out=${GPU_BUNDLE_DIR:-.gpu_bundle}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --only-binary=:all: "$pin" -d "$tmp/wheel" -q
python3 -m zipfile -e "$tmp"/wheel/*.whl "$tmp/x"
inc="$tmp/x/cutlass_library/source/include"
[ -d "$inc/cute" ] && [ -d "$inc/cutlass" ] || { echo "gpu_cutlass: no include/cute or include/cutlass in $pin" >&2; exit 1; }
mkdir -p "$out"
tar -C "$inc/.." --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - include | xz -9 -T1 >"$out/cutlass.tar.xz"
echo "gpu_cutlass: $out/cutlass.tar.xz ($(stat -c %s "$out/cutlass.tar.xz") bytes, $pin)"
