#!/usr/bin/env bash
# Runs tessel-bench, tessel-scale-bench, bench/python_bench.py and bench/checkpoint_bench.py (one run each, on a quiet
# machine: nothing else building or testing), keeps their output in
# bench/results/, and writes docs/performance.md and its plot from it
# (scripts/performance_page.py). Needs a build (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TESSEL_VENV:-$PWD/.venv}
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check matplotlib
mkdir -p bench/results
{
  echo "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores,"
  echo "$(date -u +%Y-%m-%d)"
} | paste -sd' ' > bench/results/machine.txt
build/bin/tessel-bench --json > bench/results/tessel_bench.json.tmp
mv bench/results/tessel_bench.json.tmp bench/results/tessel_bench.json
build/bin/tessel-scale-bench --json > bench/results/scale_bench.json.tmp
mv bench/results/scale_bench.json.tmp bench/results/scale_bench.json
TESSEL_BIN_DIR=$PWD/build/bin "$VENV/bin/python" bench/python_bench.py --json > bench/results/python_bench.json.tmp
mv bench/results/python_bench.json.tmp bench/results/python_bench.json
TESSEL_BIN_DIR=$PWD/build/bin "$VENV/bin/python" bench/checkpoint_bench.py --json > bench/results/checkpoint_bench.json.tmp
mv bench/results/checkpoint_bench.json.tmp bench/results/checkpoint_bench.json
"$VENV/bin/python" scripts/performance_page.py
