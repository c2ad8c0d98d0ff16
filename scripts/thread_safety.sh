#!/usr/bin/env bash
# Builds the tree with clang and -Wthread-safety -Werror=thread-safety
# (build-tsa/): every ABSL_GUARDED_BY and ABSL_EXCLUSIVE_LOCKS_REQUIRED is
# checked, where GCC ignores them. Expects scripts/setup.sh to have installed
# the dependencies (clang-16 among them).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=clang++-16 CC=clang-16 cmake -S . -B build-tsa -DCMAKE_BUILD_TYPE=Debug -DTESSEL_CUDA=OFF -DTESSEL_NATIVE=OFF \
  -DCMAKE_CXX_FLAGS_DEBUG=-O0 >/dev/null
cmake --build build-tsa -j "${TESSEL_BUILD_JOBS:-$(nproc)}"
# The CUDA backend's locking code, where the toolkit's headers are present
# (that build leaves the backend out): checked the same way, syntax only.
if [ -f /usr/local/cuda/include/nccl.h ]; then
  for f in worker/cuda/cuda_device.cc worker/cuda/nccl_communicator.cc worker/cuda/nccl_communicator_test.cc; do
    clang++-16 -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -I. -Ibuild-tsa/gen -Iclient/include \
      -I/usr/local/cuda/include "$f"
  done
fi
echo "thread-safety analysis: clean"
