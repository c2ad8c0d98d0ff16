#!/usr/bin/env bash
# Everything Tessel can check on an NVIDIA GPU, in one command: builds
# (scripts/setup.sh), runs every CUDA test, the op conformance suite, the
# Python op suite and the differential harness on CUDA devices, then the GPU
# benchmarks, and prints one table. Exits nonzero if any step failed.
#
#   scripts/gpu-check.sh                 build, then check
#   TESSEL_BIN_DIR=DIR scripts/gpu-check.sh   check binaries built elsewhere
#
# Needs: an NVIDIA GPU and its driver (nvidia-smi), the CUDA toolkit with
# NVRTC, cuBLASLt and NCCL (/usr/local/cuda) for the build, and for the MLP
# benchmark jax with its CUDA plugin. TESSEL_DIFF_PROGRAMS sets how many
# random programs the differential harness runs (default 300: each new
# program costs an NVRTC compile on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus=$(nvidia-smi -L 2>&1) || [ -z "$gpus" ]; then
  echo "gpu-check: needs an NVIDIA GPU with its driver: nvidia-smi ${gpus:-is not on the PATH}" >&2
  exit 2
fi
echo "$gpus"

if [ -z "${TESSEL_BIN_DIR:-}" ]; then
  scripts/setup.sh || { echo "gpu-check: the build failed" >&2; exit 1; }
  export TESSEL_BIN_DIR=$root/build/bin
fi
bin=$TESSEL_BIN_DIR
if [ ! -x "$bin/cuda_device_test" ] || [ ! -x "$bin/nccl_test" ] || [ ! -x "$bin/tessel-gpu-bench" ] ||
   [ ! -f "$bin/libtessel_cuda.so" ]; then
  echo "gpu-check: $bin has no CUDA backend (libtessel_cuda.so, cuda_device_test, nccl_test, tessel-gpu-bench): CMake did not find the CUDA" \
       "toolkit with NVRTC, cuBLASLt and NCCL; see 'Tessel CUDA backend' in the cmake output" >&2
  exit 2
fi
export TESSEL_DEVICE_KIND=cuda PYTHONUNBUFFERED=1
export PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
logs=$(mktemp -d /tmp/tessel-gpu-check-XXXXXX)
rows=()
failed=0

# step NAME COMMAND...: runs it with its output in $logs/NAME.log; the
# table row is the status and the log's last summary line.
step() {
  local name=$1
  shift
  local t0=$SECONDS rc
  echo "== $name: $*"
  "$@" >"$logs/$name.log" 2>&1
  rc=$?
  local summary
  summary=$(grep -E "PASSED|FAILED|passed|failed|cases,|SKIPPED" "$logs/$name.log" | tail -1)
  if [ $rc -ne 0 ]; then
    failed=1
    tail -40 "$logs/$name.log"
  elif grep -q "^\[  SKIPPED \]" "$logs/$name.log"; then
    rc=skipped  # a GPU test that skips on a GPU machine is a failure of the check
    failed=1
  fi
  rows+=("$(printf '%-24s %-8s %5ss  %s' "$name" "$([ "$rc" = 0 ] && echo ok || echo "FAIL($rc)")" \
    $((SECONDS - t0)) "${summary:0:90}")")
}

step cuda_device_test "$bin/cuda_device_test"
step cuda_kernels_test "$bin/cuda_kernels_test"
step nccl_test "$bin/nccl_test"
step op_conformance python3 tests/conformance/conformance.py --bin "$bin" --device-kind cuda
step python_op_suite python3 -m pytest -q -p no:cacheprovider client/python/tests/test_ops.py
step differential env TESSEL_DIFF_PROGRAMS="${TESSEL_DIFF_PROGRAMS:-300}" \
  python3 -m pytest -q -p no:cacheprovider client/python/tests/test_differential.py
step gpu_bench "$bin/tessel-gpu-bench"
if python3 -c "import jax, sys; sys.exit(0 if jax.devices('gpu') else 1)" >/dev/null 2>&1; then
  step mlp_vs_jax python3 bench/gpu_mlp_bench.py
else
  rows+=("$(printf '%-24s %-8s %5s   %s' mlp_vs_jax "not run" - "jax with a CUDA plugin is not installed")")
fi

echo
echo "GPU check ($(echo "$gpus" | head -1)); logs in $logs"
printf '%-24s %-8s %6s  %s\n' step status time summary
printf '%s\n' "${rows[@]}"
for b in gpu_bench mlp_vs_jax; do
  [ -f "$logs/$b.log" ] && { echo; grep -E "^(benchmark|[a-z_0-9]+ +[0-9])" "$logs/$b.log"; }
done
exit $failed
