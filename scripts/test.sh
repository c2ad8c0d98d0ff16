#!/usr/bin/env bash
# Sets up, builds, checks formatting, and runs the test tiers (the README's
# table): the fast tier (ctest: unit, integration, conformance, differential,
# docs, a short soak), then checked concurrency (one clang build with the lock
# analysis, ASan and UBSan, and the run of the concurrency suites on it). With
# TESSEL_SOAK=1 the soak tier's long runs replace the short ones. Arguments
# go to ctest (and skip the concurrency tier): scripts/test.sh -R Collectives.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check_format.sh
(cd build && ctest --output-on-failure --timeout 600 -j 1 "$@")
# Checked concurrency: one clang build of the whole tree with ASan + UBSan,
# which also runs clang's lock analysis, then the worker, collectives,
# scheduler and cluster suites on it.
if [ $# -eq 0 ]; then
  scripts/sanitize.sh address
fi
