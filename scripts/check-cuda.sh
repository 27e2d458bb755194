#!/usr/bin/env bash
# CI compile check of the CUDA backend on a machine WITHOUT a GPU:
#   1. pip-installs NVRTC for CUDA 13 (PyPI `nvidia-cuda-nvrtc`) into a venv under target/;
#   2. finds libnvrtc.so* and puts its folder on LD_LIBRARY_PATH (cudarc dlopens libnvrtc.so / libnvrtc.so.13);
#   3. compiles every kernels/cuda/*.cu through NVRTC for sm_80 and sm_90 (tests/cuda_nvrtc.rs; NVRTC needs no GPU);
#   4. builds `pagoda-kernels --features cuda` and lints the GPU runner (`pagoda --features cuda`: pagoda-worker's
#      runner_cuda and model::cuda, and their tests);
#   5. runs the kernel and whole-model parity tests, which skip without a device.
# Usage: bash scripts/check-cuda.sh        (env NVRTC_VERSION overrides the pinned NVRTC wheel version)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# 13.0.x matches the driver (580, CUDA 13.0) of the GPU machines: PTX from a newer NVRTC would not load there.
NVRTC_VERSION=${NVRTC_VERSION:-13.0.88}
# One venv per NVRTC version: a venv of another version would be reused as it is.
venv="$root/target/cuda-ci-venv-$NVRTC_VERSION"

if ! find "$venv" -name 'libnvrtc.so*' 2>/dev/null | grep -q .; then
  echo "check-cuda: installing nvidia-cuda-nvrtc==$NVRTC_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi

lib=$(find "$venv" -name 'libnvrtc.so*' ! -name '*builtins*' ! -name '*alt*' | sort | head -n 1)
if [ -z "$lib" ]; then
  echo "check-cuda: no libnvrtc.so* under $venv" >&2
  exit 1
fi
libdir=$(dirname "$lib")
echo "check-cuda: using $lib"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PAGODA_REQUIRE_NVRTC=1
# Keep this run's PTX cache inside target/ (the cache test writes its own temp dir).
export PAGODA_CUDA_CACHE="$root/target/cuda-ptx-cache"

echo "check-cuda: cargo build -p pagoda-kernels --features cuda"
cargo build -p pagoda-kernels --features cuda

echo "check-cuda: NVRTC compile of every .cu for sm_80 and sm_90"
cargo test -p pagoda-kernels --features cuda --test cuda_nvrtc -- --nocapture

echo "check-cuda: clippy of the GPU runner (pagoda, pagoda-worker, pagoda-kernels with --features cuda)"
cargo clippy -p pagoda -p pagoda-worker -p pagoda-kernels --all-targets --features cuda -- -D warnings

echo "check-cuda: the CUDA modules' own unit tests (host-side: argument checks, the NCCL id, the runner's error classes)"
cargo test -p pagoda-kernels --features cuda --lib cuda::
cargo test -p pagoda-worker --features cuda --lib runner_cuda::

echo "check-cuda: parity tests (they skip without a CUDA device)"
cargo test -p pagoda-kernels --features cuda --test cuda_parity -- --nocapture
cargo test -p pagoda-worker --features cuda --test cuda_model -- --nocapture
echo "check-cuda: ok"
