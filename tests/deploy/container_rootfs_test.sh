#!/usr/bin/env bash
# The container image's runtime stage, checked without a container runtime.
# A Debian 12 minbase root filesystem (debootstrap: what debian:bookworm-slim
# is made from) gets deploy/docker/runtime-stage.sh run inside it, as the
# Dockerfile runs it, and the `runtime` install component, as
# deploy/docker/build-stage.sh installs it. Then, inside that root and as the
# image's user (uid 10001), nothing else on the library path:
#   - every library the binaries link resolves;
#   - a coordinator and a worker start, and the image's HEALTHCHECK command
#     (`tessel health`) reports both SERVING;
#   - `tessel run` computes axpy on the worker, checked against numpy outside;
#   - once the coordinator stops, the probe fails and says so.
# The bare base is made once and kept (BUILD_DIR/container/base); each run
# stages a fresh copy of it. Usage: container_rootfs_test.sh BUILD_DIR.
# Exits 77 (skipped) when not root or when debootstrap or the Debian mirror is
# unavailable ($TESSEL_DEBIAN_MIRROR, default deb.debian.org).
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) == 0 ]] || skip "needs root (chroot and mount)"
command -v debootstrap >/dev/null || skip "debootstrap is not installed"
mirror=${TESSEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$build/container
base=$work/base
mkdir -p "$work"
if [[ ! -f $base/.complete ]]; then
  rm -rf "$base"
  echo "debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$base" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    skip "debootstrap of bookworm from $mirror failed (log: $work/debootstrap.log)"
  touch "$base/.complete"
fi

rootfs=$work/rootfs
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for m in dev proc; do mountpoint -q "$rootfs/$m" && umount -l "$rootfs/$m"; done
  rm -rf "$rootfs"
}
trap cleanup EXIT
rm -rf "$rootfs"
cp -a "$base" "$rootfs"
rm -f "$rootfs/.complete"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
mount -t proc proc "$rootfs/proc"
mount --bind /dev "$rootfs/dev"

echo "--- runtime stage (deploy/docker/runtime-stage.sh) inside the root"
mkdir -p "$rootfs/tmp/stage"
cp "$src/deploy/docker/runtime-stage.sh" "$src/deploy/docker/runtime-packages" "$rootfs/tmp/stage/"
chroot "$rootfs" /tmp/stage/runtime-stage.sh
rm -rf "$rootfs/tmp/stage"
cmake --install "$build" --prefix "$rootfs/opt/tessel" --component runtime >/dev/null
[[ $(chroot "$rootfs" id -u tessel) == 10001 ]] || { echo "FAIL: the image's user is not uid 10001"; exit 1; }

in_image() {  # run as the image's user, with the image's environment only
  chroot --userspec=10001:10001 "$rootfs" env -i PATH=/opt/tessel/bin:/usr/bin:/bin HOME=/var/lib/tessel \
    sh -c 'cd /var/lib/tessel && exec "$@"' sh "$@"
}
daemon() {  # in_image in the background, each step exec'ing the next: $! is the daemon's pid
  local log=$1
  shift
  (exec chroot --userspec=10001:10001 "$rootfs" env -i PATH=/opt/tessel/bin:/usr/bin:/bin HOME=/var/lib/tessel \
    sh -c 'cd /var/lib/tessel && exec "$@"' sh "$@" >"$log" 2>&1) &
}

for b in tessel-coordinator tessel-worker tessel; do
  if chroot "$rootfs" ldd "/opt/tessel/bin/$b" | grep "not found"; then
    echo "FAIL: $b needs libraries the runtime stage does not install (deploy/docker/runtime-packages)"
    exit 1
  fi
done
echo "the binaries' libraries all resolve inside the root"

free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cport=$(free_port)
wport=$(free_port)
daemon "$work/coordinator.log" tessel-coordinator --host=127.0.0.1 --port="$cport"
pids+=($!)
cpid=$!
daemon "$work/worker.log" tessel-worker --coordinator=127.0.0.1:"$cport" --host=127.0.0.1 --port="$wport" --devices=2
pids+=($!)
# The HEALTHCHECK command on each daemon (the whole server), then by service
# name: the worker's once it has registered.
for probe in "$cport" "$wport" "$wport tessel.v1.Worker"; do
  set -- $probe
  for _ in $(seq 100); do
    in_image tessel health --address "127.0.0.1:$1" --service "${2:-}" --timeout 2 >/dev/null 2>&1 && break
    sleep 0.2
  done
  if ! out=$(in_image tessel health --address "127.0.0.1:$1" --service "${2:-}" 2>&1); then
    echo "FAIL: no SERVING from 127.0.0.1:$1 ${2:-}: $out"
    tail -20 "$work/coordinator.log" "$work/worker.log"
    exit 1
  fi
  echo "HEALTHCHECK: $out"
done
# An unknown service name is named.
if out=$(in_image tessel health --address "127.0.0.1:$cport" --service tessel.v1.Nope 2>&1) ||
   [[ $out != *"no status for the service 'tessel.v1.Nope'"* ]]; then
  echo "FAIL: an unknown service name: $out"; exit 1
fi
for p in "${pids[@]}"; do
  read -r name uid < <(awk '/^Name:/ {n = $2} /^Uid:/ {print n, $2}' "/proc/$p/status")
  [[ $uid == 10001 ]] || { echo "FAIL: $name runs as uid $uid, not 10001"; exit 1; }
  echo "$name runs as uid $uid"
done

# Wait until the worker's devices are registered, then compute.
for _ in $(seq 100); do in_image tessel status --coordinator "127.0.0.1:$cport" 2>/dev/null | grep -q "device" && break; sleep 0.2; done
cp "$src/examples/graphs/axpy.textproto" "$rootfs/var/lib/tessel/"
"$py" -c 'import numpy as np, sys; np.save(sys.argv[1], np.array([1.5, -2, 0.25, 8], np.float32))' "$rootfs/var/lib/tessel/x.npy"
chown 10001:10001 "$rootfs/var/lib/tessel/"*
in_image tessel run axpy.textproto --input x=x.npy --fetch y=y.npy --device 1 --coordinator "127.0.0.1:$cport"
"$py" - "$rootfs/var/lib/tessel" <<'PY'
import sys
import numpy as np
d = sys.argv[1]
x, y = np.load(f"{d}/x.npy"), np.load(f"{d}/y.npy")
assert y.dtype == np.float32 and y.shape == (4,), (y.dtype, y.shape)
np.testing.assert_array_equal(y, np.float32(2) * x + np.float32(1))
print("tessel run inside the root: y = 2x + 1 as numpy computes it")
PY

kill "$cpid"
wait "$cpid" 2>/dev/null || true
if out=$(in_image tessel health --address "127.0.0.1:$cport" --timeout 1 2>&1); then
  echo "FAIL: the probe passed with the coordinator stopped: $out"
  exit 1
fi
echo "with the coordinator stopped, the probe fails: $out"
