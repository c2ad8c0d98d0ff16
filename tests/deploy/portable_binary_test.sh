#!/usr/bin/env bash
# A portable build stays portable: built for an x86-64 ISA level (the
# default, TESSEL_ISA), the worker holds no AVX-512 instruction (none with
# an EVEX prefix, which every AVX-512 encoding has, on any register width),
# so it runs on any CPU of that level.
# Usage: portable_binary_test.sh WORKER_BINARY ISA. Exits 77 (skipped) for a
# -march=native or v4 build, or without objdump.
set -euo pipefail
worker=$1 isa=$2
case "$isa" in
  x86-64-v2|x86-64-v3) ;;
  *) echo "SKIP: the kernels were built for '$isa', which may use AVX-512"; exit 77 ;;
esac
command -v objdump >/dev/null || { echo "SKIP: objdump is not installed"; exit 77; }
# In 64-bit code an instruction whose opcode starts with 0x62 (after at most
# an address-size prefix) is EVEX-encoded.
evex() { objdump -d "$worker" | awk -F'\t' 'NF >= 3 && ($2 ~ /^62 / || $2 ~ /^67 62 /)'; }
hits=$(evex | wc -l)
if [[ "$hits" != 0 ]]; then
  echo "FAIL: $worker (built for $isa) holds $hits AVX-512 (EVEX) instructions, e.g.:"
  evex | head -5
  exit 1
fi
echo "$worker: no AVX-512 instruction in a build for $isa"
