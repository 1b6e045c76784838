# Installs the bundle that scripts/gpu_bundle.sh built (.gpu_bundle/, carried into the run) into a
# target dir on the GPU machine, offline, in seconds; see docs/gpu_bundle.md.
#
#   source scripts/gpu_unpack.sh [TARGET]   # default /tmp/site; exports PYTHONPATH and PATH
#   bash scripts/gpu_unpack.sh [TARGET]     # the same, and prints the export line to use
#
# PYTHONPATH becomes TARGET:<repo>/python: SGLang's trimmed tree, its missing dependencies,
# FlashMLA and sgl_kernel's Python package come before the machine's own site-packages, then our
# package from the working tree. TARGET also gets a small sglang_nsa_cp dist-info that declares
# our `sglang.srt.plugins` entry point, so SGLang's load_plugins() finds the plugin without a pip
# install. PATH gets TARGET/bin (ninja, for the CUDA kernels torch's cpp_extension builds on first
# use). Nothing here sets `-e`: when sourced, a failure returns without killing the shell.

_gpu_unpack() {
  local repo target bundle want have py
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  target=${1:-/tmp/site}
  bundle=${GPU_BUNDLE_DIR:-$repo/.gpu_bundle}
  py=${PYTHON:-python3}
  for f in sglang.tar.xz deps.tar.xz flash_mla.tar.xz sgl_kernel.tar.xz mooncake.tar.xz router.tar.xz MANIFEST; do
    if [ ! -f "$bundle/$f" ]; then
      echo "gpu_unpack: $bundle/$f is missing: build the bundle with 'bash scripts/gpu_bundle.sh' where" \
        "the package index is reachable, and name .gpu_bundle in the run's carry" >&2
      return 1
    fi
  done
  want=$(sed -n 's/^python //p' "$bundle/MANIFEST")
  have=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || return 1
  if [ "$want" != "$have" ]; then
    echo "gpu_unpack: the bundle is for CPython $want but $py is $have; rebuild it with" \
      "GPU_BUNDLE_PYTHON=$have bash scripts/gpu_bundle.sh, or set PYTHON=" >&2
    return 1
  fi
  "$py" - "$bundle" "$target" "$repo" <<'EOF' || return 1
import hashlib, os, shutil, sys, tarfile, time, tomllib

bundle, target, repo = sys.argv[1:]
t0 = time.monotonic()
parts = ["sglang.tar.xz", "deps.tar.xz", "flash_mla.tar.xz", "sgl_kernel.tar.xz", "mooncake.tar.xz", "router.tar.xz"]
digest = hashlib.sha256()
for part in parts + ["MANIFEST"]:
    with open(os.path.join(bundle, part), "rb") as f:
        digest.update(f.read())
stamp = os.path.join(target, ".gpu_bundle_stamp")
if os.path.exists(stamp) and open(stamp).read() == digest.hexdigest():
    print(f"gpu_unpack: {target} already holds this bundle")
else:
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for part in parts:
        with tarfile.open(os.path.join(bundle, part)) as tar:
            tar.extractall(target, filter="data")
    # Our plugin's entry point, as `pip install` would declare it (SGLang's load_plugins reads it).
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    info = os.path.join(target, f"sglang_nsa_cp-{project['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, entries in project.get("entry-points", {}).items():
            f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    with open(stamp, "w") as f:
        f.write(digest.hexdigest())
    print(f"gpu_unpack: {target} filled in {time.monotonic() - t0:.1f} s")
EOF
  export PYTHONPATH="$target:$repo/python${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$target/bin:$PATH"  # ninja, for the CUDA kernels built on first use
  echo "export PYTHONPATH=$PYTHONPATH PATH=$PATH"
}

_gpu_unpack "$@"
_gpu_unpack_rc=$?
unset -f _gpu_unpack
# Sourced: hand the status to the caller's shell; run: exit with it.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  return $_gpu_unpack_rc
fi
exit $_gpu_unpack_rc
