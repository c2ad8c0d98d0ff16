#!/usr/bin/env bash
# Sets up, builds, and trains an MLP on a local cluster of two worker processes.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python stubs too: the SDK in .venv runs the examples after this command alone.
scripts/setup.sh --target mlp_demo tessel tessel-coordinator tessel-worker tessel_python_stubs
exec build/bin/mlp_demo
