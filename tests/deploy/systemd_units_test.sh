#!/usr/bin/env bash
# The systemd units as `cmake --install` lays them out: installed into a
# staging root (with the host's own units, which ours order against),
# `systemd-analyze verify` must pass against the installed binaries, and
# `systemd-analyze security` must rate each unit OK (exposure <= 4.0).
# Then Type=notify for real: the coordinator, started with $NOTIFY_SOCKET as
# systemd starts it, must say READY=1 once it serves and STOPPING=1 on SIGTERM.
# Usage: systemd_units_test.sh BUILD_DIR. Exits 77 (skipped) without systemd-analyze.
set -euo pipefail
build=$1
python3 - "$build/bin/tessel-coordinator" <<'PY'
import os, signal, socket, subprocess, sys, tempfile
path = os.path.join(tempfile.mkdtemp(), "notify")
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(path)
s.settimeout(20)
p = subprocess.Popen([sys.argv[1], "--port=0"], env={**os.environ, "NOTIFY_SOCKET": path},
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    ready = s.recv(4096).decode()
    assert "READY=1" in ready and "STATUS=serving on 127.0.0.1:" in ready, ready
    p.send_signal(signal.SIGTERM)
    stopping = s.recv(4096).decode()
    assert stopping == "STOPPING=1", stopping
    assert p.wait(timeout=20) == 0
finally:
    p.kill()
print("tessel-coordinator: READY=1 once serving, STOPPING=1 on SIGTERM")
PY
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze is not installed"
  exit 77
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
DESTDIR=$root cmake --install "$build" --prefix /usr/local >/dev/null
mkdir -p "$root/usr/lib/systemd" "$root/etc/tessel"
cp -r /lib/systemd/system "$root/usr/lib/systemd/"
cp "$root/usr/local/share/tessel/coordinator.env" "$root/usr/local/share/tessel/worker.env" "$root/etc/tessel/"
status=0
for unit in tessel-coordinator tessel-worker; do
  file=$root/usr/local/lib/systemd/system/$unit.service
  grep -q "^ExecStart=/usr/local/bin/$unit " "$file" || { echo "FAIL: $unit: ExecStart does not name the installed binary"; status=1; }
  if ! out=$(systemd-analyze --root="$root" verify "$unit.service" 2>&1) || [ -n "$out" ]; then
    echo "FAIL: systemd-analyze verify $unit.service:"; echo "$out"; status=1
  fi
  report=$(systemd-analyze security --offline=true --root="$root" "$unit.service" 2>&1 || true)
  level=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<<"$report")
  if [ -z "$level" ] || ! awk -v l="$level" 'BEGIN { exit !(l <= 4.0) }'; then
    echo "FAIL: $unit.service exposure '${level}', wanted <= 4.0:"; echo "$report"; status=1
  else
    echo "$unit.service: verify clean, exposure $level"
  fi
done
exit $status
