#!/bin/sh
# The image's build stage: configure, build and install the daemons and the
# CLI (and, with TESSEL_CUDA=ON, the CUDA plugin beside the worker) into
# PREFIX. Usage: build-stage.sh SOURCE_DIR BUILD_DIR PREFIX
set -eu
src=$1 build=$2 prefix=$3
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTESSEL_BUILD_TESTS=OFF -DTESSEL_CUDA="${TESSEL_CUDA:-OFF}"
targets="tessel-coordinator tessel-worker tessel"
[ "${TESSEL_CUDA:-OFF}" = ON ] && targets="$targets tessel_cuda_plugin"
# shellcheck disable=SC2086
cmake --build "$build" -j "$(nproc)" --target $targets
cmake --install "$build" --prefix "$prefix" --component runtime
