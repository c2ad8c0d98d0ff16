#!/usr/bin/env bash
# The C++ SDK as another project sees it: the build installed into a
# staging prefix, then tests/deploy/consumer configured against it with
# find_package(tessel), built and run (it starts a local cluster from the
# installed daemons); then the same source built with pkg-config's flags
# alone, and run.
# Usage: find_package_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cmake --install "$build" --prefix "$stage/prefix" >/dev/null
for f in include/tessel/session.h lib/libtessel_client.a lib/cmake/tessel/tesselConfig.cmake lib/pkgconfig/tessel.pc \
         bin/tessel-worker bin/tessel-coordinator bin/tessel; do
  [[ -e "$stage/prefix/$f" ]] || { echo "FAIL: the install has no $f"; exit 1; }
done
cmake -S "$here/consumer" -B "$stage/build" -DCMAKE_PREFIX_PATH="$stage/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$stage/build" >/dev/null
(cd "$stage" && env -u TESSEL_BIN_DIR "$stage/build/consumer")
flags=$(PKG_CONFIG_PATH="$stage/prefix/lib/pkgconfig" pkg-config --cflags --libs tessel)
g++ -std=c++20 -O1 -o "$stage/consumer-pc" "$here/consumer/main.cc" -DTESSEL_INSTALLED_BIN="\"$stage/prefix/bin\"" $flags
(cd "$stage" && env -u TESSEL_BIN_DIR "$stage/consumer-pc")
echo "find_package(tessel) and pkg-config tessel both build a consumer that runs"
