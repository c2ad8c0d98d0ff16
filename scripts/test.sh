#!/usr/bin/env bash
# Sets up, builds, and runs every test: unit tests, integration tests on a
# real local cluster, and the op conformance suite against numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure --timeout 600 -j 1 "$@"
