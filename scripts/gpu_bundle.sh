#!/usr/bin/env bash
# Builds .gpu_bundle/: what a run on the GPU machine needs to import and run SGLang 0.5.23's own DSA
# model code there (torch 2.11, Python 3.12, no network, at most 64 MiB carried per run). Runs
# here, with the package index; pinned versions; the same inputs give byte-identical archives.
# docs/gpu_bundle.md says what is in each part and why; scripts/gpu_unpack.sh installs it there.
#
#   bash scripts/gpu_bundle.sh                 # -> .gpu_bundle/*.tar.xz, sizes printed
#   GPU_BUNDLE_PYTHON=3.11 GPU_BUNDLE_DIR=/tmp/b311 bash scripts/gpu_bundle.sh
#                                              # the same bundle for CPython 3.11 (used by the CPU check)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${GPU_BUNDLE_DIR:-$REPO/.gpu_bundle}
PY_VERSION=${GPU_BUNDLE_PYTHON:-3.12}
BUDGET_MIB=55
PARTS="sglang.tar.xz deps.tar.xz flash_mla.tar.xz sgl_kernel.tar.xz mooncake.tar.xz router.tar.xz"
PYTHON=${PYTHON:-python3}

SGLANG=sglang==0.5.23
SGL_KERNEL=sglang-kernel==0.4.10 # only its pure-Python package travels (see gpu_stand_ins.py)
FLASH_MLA=sgl-flash-mla==1.0.0   # torch stable ABI: loads on torch 2.11
# SGLang's real servers (scripts/gpu_run.sh server): Mooncake's CUDA transfer engine, trimmed to
# what `mooncake.engine` loads, and SGLang's PD router (one Rust extension).
MOONCAKE=mooncake-transfer-engine-cuda13==0.3.14
ROUTER=sglang-router==0.3.2
MOONCAKE_FILES=(
  mooncake/__init__.py mooncake/engine.so mooncake/engine.pyi mooncake/libasio.so mooncake/libetcd_wrapper.so
  'mooncake_transfer_engine_cuda13.libs/libyaml-cpp-*' 'mooncake_transfer_engine_cuda13.libs/libjsoncpp-*'
  'mooncake_transfer_engine_cuda13.libs/libglog-*' 'mooncake_transfer_engine_cuda13.libs/libgflags-*'
  'mooncake_transfer_engine_cuda13-*.dist-info'
)
# SGLang's import-time dependencies that the GPU machine lacks, found by importing SGLang's DSA
# modules and running its DSA forward on CPU (test/sglang_ext/layers/test_sglang_model_forward.py) on a venv that
# holds only the GPU machine's packages (docs/gpu_bundle.md). Versions
# are those SGLang 0.5.23 resolves to. typing-extensions shadows the machine's copy because
# pydantic 2.14 needs >= 4.16; transformers because SGLang pins 5.19.0 (the machine has 5.17).
DEPS=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 dill==0.4.1
  distro==1.9.0 fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1 jiter==0.19.0 loguru==0.7.3
  msgspec==0.23.0 ninja==1.13.2 openai==2.8.0 opentelemetry-api==1.45.2 orjson==3.13.0
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 traitlets==5.16.1 transformers==5.19.0
  typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.54.0
  # the HTTP server, tokenizer manager and scheduler processes (found by importing them on CPU)
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 python-multipart==0.0.34 referencing==0.37.0
  rpds-py==2026.9.1 setproctitle==1.3.8 xgrammar==0.2.7
)
# Parts of the sglang tree that no DSA forward, CP strategy, KV pool, model loader, ServerArgs
# resolution or distributed init imports: diffusion, benchmarks, tests, and the Rust extensions
# (CPython-version-specific .so files, loaded lazily, only by the HTTP/gRPC servers and
# multimodal processors). sglang/test keeps __init__.py, ci/ and scripted_runtime/ (imported
# by the scheduler).
TRIM=(
  sglang/multimodal_gen sglang/benchmark sglang/kernels/jit/benchmark
  'sglang/srt/rust_extensions/*.so' 'sglang/srt/mem_cache/rust_tree_core/*.so'
)

fail() {
  echo "gpu_bundle: $*" >&2
  exit 1
}
command -v xz >/dev/null || fail "xz not found; install it (apt-get install xz-utils)"
$PYTHON -m pip --version >/dev/null 2>&1 || fail "$PYTHON has no pip; set PYTHON=/path/to/python3 with pip"

PLATFORMS=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
ABI=cp${PY_VERSION/./}
download() { # download DIR SPEC...: wheels for CPython $PY_VERSION on x86-64 Linux, no deps
  local dir=$1
  shift
  $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --abi "$ABI" --abi abi3 --abi none "${PLATFORMS[@]}" -d "$dir" "$@" \
    2> >(grep -v "is ignored: it is neither" >&2) ||
    fail "pip download of $* failed (see above); check the pins and the package index"
}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/wheels" "$WORK/dl_sglang" "$WORK/dl_sgk" "$WORK/dl_fmla" "$WORK/dl_mc" "$WORK/dl_router"

# A wheel's install is its unzip: purelib and platlib both land in one site dir, scripts (the
# ninja binary that torch's cpp_extension builds with) in its bin/.
unpack_wheel() { # unpack_wheel WHEEL DEST
  $PYTHON -m zipfile -e "$1" "$2"
  local data
  for data in "$2"/*.data; do
    [ -d "$data" ] || continue
    for lib in purelib platlib; do
      [ -d "$data/$lib" ] && cp -a "$data/$lib/." "$2/"
    done
    if [ -d "$data/scripts" ]; then
      mkdir -p "$2/bin"
      cp -a "$data/scripts/." "$2/bin/"
      chmod +x "$2"/bin/*
    fi
    rm -rf "$data"
  done
}
# Reproducible archive: fixed order, times, owners; single-threaded xz.
pack() { # pack ARCHIVE DIR PATH...
  local archive=$1 dir=$2
  shift 2
  find "$dir" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$dir" --sort=name --mtime='2026-01-01 00:00:00Z' --owner=0 --group=0 --numeric-owner \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -cf - "$@" |
    xz -9 -T1 >"$archive"
}

echo "gpu_bundle: downloading wheels for CPython $PY_VERSION (x86-64 Linux)"
download "$WORK/dl_sglang" "$SGLANG"
download "$WORK/dl_sgk" "$SGL_KERNEL"
download "$WORK/dl_fmla" "$FLASH_MLA"
download "$WORK/dl_mc" "$MOONCAKE"
download "$WORK/dl_router" "$ROUTER"
download "$WORK/wheels" "${DEPS[@]}"
n_wheels=$(ls "$WORK/wheels" | wc -l)
[ "$n_wheels" -eq "${#DEPS[@]}" ] || fail "expected ${#DEPS[@]} dependency wheels, got $n_wheels in $WORK/wheels"

rm -rf "$OUT"
mkdir -p "$OUT"

# 1. sglang: the trimmed Python tree and its dist-info (RECORD dropped: it lists trimmed files).
S=$WORK/sglang
unpack_wheel "$WORK"/dl_sglang/sglang-*.whl "$S"
for p in "${TRIM[@]}"; do
  # shellcheck disable=SC2086 # globs in TRIM expand here
  rm -rf "$S"/$p
done
for p in "$S"/sglang/test/*; do
  case ${p#"$S"/} in
  sglang/test/__init__.py | sglang/test/ci | sglang/test/scripted_runtime) ;;
  *) rm -rf "$p" ;;
  esac
done
rm -f "$S"/sglang-*.dist-info/RECORD
# What the harness runs, by path: the DSA backend and SGLang's KV sharding under
# --enable-nsa-prefill-cp-shared-kv (the page-interleaved pool and its placement, the owner-rotating
# allocator, the kv-shard hooks of the attention backends and of ServerArgs resolution, and the
# PyNccl communicator and allocator the pool gathers history with).
for f in srt/layers/attention/dsa_backend.py srt/mem_cache/page_interleave.py \
  srt/mem_cache/page_interleave_pool.py srt/mem_cache/allocator/page_interleave.py \
  srt/layers/attention/kv_shard_hooks.py srt/arg_groups/kv_shard_hook.py \
  srt/distributed/device_communicators/pynccl.py srt/distributed/device_communicators/pynccl_allocator.py; do
  [ -f "$S/sglang/$f" ] || fail "trimmed sglang tree lacks sglang/$f (the harness runs it); check TRIM"
done
pack "$OUT/sglang.tar.xz" "$S" sglang "$(basename "$S"/sglang-*.dist-info)"

# 2. deps: SGLang's pure-Python (and small compiled, CPython $PY_VERSION) dependencies, installed.
D=$WORK/deps
for w in "$WORK"/wheels/*.whl; do
  unpack_wheel "$w" "$D"
done
pack "$OUT/deps.tar.xz" "$D" .

# 3. flash_mla: FlashMLA's wheel, installed (its .so needs CUDA; it loads only on the GPU).
F=$WORK/flash_mla
unpack_wheel "$WORK"/dl_fmla/*.whl "$F"
pack "$OUT/flash_mla.tar.xz" "$F" .

# 4. sgl_kernel: sglang-kernel's Python files only (its .so op libraries need torch 2.14's C++
#    ABI, and flash_ops alone is 1.1 GB); test/helpers/gpu_stand_ins.py stands in for the op library.
K=$WORK/sgl_kernel
unpack_wheel "$WORK"/dl_sgk/*.whl "$K"
find "$K" -name '*.so' -delete
rm -f "$K"/sglang_kernel-*.dist-info/RECORD
pack "$OUT/sgl_kernel.tar.xz" "$K" .

# 5. mooncake: the CUDA transfer engine and the libraries engine.so links (its RPATH is $ORIGIN
#    and $ORIGIN/../mooncake_transfer_engine_cuda13.libs); the store, master, EP and process-group
#    binaries (most of the wheel) stay out. libcudart, libcuda, libibverbs, libnuma and libcurl come
#    from the GPU machine.
M=$WORK/mooncake
unpack_wheel "$WORK"/dl_mc/*.whl "$M.all"
mkdir -p "$M"
(
  cd "$M.all"
  # shellcheck disable=SC2086 # globs in MOONCAKE_FILES expand here
  cp -a --parents ${MOONCAKE_FILES[*]} "$M/"
)
rm -f "$M"/mooncake_transfer_engine_cuda13-*.dist-info/RECORD
pack "$OUT/mooncake.tar.xz" "$M" .

# 6. router: sglang-router, installed (its Rust extension is abi3).
R=$WORK/router
unpack_wheel "$WORK"/dl_router/*.whl "$R"
rm -f "$R"/sglang_router-*.dist-info/RECORD
pack "$OUT/router.tar.xz" "$R" .

# What went in, for the doc and for the unpack step's check.
{
  echo "python $PY_VERSION"
  for d in dl_sglang dl_sgk dl_fmla dl_mc dl_router wheels; do ls "$WORK/$d"; done
} >"$OUT/MANIFEST"

mib() { awk -v n="$1" -v b="$2" -v x="${3:-}" 'BEGIN { printf "%-20s %10d  %6.2f MiB %s\n", n, b, b / 1048576, x }'; }
total=0
printf '%-20s %10s\n' part bytes
for f in $PARTS MANIFEST; do
  b=$(stat -c %s "$OUT/$f")
  total=$((total + b))
  mib "$f" "$b"
done
mib total "$total" "(budget $BUDGET_MIB MiB)"
[ "$total" -le $((BUDGET_MIB * 1048576)) ] ||
  fail "bundle is $total bytes, over the $BUDGET_MIB MiB budget (a run carries 64 MiB with the repo); trim more in TRIM or DEPS"
echo "gpu_bundle: $OUT ready; on the GPU machine: source scripts/gpu_unpack.sh"
