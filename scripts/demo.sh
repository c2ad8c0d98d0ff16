#!/usr/bin/env bash
# Sets up, builds, and trains an MLP on a local cluster of two worker processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --target mlp_demo tessel tessel-coordinator tessel-worker
exec build/bin/mlp_demo
