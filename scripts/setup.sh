#!/usr/bin/env bash
# Installs what Tessel needs to build and test (Debian packages, numpy) when
# missing, then configures and builds into build/. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(cmake g++ make pkg-config protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
          libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
          libopenblas-dev python3)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! python3 -c "import numpy" >/dev/null 2>&1; then
  echo "setup: installing numpy"
  python3 -m pip install -q numpy
fi

BUILD_TYPE=${TESSEL_BUILD_TYPE:-RelWithDebInfo}
cmake -S . -B build -DCMAKE_BUILD_TYPE="$BUILD_TYPE" >/dev/null
cmake --build build -j "${TESSEL_BUILD_JOBS:-$(nproc)}" "$@"
