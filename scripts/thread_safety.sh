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
echo "thread-safety analysis: clean"
