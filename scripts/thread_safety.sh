#!/usr/bin/env bash
# clang's lock analysis: every ABSL_GUARDED_BY and ABSL_EXCLUSIVE_LOCKS_REQUIRED
# checked, where GCC ignores them (-Wthread-safety -Werror=thread-safety, which
# CMakeLists.txt adds for clang).
#   scripts/thread_safety.sh              # the tree, built with clang 16 at -O0 (build-tsa/)
#   scripts/thread_safety.sh --cuda DIR   # only the CUDA backend's files, syntax only, against
#                                         # DIR's generated headers (scripts/sanitize.sh address
#                                         # builds the rest with clang, so it checks them there)
# The clang builds leave the CUDA backend out; its locking code is checked
# here where the toolkit's headers are present. Expects scripts/setup.sh to
# have installed the dependencies (clang-16 among them).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --cuda ]; then
  dir=${2:?usage: $0 --cuda BUILD_DIR}
else
  dir=build-tsa
  CXX=clang++-16 CC=clang-16 cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug -DTESSEL_CUDA=OFF -DTESSEL_NATIVE=OFF \
    -DCMAKE_CXX_FLAGS_DEBUG=-O0 >/dev/null
  cmake --build "$dir" -j "${TESSEL_BUILD_JOBS:-$(nproc)}"
fi
if [ -f /usr/local/cuda/include/nccl.h ]; then
  for f in worker/cuda/cuda_device.cc worker/cuda/nccl_communicator.cc worker/cuda/nccl_communicator_test.cc; do
    clang++-16 -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -I. -I"$dir/gen" -Iclient/include \
      -I/usr/local/cuda/include "$f"
  done
fi
echo "thread-safety analysis: clean"
