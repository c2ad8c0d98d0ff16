#!/usr/bin/env bash
# A worker inside a memory-limited cgroup sizes its CPU devices from the
# limit, not from the machine's memory, and refuses an explicit per-device
# limit that would take them past it. The cgroup is one this test creates
# below the one it runs in (v2 memory.max, or v1 memory.limit_in_bytes) and
# removes. Usage: cgroup_memory_test.sh BUILD_DIR. Exits 77 (skipped) where
# no memory cgroup can be created (no root, no delegation).
set -euo pipefail
worker=$1/bin/tessel-worker
limit=$((256 << 20))
cg=""
own=$(awk -F: '$1 == "0" && $2 == "" {print $3}' /proc/self/cgroup)
if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  dir=/sys/fs/cgroup${own%/}/tessel-test-$$
  if mkdir "$dir" 2>/dev/null; then
    if echo "$limit" > "$dir/memory.max" 2>/dev/null; then cg=$dir; else rmdir "$dir"; fi
  fi
fi
if [[ -z "$cg" && -d /sys/fs/cgroup/memory ]]; then
  dir=/sys/fs/cgroup/memory/tessel-test-$$
  if mkdir "$dir" 2>/dev/null; then
    if echo "$limit" > "$dir/memory.limit_in_bytes" 2>/dev/null; then cg=$dir; else rmdir "$dir"; fi
  fi
fi
if [[ -z "$cg" ]]; then
  echo "SKIP: cannot create a memory-limited cgroup here"
  exit 77
fi
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
# Runs the worker inside the cgroup; no coordinator answers, so it stops
# after sizing its devices.
run() {
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" "$worker" --coordinator=127.0.0.1:1 --register_timeout_s=1 \
    --devices=2 "$@" 2>&1 || true
}
out=$(run)
want="CPU devices: 2 of $((limit / 10 * 8 / 2)) bytes each ($limit bytes available, from $cg/"
if ! grep -qF "$want" <<<"$out"; then
  echo "FAIL: expected '$want' in the worker's log:"; echo "$out"; exit 1
fi
out=$(run --device_memory_bytes=$((200 << 20)))
want="--device_memory_bytes=$((200 << 20)) for 2 CPU devices ($((400 << 20)) bytes in all) exceeds the $limit bytes this process may use"
if ! grep -qF -- "$want" <<<"$out"; then
  echo "FAIL: expected '$want' in the worker's log:"; echo "$out"; exit 1
fi
echo "a worker in a cgroup of $limit bytes gives its 2 CPU devices 80% of it and refuses more"
