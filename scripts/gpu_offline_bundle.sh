#!/usr/bin/env bash
# For a GPU host without network (scripts/gpu_check.sh's GPU_CHECK_OFFLINE mode): pack what its
# python3 lacks -- apache-tvm, apache-tvm-ffi and the mpich wheel's MPI -- small enough to
# travel, then unpack it there.
#   here:  scripts/gpu_offline_bundle.sh pack DIR [PYVER]   (PYVER of the host's python3, 3.12)
#   there: source scripts/gpu_offline_bundle.sh unpack DIR && GPU_CHECK_OFFLINE=1 bash scripts/gpu_check.sh
# DIR gets tvm_compiler.so.xz (TVM's 259 MB compiler library alone, ~58 MB xz: a transfer
# limit of 64 MiB then takes it in one call and the rest in the next, on the same machine) and
# rest.tar.xz (~8 MB: TVM's Python and runtime libraries without its cutlass headers, C++
# sources and web runtime; tvm-ffi; mpich's libmpi, headers and mpiexec). unpack installs them
# into python3's site-packages / prefix and exports LD_LIBRARY_PATH for the CUDA runtime and
# NCCL wheels of the image (TVM's CUDA runtime needs libcudart.so.13 at load time).
# pack was run here (2026-11-27: 57.8 + 9.3 MB); unpack is the steps the H200 run of that day
# took from a wrapper of its own (bench/RESULTS.md), not this file itself
set -euo pipefail
mode="$1" dir="$2" pyver="${3:-3.12}"
if [ "$mode" = pack ]; then
  mkdir -p "$dir"; work="$(mktemp -d)"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$work/whl" apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.15.post2 mpich==5.0.2
  mkdir -p "$work/site" "$work/prefix"
  (cd "$work/site" && for w in "$work"/whl/apache_tvm*.whl; do unzip -q -o "$w"; done)
  (cd "$work" && unzip -q "$work"/whl/mpich-*.whl && mv mpich-*.data/data/* prefix/ \
     && mv mpich-*.dist-info site/ && rm -f prefix/lib/libmpi_abi.so*)
  rm -rf "$work"/site/tvm/{3rdparty,src,web,licenses}
  xz --x86 --lzma2=preset=9e,dict=256MiB -T1 -c "$work/site/tvm/lib/libtvm_compiler.so" \
    > "$dir/tvm_compiler.so.xz" &
  tar cf - -C "$work" --exclude=site/tvm/lib/libtvm_compiler.so site prefix \
    | xz --x86 --lzma2=preset=9e -T1 > "$dir/rest.tar.xz"
  wait
  rm -rf "$work"; ls -la "$dir"
elif [ "$mode" = unpack ]; then
  purelib="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  prefix="$(python3 -c 'import sys; print(sys.prefix)')"
  tmp="$(mktemp -d)"
  xz -dc "$dir/rest.tar.xz" | tar xf - -C "$tmp"
  cp -a "$tmp"/site/* "$purelib"/ && cp -a "$tmp"/prefix/* "$prefix"/ && rm -rf "$tmp"
  xz -dc "$dir/tvm_compiler.so.xz" > "$purelib/tvm/lib/libtvm_compiler.so"
  libdirs="$(find "$purelib/nvidia" /usr/local/cuda/targets -name 'libcudart.so.1*' \
    -o -name 'libnccl.so.2*' 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')"
  export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
  python3 -c "import tvm; print('tvm', tvm.__version__, 'cuda', tvm.cuda(0).exist)"
else
  echo "usage: $0 pack|unpack DIR [PYVER]" >&2; exit 2
fi
