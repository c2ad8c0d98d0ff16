#!/usr/bin/env bash
# Sets up, builds, checks formatting, and runs the test tiers (the README's
# table): the fast tier (ctest: unit, integration, conformance, differential,
# docs, a short soak), then checked concurrency (the clang thread-safety
# build and the ASan + UBSan run of the concurrency suites). With
# TESSEL_SOAK=1 the soak tier's long runs replace the short ones. Arguments
# go to ctest (and skip the concurrency tier): scripts/test.sh -R Collectives.
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
