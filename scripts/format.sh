#!/usr/bin/env bash
# Formats the tree: C++ with clang-format 14 (.clang-format: Google style,
# 100 columns), Python with ruff (pyproject.toml). scripts/check_format.sh is
# the check that CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TESSEL_VENV:-$PWD/.venv}
git ls-files -z '*.cc' '*.h' | xargs -0 clang-format-14 -i
"$VENV/bin/ruff" check --fix --quiet .
"$VENV/bin/ruff" format --quiet .
