#!/usr/bin/env bash
# Fails, naming the files, when the tree is not as scripts/format.sh leaves
# it: C++ against .clang-format (clang-format 14), Python against ruff's
# lint and format (pyproject.toml). Run first by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TESSEL_VENV:-$PWD/.venv}
status=0
if ! git ls-files -z '*.cc' '*.h' | xargs -0 clang-format-14 --dry-run --Werror 2>/tmp/tessel-clang-format.$$; then
  echo "check_format: C++ files differ from .clang-format (run scripts/format.sh):" >&2
  grep -o '^[^:]*\.\(cc\|h\):' /tmp/tessel-clang-format.$$ | sort -u | sed 's/:$//; s/^/  /' >&2
  status=1
fi
rm -f /tmp/tessel-clang-format.$$
"$VENV/bin/ruff" check . || { echo "check_format: ruff lint findings above" >&2; status=1; }
"$VENV/bin/ruff" format --check . || { echo "check_format: Python files differ from ruff format (run scripts/format.sh)" >&2; status=1; }
exit $status
