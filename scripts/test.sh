#!/usr/bin/env bash
# Sets up, builds, and runs every test: the format check, unit tests,
# integration tests on a real local cluster, the op conformance suite against
# numpy; then the clang thread-safety build and the ASan + UBSan run of the
# concurrency suites.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check_format.sh
(cd build && ctest --output-on-failure --timeout 600 -j 1 "$@")
# Checked concurrency: clang's lock analysis over the whole tree, then the
# worker, collectives, scheduler and cluster suites under ASan + UBSan.
if [ $# -eq 0 ]; then
  scripts/thread_safety.sh
  scripts/sanitize.sh address
fi
